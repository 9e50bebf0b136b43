"""Checkpoints: bitwise resume, resume on another world size / stage / plan, and refusal of
corrupt or mismatched checkpoints on every rank."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from poplar.checkpoint import CheckpointError, load_checkpoint, read_index, save_checkpoint
from poplar.train.data import LoaderOptions, PlanLoader
from poplar.engine import PoplarEngine
from poplar.process.launch import spawn
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.types.plans import Plan
from poplar.workloads.text import TextBlocks
from tests.toy import max_rel_err, plan_of
from poplar.zero.config import ZeroConfig

SEQ = 16
PLAN2 = plan_of((3, 2, 1), (2, 1, 1))  # n_i = 7, 3
PLAN3 = plan_of((3, 2, 1), (2, 1, 0), (1, 3, 0))  # n_i = 7, 2, 3: gbs 12
PLAN3_ON_2 = plan_of((4, 2, 0), (1, 3, 1))  # n_i = 8, 4: the same gbs 12, cut differently
BUCKET_MB = 0.02  # ~5200 floats per unit: 7 units, parameters cut across shards differently per world size
_DATASET: TextBlocks | None = None


def whole_model(directory: Path) -> dict[str, torch.Tensor]:
    """The model a sharded checkpoint holds, put together offline by torch's own converter."""
    out = directory.parent / f"{directory.name}.whole.pt"
    if not out.exists():
        dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=True)["model"]


def dataset() -> TextBlocks:
    global _DATASET
    if _DATASET is None:
        _DATASET = TextBlocks(seq_len=SEQ)
    return _DATASET


# llama-tiny cut down (~29k parameters): the checkpoint mechanics, not the model, are under test
SMALL = {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "max_seq_len": SEQ}


def make_engine(stage: int, plan: Plan, *, seed: int = 0, kind: str = "adamw", **model_overrides) -> PoplarEngine:
    model = create_model("llama-tiny", seed=seed, **{**SMALL, **model_overrides})
    mats = [p for p in model.parameters() if p.dim() > 1]
    vecs = [p for p in model.parameters() if p.dim() <= 1]
    if kind == "adamw":
        opt = torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs, "lr": 2e-3}],
                                lr=3e-3, weight_decay=0.0)
    else:
        opt = torch.optim.SGD([{"params": mats}, {"params": vecs, "momentum": 0.5}], lr=0.3, momentum=0.9)
    return PoplarEngine(model, opt, zero_stage=ZeroConfig(stage, bucket_size_mb=BUCKET_MB), plan=plan)


def loader(plan: Plan, rank: int) -> PlanLoader:
    return PlanLoader(dataset(), plan, rank, LoaderOptions(seed=11))


def train(engine: PoplarEngine, data: PlanLoader, steps: int) -> list[float]:
    return [engine.train_step(batch, llama_loss_fn) for _, batch in zip(range(steps), data)]


# ---------------------------------------------------------------------------- bitwise resume
def resume_worker(rank: int, world: int, directory: str, stages: tuple[int, ...], plan: Plan = PLAN2) -> dict:
    out = {}
    for stage in stages:
        straight_engine = make_engine(stage, plan)
        straight = train(straight_engine, loader(plan, rank), 4)

        engine, data = make_engine(stage, plan), loader(plan, rank)
        first = train(engine, data, 2)
        rng_at_save = torch.get_rng_state()
        path = save_checkpoint(engine, Path(directory) / f"stage{stage}", extra={"data": data.state_dict()})
        del engine, data
        torch.manual_seed(1234 + rank)  # the checkpoint must restore the RNG
        resumed, data = make_engine(stage, plan, seed=7), PlanLoader(dataset(), plan, rank, LoaderOptions(seed=0))
        meta = load_checkpoint(resumed, path)
        data.load_state_dict(meta["extra"]["data"])
        rng_restored = torch.equal(torch.get_rng_state(), rng_at_save)
        rest = train(resumed, data, 2)
        out[stage] = {"straight": straight, "resumed": first + rest, "rng": rng_restored, "meta": meta,
                      "a": straight_engine.full_state_dict(), "b": resumed.full_state_dict(),
                      "iteration": resumed.iteration}
    return out


def _check_bitwise(results: list[dict], stages: tuple[int, ...], plan: Plan) -> None:
    for stage in stages:
        for rank, res in enumerate(results):
            r = res[stage]
            assert r["resumed"] == r["straight"], (stage, rank)  # identical floats
            assert r["a"].keys() == r["b"].keys()
            for k in r["a"]:
                assert torch.equal(r["a"][k], r["b"][k]), (stage, rank, k)
            assert r["rng"] and r["meta"]["rng_restored"] and r["iteration"] == 4
            assert r["meta"]["iteration"] == 2 and r["meta"]["zero_stage"] == stage
            assert r["meta"]["world_size"] == plan.world_size and r["meta"]["plan"].to_dict() == plan.to_dict()


