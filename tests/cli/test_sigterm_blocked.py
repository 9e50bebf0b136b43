"""A rank blocked in a collective answers SIGTERM within seconds: under torchrun, rank 1 hangs
(SIGSTOP), rank 0 blocks in its next collective, and a SIGTERM to rank 0 ends it within 5 s with
one line saying so, instead of waiting out the collective timeout (60 s here) or torchrun's kill."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from poplar.emulation.torchrun_workers import worker_pid
from tests.cli.test_preemption import DEADLINE_S, _wait_for
from tests.cli.test_train_cli import CPU_ONLY, REPO, TORCHRUN, _config


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not TORCHRUN.exists() or not Path("/proc").is_dir(), reason="needs torchrun and /proc")
@pytest.mark.multiprocess
def test_a_rank_blocked_in_a_collective_exits_on_sigterm_within_5_s(tmp_path: Path) -> None:
    _config(tmp_path, iterations=100_000, log_every=1)  # collective_timeout_s 60
    log = tmp_path / "run.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY}
    proc = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "poplar", "train",
                             "--config", "run.json"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)
    hung = None
    try:
        _wait_for(lambda: "iteration 3/100000" in log.read_text(), proc, time.monotonic() + DEADLINE_S,
                  "a third iteration")
        rank0, hung = worker_pid(proc.pid, 0), worker_pid(proc.pid, 1)
        assert rank0 is not None and hung is not None
        os.kill(hung, signal.SIGSTOP)
        time.sleep(2.0)  # rank 0 reaches its next collective with rank 1 and blocks there
        os.kill(rank0, signal.SIGTERM)
        t0 = time.monotonic()
        while _alive(rank0) and time.monotonic() < t0 + 30:
            time.sleep(0.05)
        exited_s = time.monotonic() - t0
    finally:
        if hung is not None:
            os.kill(hung, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text()
    assert exited_s < 5.0, (exited_s, text[-3000:])
    assert "poplar train: rank 0: SIGTERM while blocked" in text and "in collective" in text, text[-3000:]
