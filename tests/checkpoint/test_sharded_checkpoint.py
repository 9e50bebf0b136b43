"""Sharded checkpoints (``poplar.checkpoint.cut``): flat ranges as DCP rectangles, bounded memory
during save and load at ZeRO-3 with uneven shards, exact round trips over world sizes, stages and
shard weights (SGD momentum and AdamW), and torch's FSDP2 loading a Poplar checkpoint and back.

Memory is measured as the growth of the process's peak resident set (``/proc/self/status``
VmHWM, reset through ``/proc/self/clear_refs``) over its resident set when the call starts, with
glibc told to give every allocation over 64 KB back to the system when freed
(``MALLOC_MMAP_THRESHOLD_``), so the peak follows the bytes of the tensors (and anything else)
the checkpoint code holds at once.
"""

from __future__ import annotations

import gc
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from poplar.checkpoint import load_checkpoint, load_torch_checkpoint, save_checkpoint
from poplar.checkpoint.cut import boxes, flat_offset
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.types.plans import Plan
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.zero.config import ZeroConfig
from tests.toy import plan_of, with_shards


def _samples(row) -> int:
    return row.micro_batch_size * row.accum_steps + row.last_batch_size

SEQ = 8


# ---------------------------------------------------------------------------- the cut
def test_flat_ranges_are_contiguous_rectangles() -> None:
    """Every element range of tensors of 0-4 dimensions: the rectangles are in memory order,
    each contiguous, and together exactly the range."""
    rng = random.Random(0)
    for shape in [(), (7,), (5, 3), (4, 1, 6), (3, 4, 2, 5), (1, 9), (6, 1)]:
        numel = math.prod(shape)
        for _ in range(60):
            a = rng.randrange(numel + 1)
            b = rng.randrange(a, numel + 1)
            got = boxes(shape, a, b)
            at = a
            for offsets, sizes in got:
                assert len(offsets) == len(sizes) == len(shape)
                start = flat_offset(shape, offsets)
                assert start == at  # in order, no gap, no overlap
                first = next((i for i, s in enumerate(sizes) if s > 1), len(sizes))
                assert all(sizes[j] == shape[j] for j in range(first + 1, len(shape)))  # contiguous in memory
                at += math.prod(sizes)
            assert at == b
            assert len(got) <= max(1, 2 * len(shape) - 1)
            values = torch.arange(numel).reshape(shape) if shape else torch.tensor(0)
            pieces = [values[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                      for offsets, sizes in got]
            joined = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
            assert torch.equal(joined, values.reshape(-1)[a:b])


# ---------------------------------------------------------------------------- helpers for the ranks
# a llama of ~16 MB in 9 blocks (8 layers of ~2.4 MB and the rest), so one block is far below the model
BIG = {"dim": 192, "n_layers": 8, "n_heads": 4, "hidden_dim": 512, "max_seq_len": SEQ, "vocab_size": 512}
SMALL = {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "max_seq_len": SEQ, "tie_embeddings": False}


def batches(plan: Plan, rank: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (plan.global_batch_size, SEQ + 1), generator=g)
        lo = sum(_samples(r) for r in plan.ranks[:rank])
        out.append(tokens[lo:lo + _samples(plan.ranks[rank])])
    return out


def engine_of(stage: int, plan: Plan, kind: str, config: dict, seed: int = 0) -> PoplarEngine:
    model = create_model("llama-tiny", seed=seed, **config)
    mats = [p for p in model.parameters() if p.dim() > 1]
    vecs = [p for p in model.parameters() if p.dim() <= 1]
    if kind == "adamw":
        opt = torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs}], lr=3e-3)
    else:
        opt = torch.optim.SGD([{"params": mats}, {"params": vecs, "momentum": 0.5}], lr=0.3, momentum=0.9)
    zero = ZeroConfig(3, wrap_policy=lambda m: type(m).__name__ == "LlamaBlock") if stage == 3 else ZeroConfig(stage)
    return PoplarEngine(model, opt, zero_stage=zero, plan=plan)