def test_resume_is_bitwise_in_one_process(tmp_path: Path) -> None:
    """The same at stages 0 and 1 in a world of one (no process group)."""
    plan = plan_of((3, 2, 1))
    with torch.random.fork_rng(devices=[]):  # loading sets this process's RNG
        results = [resume_worker(0, 1, str(tmp_path), (0, 1), plan)]
    _check_bitwise(results, (0, 1), plan)


# ---------------------------------------------------------------------------- the multi-rank runs
# Two spawns feed the multi-rank tests (starting processes is most of their cost): 3 ranks save
# a checkpoint at stage 2 and go on; then 2 ranks resume bitwise at stage 2, load the 3-rank
# checkpoint at stages 0, 1 (and 3) under another plan, and try bad checkpoints.
def three_rank_worker(rank: int, world: int, directory: str) -> dict:
    engine, data = make_engine(2, PLAN3), loader(PLAN3, rank)
    train(engine, data, 2)
    save_checkpoint(engine, directory, extra={"data": data.state_dict()})
    losses = train(engine, data, 2)
    return {"losses": losses, "state": engine.full_state_dict()}


def reshard_load(rank: int, directory: str, stage: int) -> dict:
    engine = make_engine(stage, PLAN3_ON_2, seed=3)
    meta = load_checkpoint(engine, directory)
    data = loader(PLAN3_ON_2, rank)
    data.load_state_dict(meta["extra"]["data"])
    return {"losses": train(engine, data, 2), "state": engine.full_state_dict(), "rng_restored": meta["rng_restored"]}


def two_rank_worker(rank: int, world: int, root: str, three_rank_dir: str) -> dict:
    out = {"bitwise": resume_worker(rank, world, str(Path(root) / "bitwise"), (0, 2)),
           "reshard": {stage: reshard_load(rank, three_rank_dir, stage) for stage in (0, 1)},
           "refusals": refusals(rank, Path(root) / "refusals")}
    try:
        out["reshard"][3] = reshard_load(rank, three_rank_dir, 3)
        out["bitwise3"] = resume_worker(rank, world, str(Path(root) / "bitwise3"), (3,))
    except Exception as e:  # noqa: BLE001 - fails its own test only
        out["stage3_error"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    three_dir = root / "three"
    reference = spawn(three_rank_worker, 3, (str(three_dir),), timeout_s=240)[0]
    results = spawn(two_rank_worker, 2, (str(root), str(three_dir)), timeout_s=300,
                    collective_timeout_s=60)
    return {"root": root, "three_dir": three_dir, "reference": reference, "results": results}


@pytest.mark.multiprocess
def test_resume_is_bitwise(runs: dict) -> None:
    """2 gloo ranks at stages 0 and 2: 4 iterations straight = 2, save, new engine, load, 2
    (at stage 0 every rank holds the whole optimizer state; rank 0 alone writes it)."""
    _check_bitwise([r["bitwise"] for r in runs["results"]], (0, 2), PLAN2)
    # the layout: each rank's DCP shard file and RNG file, DCP's metadata, the index; no temporary left
    bitwise = runs["root"] / "bitwise"
    assert sorted(os.listdir(bitwise / "stage2")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "index.json",
                                                      "rng-rank0-of2.safetensors", "rng-rank1-of2.safetensors"]
    assert sorted(os.listdir(bitwise)) == ["stage0", "stage2"]


def _check_continuation(runs: dict, stage: int) -> None:
    reference = runs["reference"]
    for rank, res in enumerate(runs["results"]):
        r = res["reshard"][stage]
        assert isinstance(r, dict), r
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5), (stage, rank)
        assert max_rel_err(r["state"], reference["state"]) <= 1e-5, (stage, rank)
        assert r["rng_restored"]  # ranks 0 and 1 existed in the 3-rank run


@pytest.mark.multiprocess
def test_resume_on_two_ranks_at_stages_0_and_1(runs: dict) -> None:
    """3 ranks at stage 2 → 2 ranks at stage 0 and at stage 1, another plan: AdamW goes on as before."""
    index = read_index(runs["three_dir"])
    assert index["world_size"] == 3 and index["zero_stage"] == 2 and index["iteration"] == 2
    for stage in (0, 1):
        _check_continuation(runs, stage)
    # not trivially close: the parameters moved after the checkpoint
    moved = max_rel_err(runs["results"][0]["reshard"][1]["state"],
                        whole_model(runs["three_dir"]))
    assert moved > 1e-3


