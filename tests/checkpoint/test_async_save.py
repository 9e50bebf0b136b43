"""Saves written in the background (``CheckpointOptions(async_save=True)``,
``poplar.checkpoint.background``): the checkpoint holds the state of the iteration it was taken
at while training goes on; a rank killed (``kill -9``) during the background write leaves the
previous checkpoint, which the next run resumes from; a write that fails is an error on every
rank at the next iteration boundary, and the previous checkpoint stays."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import poplar
import poplar.checkpoint.save as save_module
from poplar.checkpoint import CheckpointError, find_latest
from poplar.checkpoint.kept import step_name
from poplar.process.launch import RankFailure, spawn
from poplar.train import CheckpointOptions, ReportOptions
from tests.checkpoint.test_checkpoint_kept import PLAN, PLAN1, Tokens, make_engine

STAGE = 3


def fit(engine, iterations: int, directory: Path, *, async_save: bool) -> poplar.FitResult:
    return poplar.fit(engine, Tokens(), iterations,
                      checkpoint=CheckpointOptions(directory, every=2, async_save=async_save),
                      report=ReportOptions(log_every=0, progress=False))


def whole(directory: Path) -> dict:
    out = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=False)


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_equal(a[k], b[k]) if isinstance(a[k], dict) else
               (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]) for k in a)


def _on_background_write(rank: int, at_step: int, act) -> None:
    """Make this rank call ``act()`` in the save into ``step-<at_step>``, in the background
    thread, after its shards are written and before its RNG file (so before the index)."""
    real = save_module._rank_files

    def rank_files(comm, snap, tmp_dir):
        if comm.rank == rank and Path(tmp_dir).name.startswith(f".{step_name(at_step)}.tmp-"):
            act()
        return real(comm, snap, tmp_dir)
    save_module._rank_files = rank_files


# ---------------------------------------------------------------------------- the state saved
def same_state_worker(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    result = fit(make_engine(STAGE, PLAN), 6, Path(root) / "async", async_save=True)
    fit(make_engine(STAGE, PLAN), 6, Path(root) / "sync", async_save=False)
    return {"checkpoints": result.checkpoints}


@pytest.mark.multiprocess
def test_a_background_save_holds_the_state_it_was_taken_at(tmp_path: Path) -> None:
    """2 ranks, ZeRO-3, a checkpoint every 2 iterations written in the background while the next
    iterations run: the kept checkpoints equal bitwise those of synchronous saves."""
    results = spawn(same_state_worker, 2, (str(tmp_path),), timeout_s=300)
    assert results[0]["checkpoints"] == [f"{tmp_path / 'async'}@{i}" for i in (2, 4, 6)]
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == ["index.json", step_name(4), step_name(6)]
    for step in (4, 6):
        a, b = whole(tmp_path / "async" / step_name(step)), whole(tmp_path / "sync" / step_name(step))
        assert _equal(a["model"], b["model"]) and _equal(a["optim"]["state"], b["optim"]["state"]), step


# ---------------------------------------------------------------------------- kill -9 mid-write
def killed_worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    _on_background_write(1, 4, lambda: os.kill(os.getpid(), signal.SIGKILL))
    fit(make_engine(STAGE, PLAN), 8, Path(root) / "ckpt", async_save=True)


def resumed_worker(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    resumed = fit(make_engine(STAGE, PLAN, seed=3), 8, Path(root) / "ckpt", async_save=True)
    straight = fit(make_engine(STAGE, PLAN), 8, Path(root) / "straight", async_save=True)
    return {"start": resumed.start_iteration, "losses": resumed.losses, "straight": straight.losses[2:]}


@pytest.mark.multiprocess
def test_kill_9_during_the_background_write_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    """Rank 1 is killed (SIGKILL) while its thread writes the checkpoint of iteration 4: the run
    fails on every rank, the checkpoint of iteration 2 is the latest complete one, and the next
    run resumes from it and trains as the run that was never interrupted."""
    with pytest.raises(RankFailure):
        spawn(killed_worker, 2, (str(tmp_path),), timeout_s=240, collective_timeout_s=30)
    latest = find_latest(tmp_path / "ckpt")
    assert latest is not None and latest.iteration == 2
    results = spawn(resumed_worker, 2, (str(tmp_path),), timeout_s=300)
    for r in results:
        assert r["start"] == 2 and r["losses"] == r["straight"]
    assert find_latest(tmp_path / "ckpt").iteration == 8


# ---------------------------------------------------------------------------- a failed write
def unwritable_worker(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)

    def refuse() -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(root) / "ckpt"))
    _on_background_write(1, 4, refuse)
    engine = make_engine(STAGE, PLAN)
    try:
        fit(engine, 8, Path(root) / "ckpt", async_save=True)
    except CheckpointError as e:
        return {"error": str(e), "iteration": engine.iteration}
    return {"error": None, "iteration": engine.iteration}


@pytest.mark.multiprocess
def test_a_failed_background_write_is_an_error_on_every_rank_and_loses_nothing(tmp_path: Path) -> None:
    """Rank 1's write of the checkpoint of iteration 4 fails (permission denied): every rank
    raises ``CheckpointError`` at the next iteration boundary, naming rank 1 and the cause; the
    checkpoint of iteration 2 stays the latest, complete, and loads."""
    results = spawn(unwritable_worker, 2, (str(tmp_path),), timeout_s=240, collective_timeout_s=30)
    for r in results:
        assert r["error"] is not None and "Permission denied" in r["error"], r
        assert "written in the background" in r["error"] and "rank 1" in r["error"], r
        assert r["iteration"] in (5, 6), r  # stopped at an iteration boundary soon after the save
    latest = find_latest(tmp_path / "ckpt")
    assert latest is not None and latest.iteration == 2
    engine = make_engine(STAGE, PLAN1)
    with torch.random.fork_rng(devices=[]):
        assert poplar.checkpoint.load_checkpoint(engine, tmp_path / "ckpt").iteration == 2