def train(engine: PoplarEngine, plan: Plan, rank: int, steps: int, seed: int = 0) -> list[float]:
    return [engine.train_step(b, llama_loss_fn) for b in batches(plan, rank, steps, seed)]


def whole(directory: Path) -> dict:
    """A sharded checkpoint's model and optimizer state, whole, by torch's offline converter."""
    out = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=False)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_growth(fn) -> int:
    """Bytes the process's peak resident set rose above its resident set at the start of ``fn()``."""
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from now
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


def shard_bytes(engine: PoplarEngine) -> tuple[int, int]:
    """(this rank's parameter shard, its optimizer state) in bytes."""
    params = state = 0
    for p, _ in engine.stage.optimizer_segments():
        params += p.numel() * p.element_size()
        state += sum(v.numel() * v.element_size() for v in engine.optimizer.state.get(p, {}).values()
                     if torch.is_tensor(v) and v.dim() > 0)
    return params, state


def block_bytes(engine: PoplarEngine) -> int:
    return max(sum(u.numel for u in b.units) for b in engine.stage.blocks) * 4


# ---------------------------------------------------------------------------- bounded memory
PLAN4 = with_shards(plan_of((2, 1, 0), (2, 1, 0), (2, 1, 0), (2, 1, 0)), (5, 1, 2, 2))