@pytest.mark.multiprocess
def test_stage_3_checkpoints(runs: dict) -> None:
    """ZeRO-3 loads the 3-rank stage-2 checkpoint, resumes bitwise from its own, and its own
    checkpoint goes on in one process at stage 1."""
    assert "stage3_error" not in runs["results"][0], runs["results"][0].get("stage3_error")
    _check_continuation(runs, 3)
    _check_bitwise([r["bitwise3"] for r in runs["results"]], (3,), PLAN2)
    straight = runs["results"][0]["bitwise3"][3]
    plan = plan_of((4, 2, 2))  # the same global batch of 10
    engine = make_engine(1, plan, seed=6)
    with torch.random.fork_rng(devices=[]):
        meta = load_checkpoint(engine, runs["root"] / "bitwise3" / "stage3")
    data = loader(plan, 0)
    data.load_state_dict(meta["extra"]["data"])
    assert train(engine, data, 2) == pytest.approx(straight["straight"][2:], rel=1e-5)
    assert max_rel_err(engine.full_state_dict(), straight["a"]) <= 1e-5


@pytest.mark.multiprocess
def test_resume_in_one_process(runs: dict) -> None:
    """A world of one (no process group) continues the 3-rank run too, and torch's offline
    converter puts the sharded model together for a plain module (tied weights under each key)."""
    directory, reference = runs["three_dir"], runs["reference"]
    plan = plan_of((5, 2, 2))
    engine = make_engine(1, plan, seed=9)
    with torch.random.fork_rng(devices=[]):
        meta = load_checkpoint(engine, directory)
    data = loader(plan, 0)
    data.load_state_dict(meta["extra"]["data"])
    losses = train(engine, data, 2)
    assert losses == pytest.approx(reference["losses"], rel=1e-5)
    assert max_rel_err(engine.full_state_dict(), reference["state"]) <= 1e-5

    plain = create_model("llama-tiny", seed=5, **SMALL)
    plain.load_state_dict(whole_model(directory))  # tied weights under each key
    assert plain.head.weight is plain.embed.weight
    assert torch.equal(plain.head.weight, whole_model(directory)["embed.weight"])


# ---------------------------------------------------------------------------- refusals
def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
        return f"{type(e).__name__}: {e}"
    return "no error"


def refusals(rank: int, root: Path) -> dict:
    engine = make_engine(1, PLAN2)
    train(engine, loader(PLAN2, rank), 1)
    good = save_checkpoint(engine, root / "good")
    if rank == 0:
        for case in ("no_index", "truncated", "flipped", "bad_json", "short_model"):
            shutil.copytree(good, root / case)
        (root / "no_index" / "index.json").unlink()
        with open(root / "truncated" / "__1_0.distcp", "r+b") as f:
            f.truncate(os.path.getsize(f.name) - 64)
        with open(root / "flipped" / "__1_0.distcp", "r+b") as f:  # same size, other bytes
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        (root / "bad_json" / "index.json").write_text('{"format": "poplar-checkpoint", "vers')
        with open(root / "short_model" / ".metadata", "r+b") as f:
            f.truncate(100)
    dist.barrier()

    fresh = make_engine(1, PLAN2, seed=4)
    before = fresh.full_state_dict()
    out = {case: _error_of(lambda c=case: load_checkpoint(fresh, root / c))
           for case in ("no_index", "truncated", "flipped", "bad_json", "short_model", "missing_dir")}
    out["unchanged"] = all(torch.equal(v, fresh.full_state_dict()[k]) for k, v in before.items())
    out["iteration"] = fresh.iteration
    wider = make_engine(1, PLAN2, hidden_dim=48)
    out["shape"] = _error_of(lambda: load_checkpoint(wider, good))
    untied = make_engine(1, PLAN2, tie_embeddings=False)
    out["tied"] = _error_of(lambda: load_checkpoint(untied, good))
    shallower = make_engine(1, PLAN2, n_layers=1)
    out["names"] = _error_of(lambda: load_checkpoint(shallower, good))
    sgd = make_engine(1, PLAN2, kind="sgd")
    out["optimizer"] = _error_of(lambda: load_checkpoint(sgd, good))
    out["good"] = _error_of(lambda: load_checkpoint(fresh, good))
    return out


NEEDLES = {
    "no_index": "has no index.json",
    "truncated": "__1_0.distcp has",  # ... N bytes but the index says M: truncated
    "flipped": "rank 1: checkpoint file",  # only rank 1 checks rank 1's file; rank 0 must raise too
    "bad_json": "is not valid JSON",
    "short_model": "truncated or corrupt",
    "missing_dir": "does not exist",
    "shape": "shapes differ",
    "names": "checkpoint parameters the model does not have: ['layers.1.",
    "tied": "tied weights differ: the checkpoint ties [['embed.weight', 'head.weight']] and the model ties []",
    "optimizer": "optimizer is AdamW but the engine's is SGD",
}


