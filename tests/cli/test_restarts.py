"""Jobs that restart by themselves: under ``torchrun --max-restarts``, a worker killed mid-run
makes the job re-form its group, resume from the last complete checkpoint and finish with the
loss of an uninterrupted run; SIGKILL of the launcher leaves no worker behind, and the last
complete checkpoint loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_preemption import _worker_pid
from tests.cli.test_train_cli import CPU_ONLY, REPO, TORCHRUN, _config

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY}
COLLECTIVE_TIMEOUT_S = 30
DEADLINE_S = 240.0
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists() or not Path("/proc").is_dir(),
                                    reason="needs torchrun and /proc")


def _setup(tmp: Path, iterations: int) -> None:
    _config(tmp, iterations=iterations, log_every=1, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            checkpoint={"dir": "ckpt", "every": 5, "keep": 2})
    cfg = json.loads((tmp / "run.json").read_text())
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}  # SGD + momentum: wrong factors show
    cfg["train_batch_size"] = 16
    (tmp / "run.json").write_text(json.dumps(cfg))


def _launch(tmp: Path, log: Path, *torchrun_args: str) -> subprocess.Popen:
    return subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node", "4", *torchrun_args, "-m", "poplar",
                             "train", "--config", "run.json"], cwd=tmp, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)


def _wait_for(text: str, log: Path, proc: subprocess.Popen, deadline: float) -> None:
    while text not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{text!r} did not appear (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def _final_loss(tmp: Path) -> tuple[int, float]:
    metrics = json.loads((tmp / "report" / "metrics.json").read_text())
    return metrics["end_iteration"], metrics["losses"][-1]


@needs_torchrun
@pytest.mark.multiprocess
def test_a_killed_worker_restarts_the_job_which_resumes_and_ends_with_the_uninterrupted_loss(tmp_path: Path) -> None:
    iterations = 24
    reference, restarted = tmp_path / "reference", tmp_path / "restarted"
    reference.mkdir(), restarted.mkdir()
    _setup(reference, iterations), _setup(restarted, iterations)
    deadline = time.monotonic() + DEADLINE_S
    proc = _launch(reference, reference / "run.log")
    code = proc.wait(timeout=DEADLINE_S)
    assert code == 0, (reference / "run.log").read_text()[-3000:]

    log = restarted / "run.log"
    proc = _launch(restarted, log, "--max-restarts", "2")
    try:
        _wait_for(f"iteration 12/{iterations}", log, proc, deadline)
        victim = _worker_pid(proc.pid, 2)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "rank 2 died (its process ended)" in text, text[-4000:]
    assert "resumed from ckpt at iteration 10" in text, text[-4000:]
    assert _final_loss(restarted) == _final_loss(reference)