def memory_worker(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    engine = engine_of(3, PLAN4, "adamw", BIG)
    train(engine, PLAN4, rank, 1)
    save_checkpoint(engine, Path(root) / "warm")  # the first save imports and sets up what DCP needs
    params, state = shard_bytes(engine)
    block = block_bytes(engine)
    saved = peak_growth(lambda: save_checkpoint(engine, Path(root) / "c"))
    del engine
    gc.collect()
    fresh = engine_of(3, PLAN4, "adamw", BIG, seed=1)
    load_checkpoint(fresh, Path(root) / "warm")
    fresh = engine_of(3, PLAN4, "adamw", BIG, seed=2)
    loaded = peak_growth(lambda: load_checkpoint(fresh, Path(root) / "c"))
    return {"params": params, "state": state, "block": block, "save": saved, "load": loaded,
            "model": sum(u.numel for u in fresh.stage.units) * 4}


@pytest.mark.multiprocess
def test_save_and_load_hold_the_shards_plus_one_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 gloo ranks, ZeRO-3, shard weights 5:1:2:2, a 16 MB model: a save adds at most one block
    (+5 % of the shards and the block) to what a rank holds; a load adds the optimizer state it
    restores and at most one block. Gathering the model, as earlier saves did, adds all 16 MB."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    results = spawn(memory_worker, 4, (str(tmp_path),), timeout_s=400, collective_timeout_s=120)
    for rank, r in enumerate(results):
        shards = r["params"] + r["state"]
        slack = 0.05 * (shards + r["block"])
        assert r["model"] > 4 * r["block"]  # one block is far below the model
        assert r["save"] <= r["block"] + slack, (rank, r)
        assert r["load"] <= r["state"] + r["block"] + slack, (rank, r)
    assert results[1]["params"] * 8 < results[1]["model"]  # rank 1's shard is a tenth


# ---------------------------------------------------------------------------- exact round trips
def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _equal(x, y):
                return False
        elif torch.is_tensor(x):
            if not (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


HOPS = {  # (world, stage, plan): 4 -> 2 -> 3 ranks, ZeRO-3 -> 1 -> 3, other weights
    4: (3, PLAN4),
    2: (1, plan_of((4, 1, 0), (4, 1, 0))),
    3: (3, with_shards(plan_of((3, 1, 0), (3, 1, 0), (2, 1, 0)), (1, 3, 2))),
}


def hop_worker(rank: int, world: int, root: str, source: str | None, kind: str) -> dict:
    torch.set_num_threads(1)
    stage, plan = HOPS[world]
    engine = engine_of(stage, plan, kind, SMALL, seed=world)
    if source is None:
        train(engine, plan, rank, 2)
    else:
        load_checkpoint(engine, source)
    save_checkpoint(engine, Path(root) / f"{kind}-{world}")
    after = train(engine, plan, rank, 1, seed=5)
    return {"next_loss": after[0], "iteration": engine.iteration}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_round_trip_over_worlds_stages_and_weights(tmp_path: Path, kind: str) -> None:
    """Saved on 4 ranks (ZeRO-3, 5:1:2:2), loaded and saved again on 2 (ZeRO-1), then on 3
    (ZeRO-3, 1:3:2): every checkpoint holds bitwise the same model and optimizer state, and the
    step after each load is the step after the save (to 1e-7: the ranks add up in another order)."""
    first = spawn(hop_worker, 4, (str(tmp_path), None, kind), timeout_s=240)
    second = spawn(hop_worker, 2, (str(tmp_path), str(tmp_path / f"{kind}-4"), kind), timeout_s=240)
    third = spawn(hop_worker, 3, (str(tmp_path), str(tmp_path / f"{kind}-2"), kind), timeout_s=240)
    a, b, c = (whole(tmp_path / f"{kind}-{w}") for w in (4, 2, 3))
    assert _equal(a["model"], b["model"]) and _equal(b["model"], c["model"])
    assert _equal(a["optim"]["state"], b["optim"]["state"]) and _equal(b["optim"]["state"], c["optim"]["state"])
    assert a["optim"]["param_groups"] == c["optim"]["param_groups"]
    keys = {"momentum_buffer"} if kind == "sgd" else {"exp_avg", "exp_avg_sq", "step"}
    assert all(set(v) == keys for v in a["optim"]["state"].values())
    for r in (second, third):
        assert all(x["iteration"] == 3 for x in r)
        assert r[0]["next_loss"] == pytest.approx(first[0]["next_loss"], rel=1e-7, abs=1e-7)


# ---------------------------------------------------------------------------- FSDP2 interop
def _poplar_whole(engine: PoplarEngine, kind: str = "adamw") -> dict[str, dict[str, torch.Tensor]]:
    """This rank's parameter and optimizer pieces, gathered to whole tensors by name on every rank
    (read from the engine's shards directly, not from any checkpoint)."""
    mine = []
    for p, segments in engine.stage.optimizer_segments():
        st = engine.optimizer.state.get(p, {})
        for name, off, n, at in segments:
            mine.append((name, off, {"param": p.detach().reshape(-1)[at:at + n].clone(),
                                     **{k: v.reshape(-1)[at:at + n].clone() for k, v in st.items()
                                        if torch.is_tensor(v) and v.dim() > 0}}))
    shapes = {n: s for u in engine.stage.units for n, s in zip(u.names, u.shapes)}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for pieces in engine.comm.all_gather_object(mine):
        for name, off, values in pieces:
            for k, v in values.items():
                flat = out.setdefault(name, {}).setdefault(k, torch.zeros(math.prod(shapes[name])))
                flat[off:off + v.numel()] = v
    return {n: {k: v.view(shapes[n]) for k, v in d.items()} for n, d in out.items()}


def fsdp2_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard
    model = create_model("llama-tiny", seed=9, **SMALL)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    mats = [p for p in model.parameters() if p.dim() > 1]
    vecs = [p for p in model.parameters() if p.dim() <= 1]
    return model, torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs}], lr=3e-3)