@pytest.mark.multiprocess
def test_bad_checkpoints_are_refused_on_every_rank(runs: dict) -> None:
    for rank, res in enumerate(r["refusals"] for r in runs["results"]):
        for case, needle in NEEDLES.items():
            kind = "DamagedCheckpoint" if case == "flipped" else "CheckpointError"  # a CheckpointError too
            assert res[case].startswith(kind) and needle in res[case], (rank, case, res[case])
        assert "sha256" in res["flipped"] and "failed on 1 of 2 ranks" in res["flipped"]
        assert res["unchanged"] and res["iteration"] == 0  # a refused load changes nothing
        assert res["good"] == "no error"


# ---------------------------------------------------------------------------- one process: details
def test_index_contents_and_hyperparameters(tmp_path: Path) -> None:
    plan = plan_of((2, 2, 1))
    engine = make_engine(0, plan)
    train(engine, loader(plan, 0), 2)
    engine.optimizer.param_groups[0]["lr"] = 1.25e-3  # as a scheduler would
    engine.optimizer.param_groups[1]["betas"] = (0.8, 0.99)
    save_checkpoint(engine, tmp_path / "c", extra={"note": "hello", "data": {"iteration": 2}})
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    assert index["format"] == "poplar-checkpoint" and index["version"] == 3 and index["layout"] == "dcp"
    assert index["world_size"] == 1 and index["zero_stage"] == 0 and index["iteration"] == 2
    assert Plan.from_dict(index["plan"]).to_dict() == plan.to_dict()
    assert index["model"]["params"]["embed.weight"] == {"shape": [260, 32], "dtype": "float32"}
    assert "head.weight" in index["model"]["params"]  # tied: under each key
    rank0 = index["ranks"][0]
    assert rank0["file"] == "rng-rank0-of1.safetensors" and len(rank0["sha256"]) == 64 and rank0["rng"] == ["cpu"]
    assert [s["file"] for s in rank0["shards"]] == ["__0_0.distcp"] and len(rank0["shards"][0]["sha256"]) == 64
    # the cut: one rank holds every parameter whole
    assert rank0["pieces"][0] == {"name": "embed.weight", "offset": 0, "length": 260 * 32, "group": 0}
    held = {p["name"] for p in rank0["pieces"]}
    assert held == {k for k in index["model"]["params"] if k != "head.weight"}  # tied: held once
    keys = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata
    assert {"optim.state.embed.weight.exp_avg", "optim.state.embed.weight.exp_avg_sq", "optim.state.embed.weight.step",
            "model.embed.weight", "model.head.weight", "optim.param_groups.0.lr"} <= set(keys)
    assert index["extra"] == {"note": "hello", "data": {"iteration": 2}}
    assert index["optimizer"]["class"] == "AdamW"

    other = make_engine(2, plan, seed=1)
    meta = load_checkpoint(other, tmp_path / "c")
    groups = other.optimizer.param_groups
    assert groups[0]["lr"] == 1.25e-3 and groups[1]["betas"] == (0.8, 0.99) and groups[1]["lr"] == 2e-3
    assert meta["extra"]["note"] == "hello" and other.iteration == 2


def test_sgd_momentum_across_stages(tmp_path: Path) -> None:
    """Stage 0 holds per-parameter momentum, stage 2 per-shard: the buffers move by name."""
    plan = plan_of((3, 1, 1))
    a = make_engine(0, plan, kind="sgd")
    data = loader(plan, 0)
    train(a, data, 2)
    save_checkpoint(a, tmp_path / "sgd", extra={"data": data.state_dict()})
    expected = train(a, data, 2)
    b = make_engine(2, plan, kind="sgd", seed=2)
    meta = load_checkpoint(b, tmp_path / "sgd")
    data_b = loader(plan, 0)
    data_b.load_state_dict(meta["extra"]["data"])
    assert train(b, data_b, 2) == pytest.approx(expected, rel=1e-6)
    assert max_rel_err(b.full_state_dict(), a.full_state_dict()) <= 1e-6


def test_save_is_atomic_and_replaces_only_checkpoints(tmp_path: Path) -> None:
    plan = plan_of((2, 1, 0))
    engine = make_engine(1, plan)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save_checkpoint(engine, tmp_path / "c", extra={"bad": object()})
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary directory left
    save_checkpoint(engine, tmp_path / "c")
    train(engine, loader(plan, 0), 1)
    save_checkpoint(engine, tmp_path / "c")  # replaces the older checkpoint
    assert read_index(tmp_path / "c")["iteration"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a Poplar checkpoint"):
        save_checkpoint(engine, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
