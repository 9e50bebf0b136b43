"""A rank that dies during training or inside save_checkpoint: the other ranks fail clearly and
soon, the last checkpoint stays complete and loads into a fresh world with the state it had
when saved, and a later save to the same directory works."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import poplar.checkpoint.save as save_module
from poplar.checkpoint import load_checkpoint, read_index, save_checkpoint
from poplar.checkpoint.storage import STALE_TEMPORARY_S
from poplar.engine import PoplarEngine
from poplar.process.launch import RankFailure, spawn
from poplar.types.plans import Plan
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, plan_of, rank_slice

PLAN3 = plan_of((3, 2, 1), (2, 1, 0), (1, 3, 0))  # n_i = 7, 2, 3: gbs 12; rank 2 runs 3 micro-steps
PLAN2 = plan_of((4, 2, 0), (1, 3, 1))  # n_i = 8, 4: the same gbs, cut differently
PLAN1 = plan_of((4, 2, 4))
GBS = 12
SAVED_AT = 2  # the checkpoint is taken after this many iterations
EXIT_CODE = 7
COLLECTIVE_TIMEOUT_S = 20.0  # long enough for 3 ranks to start on a busy machine
BOUND_S = COLLECTIVE_TIMEOUT_S + 5.0  # a survivor's error comes at the latest when a collective times out


def make_engine(stage: int, plan: Plan, seed: int = 0) -> PoplarEngine:
    model = make_model(seed)
    return PoplarEngine(model, make_optimizer(model, "adamw"), zero_stage=stage, plan=plan)


def step(engine: PoplarEngine, plan: Plan, rank: int, iteration: int, loss=loss_fn) -> float:
    return engine.train_step(rank_slice(global_batch(iteration, GBS), plan, rank), loss)


def state_by_name(engine: PoplarEngine) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state by parameter name, gathered from every rank (collective):
    comparable between worlds of any size and stage."""
    model = engine.full_state_dict()
    pieces = []  # (state key, parameter name, element offset or None for a scalar, values)
    for p, segments in engine.stage.optimizer_segments():
        for key, value in engine.optimizer.state.get(p, {}).items():
            for name, offset, length, at in segments:
                if value.dim() == 0:  # AdamW's step
                    pieces.append((key, name, None, value.clone()))
                else:
                    pieces.append((key, name, offset, value.reshape(-1)[at:at + length].clone()))
    gathered: list = [pieces]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, pieces)
    out = {f"model/{k}": v.clone() for k, v in model.items()}
    for key, name, offset, values in (piece for part in gathered for piece in part):
        slot = f"optim/{key}/{name}"
        if offset is None:
            assert slot not in out or torch.equal(out[slot], values), slot
            out[slot] = values
        else:
            whole = out.setdefault(slot, torch.full((model[name].numel(),), float("nan")))
            whole[offset:offset + values.numel()] = values
    holes = [k for k, v in out.items() if v.dim() > 0 and torch.isnan(v).any()]
    assert not holes, f"optimizer state not covered by any rank: {holes}"
    return out