def _fsdp2_whole(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        out[name] = {"param": p.full_tensor().detach(), "exp_avg": st["exp_avg"].full_tensor(),
                     "exp_avg_sq": st["exp_avg_sq"].full_tensor()}
    return out


def fsdp2_worker(rank: int, world: int, source: str, target: str) -> dict:
    """FSDP2 loads Poplar's checkpoint with DCP and set_state_dict, trains a step, saves its own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    torch.set_num_threads(1)
    model, opt = fsdp2_model()
    model(torch.zeros(1, SEQ, dtype=torch.long)).sum().backward()  # optimizer state to load into
    opt.step()
    opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=source)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _fsdp2_whole(model, opt)
    steps = {float(opt.state[p]["step"]) for p in model.parameters()}
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    llama_loss_fn(model, tokens).backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=target)
    return {"loaded": loaded, "steps": steps, "saved": _fsdp2_whole(model, opt)}


def poplar_save_worker(rank: int, world: int, directory: str) -> dict:
    torch.set_num_threads(1)
    plan = with_shards(plan_of((2, 1, 0), (2, 1, 0), (2, 1, 0)), (5, 1, 2))
    engine = engine_of(3, plan, "adamw", SMALL)
    train(engine, plan, rank, 2)
    save_checkpoint(engine, directory)
    return _poplar_whole(engine)


def poplar_load_worker(rank: int, world: int, directory: str) -> dict:
    torch.set_num_threads(1)
    engine = engine_of(3, PLAN4, "adamw", SMALL, seed=3)
    load_torch_checkpoint(engine, directory)
    return _poplar_whole(engine)


def _max_abs_diff(a: dict, b: dict, keys: tuple[str, ...]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n][k] - b[n][k]).abs().max()) for n in a for k in keys)


@pytest.mark.multiprocess
def test_fsdp2_loads_poplar_checkpoints_and_poplar_loads_fsdp2s(tmp_path: Path) -> None:
    """Poplar ZeRO-3 on 3 ranks (5:1:2) saves; FSDP2 ``fully_shard`` on 2 ranks loads it with DCP
    and ``set_state_dict``: parameters and AdamW state equal (max abs diff 0). FSDP2 trains a step
    and saves; Poplar ZeRO-3 on 4 ranks (5:1:2:2) loads that: equal again."""
    poplar_dir, fsdp_dir = tmp_path / "poplar", tmp_path / "fsdp2"
    saved = spawn(poplar_save_worker, 3, (str(poplar_dir),), timeout_s=240)[0]
    fsdp = spawn(fsdp2_worker, 2, (str(poplar_dir), str(fsdp_dir)), timeout_s=240)
    keys = ("param", "exp_avg", "exp_avg_sq")
    for r in fsdp:
        assert _max_abs_diff(r["loaded"], saved, keys) == 0.0
        assert r["steps"] == {2.0}
    back = spawn(poplar_load_worker, 4, (str(fsdp_dir),), timeout_s=240)
    assert _max_abs_diff(fsdp[0]["saved"], saved, ("param",)) > 0  # FSDP2 moved the weights
    for r in back:
        assert _max_abs_diff(r, fsdp[0]["saved"], keys) == 0.0


# ---------------------------------------------------------------------------- earlier checkpoints
LEGACY = Path(__file__).parent / "data" / "v1-stage1"  # written by Poplar before sharded checkpoints


def test_a_checkpoint_of_an_earlier_version_loads_and_saves_sharded(tmp_path: Path) -> None:
    """An index-version-1 checkpoint (the whole model in model.safetensors, optimizer pieces per
    rank) loads exactly, at ZeRO-3 and at ZeRO-1; saved again, it is sharded and holds the same."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    saved_model = load_file(str(LEGACY / "model.safetensors"))
    index = json.loads((LEGACY / "index.json").read_text())
    with safe_open(str(LEGACY / "optim-rank0-of1.safetensors"), framework="pt") as f:
        saved_state = {(p["name"], k): f.get_tensor(t) for p in index["ranks"][0]["pieces"] for k, t in p["keys"].items()}
    tiny = {"dim": 16, "n_layers": 1, "n_heads": 2, "hidden_dim": 32, "max_seq_len": 8}
    for stage in (3, 1):
        engine = engine_of(stage, plan_of((2, 1, 0)), "adamw", tiny, seed=4)
        with torch.random.fork_rng(devices=[]):
            meta = load_checkpoint(engine, LEGACY)
        assert meta.iteration == 2 and meta.extra["note"].startswith("written by Poplar") and engine.iteration == 2
        state = engine.full_state_dict()
        assert state.keys() == saved_model.keys() and all(torch.equal(state[k], saved_model[k]) for k in state)
        save_checkpoint(engine, tmp_path / f"again{stage}")
        again = whole(tmp_path / f"again{stage}")
        assert all(torch.equal(again["model"][k], saved_model[k]) for k in saved_model)
        for (name, key), value in saved_state.items():
            assert torch.equal(again["optim"]["state"][name][key].reshape(-1), value), (stage, name, key)
