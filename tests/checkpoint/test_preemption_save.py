"""fit with stop_on_signals: a SIGTERM that reaches one rank in the middle of a save lets the save
complete; every rank stops after the next iteration, checkpointed, with ``Preempted``; the
directory holds complete checkpoints only and resumes from the last one."""

from __future__ import annotations

import pytest

import os
import signal
from pathlib import Path

import torch

import poplar
import poplar.checkpoint.save as save_module
from poplar.checkpoint import find_latest
from poplar.checkpoint.kept import step_name
from poplar.process.launch import spawn
from poplar.train import CheckpointOptions, FitConfig, ReportOptions
from poplar.train.preemption import Preempted
from tests.checkpoint.test_checkpoint_kept import PLAN, PLAN1, COLLECTIVE_TIMEOUT_S, Tokens, make_engine

SIGNALLED_IN = step_name(4)


def preempted_world(rank: int, world: int, root: str) -> dict:
    """Stage 3 on 2 ranks, a checkpoint every 2 iterations: rank 1 receives SIGTERM right after
    writing its file of the save at iteration 4."""
    real_save_file = save_module.save_file

    def save_file(tensors, filename, metadata=None):
        real_save_file(tensors, filename, metadata=metadata)
        path = Path(filename)
        if rank == 1 and path.name.startswith("rng-rank1-") and path.parent.name.startswith(f".{SIGNALLED_IN}.tmp-"):
            os.kill(os.getpid(), signal.SIGTERM)
    save_module.save_file = save_file
    engine = make_engine(3, PLAN)
    try:
        poplar.fit(engine, Tokens(), 100, checkpoint=CheckpointOptions(Path(root) / "ckpt", every=2),
                   report=ReportOptions(log_every=0, progress=False), config=FitConfig(stop_on_signals=True))
    except Preempted as e:
        return {"iteration": e.iteration, "checkpoint": e.checkpoint, "signum": e.signum, "message": str(e),
                "engine_iteration": engine.iteration,
                "handler_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}
    return {"iteration": None}


@pytest.mark.multiprocess
def test_sigterm_mid_save_completes_it_and_stops_every_rank_after_the_next_iteration(tmp_path: Path) -> None:
    results = spawn(preempted_world, 2, (str(tmp_path),), timeout_s=90, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    directory = tmp_path / "ckpt"
    for r in results:
        assert r["iteration"] == 5 and r["engine_iteration"] == 5 and r["signum"] == signal.SIGTERM, results
        assert r["checkpoint"] == str(directory / step_name(5)) and r["handler_restored"], results
    assert "stopped by SIGTERM at iteration 5" in results[0]["message"]
    assert sorted(os.listdir(directory)) == ["index.json", step_name(4), step_name(5)]  # no leftovers
    latest = find_latest(directory)
    assert latest is not None and latest.iteration == 5
    with torch.random.fork_rng(devices=[]):
        result = poplar.fit(make_engine(1, PLAN1, seed=4), Tokens(), 6, checkpoint=directory,
                            report=ReportOptions(log_every=0, progress=False))
    assert (result.start_iteration, result.end_iteration) == (5, 6)
