"""Preemption under torchrun: SIGTERM to the launcher mid-run stops every rank after the same
iteration with a checkpoint of it and one line; the same command resumes from that checkpoint.
Without torchrun, SIGINT (Ctrl-C) does the same and the exit status is 130 (128 + SIGINT)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poplar.emulation.torchrun_workers import worker_pid
from tests.cli.test_train_cli import CPU_ONLY, REPO, TORCHRUN, _config

DEADLINE_S = 90.0


def _launch(tmp: Path, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY}
    return subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "poplar", "train",
                             "--config", "run.json", *args], cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)


def _wait_for(predicate, proc: subprocess.Popen, deadline: float, what: str) -> None:
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} did not happen (exit {proc.poll()})")
        time.sleep(0.05)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_sigterm_to_torchrun_checkpoints_the_current_iteration_and_the_run_resumes(tmp_path: Path) -> None:
    # checkpoints every 1000 iterations: any checkpoint found is the one preemption wrote
    _config(tmp_path, iterations=100_000, checkpoint={"dir": "ckpt", "every": 1000}, log_every=1)
    cfg = json.loads((tmp_path / "run.json").read_text())
    cfg["zero_optimization"]["stage"] = 3
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    log = tmp_path / "first.log"
    deadline = time.monotonic() + DEADLINE_S
    proc = _launch(tmp_path, log)
    try:
        _wait_for(lambda: "iteration 3/100000" in log.read_text(), proc, deadline, "a third iteration")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("poplar train:")]
    assert len(lines) == 1, text[-3000:]
    match = re.fullmatch(r"poplar train: stopped by SIGTERM at iteration (\d+): checkpoint (\S+) saved; run the "
                         r"same command again to resume from it", lines[0])
    assert match, lines
    stopped = int(match.group(1))
    assert stopped >= 3 and match.group(2) == f"ckpt/step-{stopped:08d}"
    pointer = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    assert pointer["iteration"] == stopped and pointer["latest"] == f"step-{stopped:08d}"
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["end_iteration"] == stopped and len(metrics["losses"]) == stopped

    again = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "poplar", "train",
                            "--config", "run.json", "--iterations", str(stopped + 2)], cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY},
                           capture_output=True, text=True, timeout=DEADLINE_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from ckpt at iteration {stopped}" in again.stderr
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["end_iteration"] == stopped + 2 and len(metrics["iterations"]) == stopped + 2


@pytest.mark.multiprocess
def test_sigint_stops_a_single_process_run_with_status_130(tmp_path: Path) -> None:
    _config(tmp_path, iterations=100_000, checkpoint={"dir": "ckpt", "every": 1000}, log_every=1)
    log = tmp_path / "run.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY}
    proc = subprocess.Popen([sys.executable, "-m", "poplar", "train", "--config", "run.json"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    try:
        _wait_for(lambda: "iteration 2/100000" in log.read_text(), proc, deadline, "a second iteration")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 128 + signal.SIGINT, text[-3000:]
    stopped = int(re.search(r"poplar train: stopped by SIGINT at iteration (\d+)", text).group(1))
    assert json.loads((tmp_path / "ckpt" / "index.json").read_text())["iteration"] == stopped >= 2


@pytest.mark.skipif(not TORCHRUN.exists() or not Path("/proc").is_dir(), reason="needs torchrun and /proc")
@pytest.mark.multiprocess
def test_a_killed_rank_gives_one_line_that_names_it(tmp_path: Path) -> None:
    _config(tmp_path, iterations=100_000, log_every=1)
    log = tmp_path / "run.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY}
    proc = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node", "3", "-m", "poplar", "train",
                             "--config", "run.json"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    try:
        _wait_for(lambda: "iteration 3/100000" in log.read_text(), proc, deadline, "a third iteration")
        victim = worker_pid(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("poplar train:")]
    assert code != 0 and len(lines) == 1, text[-4000:]
    assert lines[0].startswith("poplar train: rank 1 died (its process ended); "), lines
    assert "did not report" not in lines[0], lines  # the live ranks, blocked by the death, are not blamed
    assert "another rank probably died" in lines[0] and "frame #" not in lines[0]