def _report_failure(root: Path, rank: int, started: float, error: BaseException) -> None:
    report = {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    (root / f"report-rank{rank}.json").write_text(json.dumps(report))


def dying_world(rank: int, world: int, root: str, victim: int, when: str) -> None:
    """Stage 2 on 3 ranks: save after SAVED_AT iterations, train one more, then ``victim`` dies in
    the middle of the next iteration (``when="train"``) or of the next save (``when="save"``)."""
    root_dir = Path(root)
    directory = root_dir / "ckpt" / "c"
    engine = make_engine(2, PLAN3)
    for it in range(SAVED_AT):
        step(engine, PLAN3, rank, it)
    save_checkpoint(engine, directory)
    saved = state_by_name(engine)
    step(engine, PLAN3, rank, SAVED_AT)
    if rank == 0:
        save_file(saved, str(root_dir / "saved.safetensors"))
        save_file({k: v.clone() for k, v in engine.full_state_dict().items()}, str(root_dir / "continued.safetensors"))
    dist.barrier()

    loss = loss_fn
    if rank == victim and when == "train":
        calls = []

        def dying_loss(module, batch):  # dies in its second micro-step, after the first one's collectives
            calls.append(1)
            if len(calls) == 2:
                os._exit(EXIT_CODE)
            return loss_fn(module, batch)
        loss = dying_loss
    elif rank == victim and when == "save":
        real_save_file = save_module.save_file

        def dying_save_file(tensors, filename, metadata=None):  # right after its own rank file
            real_save_file(tensors, filename, metadata=metadata)
            if Path(filename).name.startswith(f"rng-rank{rank}-"):
                os._exit(EXIT_CODE)
            raise AssertionError(f"rank {rank} wrote {filename} before its rank file")
        save_module.save_file = dying_save_file

    started = time.monotonic()
    try:
        if when == "train":
            step(engine, PLAN3, rank, SAVED_AT + 1, loss)
        else:
            save_checkpoint(engine, directory)
    except Exception as e:
        _report_failure(root_dir, rank, started, e)
        raise


def fresh_world(rank: int, world: int, directory: str, save_twice: bool) -> dict:
    """Stage 1 with another world size and plan: load, train one iteration, and (``save_twice``)
    save to the same directory, then again after making every leftover next to it stale."""
    plan = {1: PLAN1, 2: PLAN2}[world]
    engine = make_engine(1, plan, seed=5)
    meta = load_checkpoint(engine, directory)
    out = {"iteration": meta["iteration"], "state": state_by_name(engine)}
    step(engine, plan, rank, meta["iteration"])
    out["continued"] = engine.full_state_dict()
    if save_twice:
        parent = Path(directory).parent
        save_checkpoint(engine, directory)
        out["after_save"] = sorted(os.listdir(parent))
        if rank == 0:
            old = time.time() - STALE_TEMPORARY_S - 60
            for leftover in parent.glob(f".{Path(directory).name}.tmp-*"):
                for path in [*leftover.iterdir(), leftover]:
                    os.utime(path, (old, old))
        if world > 1:
            dist.barrier()
        save_checkpoint(engine, directory)
        out["after_stale_save"] = sorted(os.listdir(parent))
        out["saved_iteration"] = read_index(directory)["iteration"]
    return out


def run_dying_world(root: Path, victim: int, when: str) -> RankFailure:
    with pytest.raises(RankFailure) as info:
        spawn(dying_world, 3, (str(root), victim, when), timeout_s=90,
              collective_timeout_s=COLLECTIVE_TIMEOUT_S, grace_s=BOUND_S)
    return info.value


def check_survivors(root: Path, failure: RankFailure, victim: int, needle: str) -> None:
    assert f"exit code {EXIT_CODE}" in failure.failures[victim], failure.failures[victim]
    for rank in {0, 1, 2} - {victim}:
        report = json.loads((root / f"report-rank{rank}.json").read_text())
        assert needle in report["error"] and "another rank probably died" in report["error"], (rank, report)
        assert needle in failure.failures[rank]  # and the rank exited with it
        assert report["seconds"] < BOUND_S, (rank, report)


def check_loaded(root: Path, result: dict) -> None:
    """The fresh world holds exactly the state saved, and goes on from it as the dying world did."""
    saved = load_file(str(root / "saved.safetensors"))
    state = result["state"]
    assert state.keys() == saved.keys()
    assert any(k.startswith("optim/exp_avg_sq/") for k in saved) and "optim/step/up.weight" in saved
    for k in saved:
        assert torch.equal(state[k], saved[k]), k
    assert result["iteration"] == SAVED_AT
    continued = load_file(str(root / "continued.safetensors"))
    assert max_rel_err(result["continued"], continued) <= 1e-5
    saved_model = {k.removeprefix("model/"): v for k, v in saved.items() if k.startswith("model/")}
    assert max_rel_err(continued, saved_model) > 1e-3  # not trivially close: training moved on from the save


CHECKPOINT_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "index.json",
                    "rng-rank0-of3.safetensors", "rng-rank1-of3.safetensors", "rng-rank2-of3.safetensors"]


@pytest.mark.multiprocess
def test_rank_dies_in_training(tmp_path: Path) -> None:
    """Rank 2 exits in its second micro-step at stage 2: ranks 0 and 1 raise a DistributedError
    naming the failed collective, soon; the checkpoint of two iterations before is intact."""
    failure = run_dying_world(tmp_path, 2, "train")
    check_survivors(tmp_path, failure, 2, "DistributedError")
    directory = tmp_path / "ckpt" / "c"
    assert sorted(os.listdir(directory)) == CHECKPOINT_FILES and os.listdir(directory.parent) == ["c"]
    result = spawn(fresh_world, 2, (str(directory), False), timeout_s=90, collective_timeout_s=30)
    for r in result:
        check_loaded(tmp_path, r)


