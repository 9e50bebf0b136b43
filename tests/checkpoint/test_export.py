"""The whole model streamed into ``model.safetensors`` one part at a time (``checkpoint.export``):
the file holds exactly ``engine.full_state_dict()`` (bitwise) at ZeRO-0..3, fp32 and bf16
masters (at ZeRO-3 also with two ranks' masters offloaded to the host), on 4 gloo ranks with
shard weights 5:1:2:2, in one file or Hugging Face shards; while it is written no rank holds
more of the model than one block (counted two ways: the bytes of the parts the export held, and
a dispatch mode counting every tensor allocated on each rank); and the streaming safetensors
writer's files load with ``safetensors`` whatever the order of writes."""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from poplar.checkpoint.errors import CheckpointError
from poplar.checkpoint.export import export_model
from poplar.checkpoint.model_files import ModelFiles
from poplar.checkpoint.streaming_safetensors import StreamingSafetensorsWriter, TensorSpec
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.zero.config import ZeroConfig
from poplar.types.plans import Offload, Plan, RankPlan
from tests.toy import plan_of, with_shards

WEIGHTS = (5, 1, 2, 2)
PLAN = with_shards(plan_of((2, 1, 0), (1, 1, 0), (1, 2, 0), (2, 1, 0)), WEIGHTS)  # n_i = 2, 1, 2, 2
VOCAB, SEQ = 41, 6
# ranks 1 and 3 keep their optimizer (and bf16 master) in host memory
OFFLOADED = Plan([RankPlan(r.micro_batch_size, r.accum_steps, r.last_batch_size, shard_weight=r.shard_weight,
                           offload=Offload.OPTIMIZER if i % 2 else Offload.NONE) for i, r in enumerate(PLAN.ranks)])
# (name, stage, mixed precision, plan): the ways a stage keeps the state it streams
CONFIGS = [("zero3", 3, None, PLAN), ("zero3-bf16", 3, "bf16", PLAN), ("zero3-bf16-offload", 3, "bf16", OFFLOADED),
           ("zero2-bf16", 2, "bf16", PLAN), ("zero1", 1, None, PLAN), ("zero0", 0, None, PLAN)]


class Deep(nn.Module):
    """Six layers of odd sizes (blocks differ in size, none divides by 4 or 10) between a tied
    embedding and head, a LayerNorm and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 19)
        sizes = [19, 37, 23, 41, 29, 31, 19]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.norm = nn.LayerNorm(19)
        self.head = nn.Linear(19, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 19))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(self.norm(h) * self.scale)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(rank: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (PLAN.global_batch_size, SEQ + 1), generator=torch.Generator().manual_seed(3))
    start = PLAN.sample_offsets()[rank]
    return tokens[start:start + PLAN.ranks[rank].num_samples]


def engine_of(rank: int, stage: int, precision: str | None, plan: Plan = PLAN) -> PoplarEngine:
    torch.manual_seed(0)
    model = Deep()
    config = ZeroConfig(3, wrap_policy={nn.Linear, nn.LayerNorm}) if stage == 3 else \
        ZeroConfig(stage, bucket_size_mb=0.004)  # buckets of ~1000 elements: units cut across ranks
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9), zero_stage=config,
                          plan=plan, loss_fn=loss_fn, mixed_precision=precision)
    engine.train_step(batch(rank))
    return engine


class LiveAllocations(TorchDispatchMode):
    """The peak bytes of the storages allocated under the mode: every op's fresh outputs (not
    views, not in-place) are followed, with the views of them made under the mode, through weak
    references; a storage counts its bytes now (a ZeRO-3 block frees its gathered storage by
    resizing it to 0) while any tensor over it lives."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._holders: dict[int, list[weakref.ref]] = {}  # storage pointer -> tensors over it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        fresh = not func.is_view and not func._schema.is_mutable
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                holder = self._holders.get(t.untyped_storage().data_ptr())
                if holder is None and fresh:
                    holder = self._holders[t.untyped_storage().data_ptr()] = []
                if holder is not None:
                    holder.append(weakref.ref(t))
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        total = 0
        for ptr in list(self._holders):
            alive = [t for ref in self._holders[ptr] if (t := ref()) is not None]
            if not alive:
                del self._holders[ptr]
                continue
            total += max(t.untyped_storage().nbytes() if t.untyped_storage().data_ptr() == ptr else 0
                         for t in alive)
        return total


def largest_part_bytes(engine: PoplarEngine) -> int:
    """The largest part the stage streams: at ZeRO-3 a block gathered whole (padding included),
    in the master's dtype; at stages 0-2 a unit (gradient bucket) of fp32 master."""
    if engine.zero_stage == 3:
        return max(b.full_numel * b.element_size for b in engine.stage.blocks)
    return max(u.padded_numel for u in engine.stage.units) * 4


def gather_staging_bytes(engine: PoplarEngine) -> int:
    """At ZeRO-3 the most a gather of one block stages on gloo: every rank's part padded to the
    longest (``comm.uneven``), in the master's dtype; 0 below ZeRO-3."""
    if engine.zero_stage != 3:
        return 0
    return max(len(b.rank_sizes) * max(b.rank_sizes) * b.element_size for b in engine.stage.blocks)


def worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, stage, precision, plan in CONFIGS:
        engine = engine_of(rank, stage, precision, plan)
        directory = os.path.join(root, name)
        with LiveAllocations() as counted:
            report = export_model(engine, directory)
        sharded = export_model(engine, os.path.join(root, name + "-shards"), max_shard_bytes=1500, config=False)
        with LiveAllocations() as gathered_whole:
            full = engine.full_state_dict()
        block = largest_part_bytes(engine)
        out[name] = {"full": full if rank == 0 else None, "report": report, "allocated": counted.peak,
                     "full_state_dict_allocated": gathered_whole.peak, "block": block,
                     "staging": gather_staging_bytes(engine),
                     "shards": sharded.entry}
    engine = engine_of(rank, 3, None)
    try:  # an export rank 0 cannot write is an error on every rank, and no rank waits in a gather
        export_model(engine, os.path.join(root, "zero3", "model.safetensors", "under-a-file"))
        out["unwritable"] = None
    except CheckpointError as e:
        out["unwritable"] = str(e)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("export"))
    return root, spawn(worker, 4, (root,), timeout_s=300)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                      b.reshape(-1).contiguous().view(torch.uint8))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [c[0] for c in CONFIGS])
def test_streamed_file_is_the_full_state_dict_bitwise(name: str, exported: tuple[str, list[dict]]) -> None:
    root, results = exported
    full = results[0][name]["full"]
    streamed = load_file(os.path.join(root, name, "model.safetensors"))
    assert sorted(streamed) == sorted(full)
    assert all(bitwise_equal(streamed[k], full[k]) for k in full), [k for k in full if not
                                                                     bitwise_equal(streamed[k], full[k])]
    assert streamed["head.weight"].equal(streamed["embed.weight"])  # tied: stored under each key
    initial = Deep().state_dict()
    assert not torch.equal(initial["layers.0.weight"], streamed["layers.0.weight"].float())  # trained
    # Hugging Face shards: the same tensors, cut into files of at most 1500 bytes (or one tensor)
    shards = results[0][name]["shards"]["shards"]
    index = json.loads(open(os.path.join(root, name + "-shards", "model.safetensors.index.json")).read())
    assert len(shards) > 3 and sorted({e["file"] for e in shards}) == sorted(set(index["weight_map"].values()))
    merged = {}
    for e in shards:
        part = load_file(os.path.join(root, name + "-shards", e["file"]))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 1500 or len(part) == 1
        merged.update(part)
    assert merged.keys() == full.keys() and all(bitwise_equal(merged[k], full[k]) for k in full)
    assert index["metadata"]["total_size"] == results[0][name]["report"].total_bytes


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["zero3", "zero3-bf16", "zero3-bf16-offload"])
def test_no_rank_holds_more_than_one_block(name: str, exported: tuple[str, list[dict]]) -> None:
    root, results = exported
    for rank, r in enumerate(results):
        report, block = r[name]["report"], r[name]["block"]
        assert report.peak_part_bytes <= block < report.total_bytes / 2, (rank, report, block)
        # every tensor allocated during the export on this rank, at its peak. fp32: the gathered
        # block's own storage, freed by resizing it, so exactly one block at most. bf16: the
        # master block is a fresh tensor, and gloo's worker thread may hold the previous gather's
        # staging (every rank's part padded to the longest) for a moment after the wait returns
        limit = block if name == "zero3" else block + r[name]["staging"]
        assert r[name]["allocated"] <= limit, (rank, r[name]["allocated"], block)
        # the counter sees a whole-model gather: full_state_dict holds every block at once
        assert r[name]["full_state_dict_allocated"] >= report.total_bytes - block


@pytest.mark.multiprocess
def test_stages_0_to_2_stream_without_copies(exported: tuple[str, list[dict]]) -> None:
    root, results = exported
    for r in results:
        # views of what the stage holds: nothing but the two agreements' few bytes of bookkeeping
        assert r["zero0"]["allocated"] < 200 and r["zero1"]["allocated"] < 200, (r["zero0"]["allocated"],
                                                                                  r["zero1"]["allocated"])
        report, unit = r["zero2-bf16"]["report"], r["zero2-bf16"]["block"]
        # one bucket's fp32 master (two for a moment: the previous one's collective outputs, above)
        assert r["zero2-bf16"]["allocated"] <= 2 * unit + 200 < report.total_bytes, (r["zero2-bf16"]["allocated"],
                                                                                      unit)


@pytest.mark.multiprocess
def test_a_failed_write_is_an_error_on_every_rank(exported: tuple[str, list[dict]]) -> None:
    root, results = exported
    assert all(r["unwritable"] is not None and "rank 0" in r["unwritable"] for r in results), results[0]["unwritable"]


def test_writer_streams_any_order_and_loads() -> None:
    values = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16(),
              "d": torch.tensor(2.5, dtype=torch.float16), "e": torch.tensor([True, False, True]),
              "f": torch.zeros(0, 3), "g": torch.randn(2, 3).t()}  # g: not contiguous
    specs = [TensorSpec.of(k, v) for k, v in values.items()]
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"stream-{os.getpid()}.safetensors")
    try:
        writer = StreamingSafetensorsWriter(path, specs, {"format": "pt"})
        for k in ["g", "c", "a", "f", "e", "d", "b"]:
            writer.write(k, values[k])
        writer.close()
        loaded = load_file(path)
        assert loaded.keys() == values.keys()
        assert all(bitwise_equal(loaded[k], values[k]) for k in values)
    finally:
        os.unlink(path)


def test_writer_refuses_what_its_header_does_not_say(tmp_path) -> None:
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [TensorSpec("a", (2,), torch.float32),
                                                                     TensorSpec("b", (1,), torch.float32)])
    with pytest.raises(ValueError, match="header says"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(KeyError, match="no tensor 'c'"):
        writer.write("c", torch.zeros(2))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="never written"):
        writer.close()
    (tmp_path / "m").mkdir()
    ModelFiles(tmp_path / "m", [TensorSpec("a", (2,), torch.float32)], 100).abort()  # a failed export
    assert list((tmp_path / "m").iterdir()) == []