@pytest.mark.parametrize("victim", [1, 0])
@pytest.mark.multiprocess
def test_rank_dies_in_save(tmp_path: Path, victim: int) -> None:
    """A rank exits right after writing its rank file of the next save: the others raise a
    CheckpointError, soon; the previous checkpoint at the directory is intact and loads, and
    saves to the same directory work (here in one process). Rank 0 removes the temporary directory it made; if rank 0
    is the one that died, its temporary directory stays until it is stale, and a save removes it."""
    failure = run_dying_world(tmp_path, victim, "save")
    check_survivors(tmp_path, failure, victim, "CheckpointError: save checkpoint")
    directory = tmp_path / "ckpt" / "c"
    assert sorted(os.listdir(directory)) == CHECKPOINT_FILES
    assert read_index(directory)["iteration"] == SAVED_AT
    leftovers = [name for name in os.listdir(directory.parent) if name != "c"]
    assert len(leftovers) == (1 if victim == 0 else 0), leftovers
    assert all(name.startswith(".c.tmp-") for name in leftovers)

    with torch.random.fork_rng(devices=[]):  # loading sets this process's RNG
        r = fresh_world(0, 1, str(directory), True)
    check_loaded(tmp_path, r)
    assert r["after_save"] == sorted(["c", *leftovers])  # a leftover that may be in use stays
    assert r["after_stale_save"] == ["c"] and r["saved_iteration"] == SAVED_AT + 1
    assert sorted(os.listdir(directory)) == [".metadata", "__0_0.distcp", "index.json", "rng-rank0-of1.safetensors"]


def test_only_abandoned_temporaries_of_the_same_target_are_removed(tmp_path: Path) -> None:
    """What a save removes next to its directory: stale temporaries of the same target holding
    only the files a save writes; everything else stays."""
    old = time.time() - STALE_TEMPORARY_S - 60

    def leftover(name: str, files: tuple[str, ...] = ("optim-rank0-of2.safetensors", "model.safetensors"),
                 age: bool = True, young_file: str | None = None) -> Path:
        path = tmp_path / name
        path.mkdir()
        for f in files:
            (path / f).write_bytes(b"partial")
        if age:
            for p in [*path.iterdir(), path]:
                os.utime(p, (old, old))
        if young_file:
            (path / young_file).write_bytes(b"still being written")
            os.utime(path, (old, old))
        return path

    removed = [leftover(".c.tmp-aaaaaaaa"), leftover(".c.tmp-bbbbbbbb", files=()),
               leftover(".c.tmp-cccccccc", files=("optim-rank3-of4.safetensors", "index.json.part")),
               leftover(".c.tmp-kkkkkkkk", files=("__3_0.distcp", ".metadata", "rng-rank3-of4.safetensors"))]
    kept = [leftover(".c.tmp-dddddddd", age=False),  # may be a save in progress
            leftover(".c.tmp-eeeeeeee", young_file="optim-rank1-of2.safetensors"),
            leftover(".c.tmp-ffffffff", files=("index.json", "model.safetensors")),  # maybe the only finished copy
            leftover(".c.tmp-gggggggg", files=("notes.txt",)),
            leftover(".c.tmp-keep-me-please"),  # not a name a save makes
            leftover(".d.tmp-hhhhhhhh")]  # another target's
    sub = leftover(".c.tmp-iiiiiiii", files=())
    (sub / "inner").mkdir()
    os.utime(sub, (old, old))
    kept.append(sub)
    target = leftover("elsewhere")
    (tmp_path / ".c.tmp-jjjjjjjj").symlink_to(target)
    kept += [tmp_path / ".c.tmp-jjjjjjjj", target]

    engine = make_engine(0, PLAN1)
    save_checkpoint(engine, tmp_path / "c")
    assert not any(p.exists() for p in removed)
    assert all(p.exists() for p in kept) and sorted(os.listdir(target)) == ["model.safetensors",
                                                                           "optim-rank0-of2.safetensors"]
    assert read_index(tmp_path / "c")["iteration"] == 0


def test_a_checkpoint_left_aside_by_a_replacing_save_is_removed_by_the_next_save(tmp_path: Path) -> None:
    """Rank 0 died between the two renames that replace a checkpoint: the older one is left as
    ``.c.old-*``; the next save to c that succeeds removes it (and no other directory)."""
    engine = make_engine(0, PLAN1)
    save_checkpoint(engine, tmp_path / "c")
    os.replace(tmp_path / "c", tmp_path / ".c.old-0123abcd")
    others = [tmp_path / ".d.old-0123abcd", tmp_path / ".c.old-keep"]
    for other in others:
        other.mkdir()
    save_checkpoint(engine, tmp_path / "c")
    assert sorted(os.listdir(tmp_path)) == sorted(["c", *(p.name for p in others)])
    assert read_index(tmp_path / "c")["iteration"] == 0
