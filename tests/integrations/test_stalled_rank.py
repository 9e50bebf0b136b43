"""A rank that hangs (SIGSTOP) in the Lightning strategy or the Hugging Face Trainer ends the job
as ``poplar train`` ends it: the other rank's collective fails after the collective timeout, it
prints one line naming the stopped rank, and exits with status 1 within the timeout plus 10 s,
with no raw traceback."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0  # the doors' collective timeout in this test
START_S = 240.0  # how long the job may take to reach its second step on a loaded machine


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _step(path: Path) -> int:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return -1


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
@pytest.mark.parametrize("door, package, name", [("lightning", "lightning", "PoplarStrategy"),
                                                 ("hf", "transformers", "PoplarTrainer")])
def test_a_stopped_rank_ends_the_job_within_the_timeout_with_one_line(tmp_path: Path, door: str, package: str,
                                                                      name: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    err = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m",
                             "tests.integrations.stalled_rank", door, str(tmp_path), str(TIMEOUT_S)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    stopped = None
    try:
        deadline = time.monotonic() + START_S
        while min(_step(tmp_path / "step0"), _step(tmp_path / "step1")) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.2)
        assert min(_step(tmp_path / "step0"), _step(tmp_path / "step1")) >= 2, "the job did not start training"
        survivor, stopped = (int((tmp_path / f"pid{r}").read_text()) for r in (0, 1))
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        while _alive(survivor) and time.monotonic() < t0 + TIMEOUT_S + 60:
            time.sleep(0.1)
        ended_s = time.monotonic() - t0
        os.kill(stopped, signal.SIGCONT)  # torchrun's SIGTERM reaches it now
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        err.close()
    text = (tmp_path / "stderr").read_text()
    assert ended_s <= TIMEOUT_S + 10, (ended_s, text[-3000:])
    assert proc.returncode == 1, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith(f"{name}: ")]
    assert len(lines) == 1 and re.search(r"\brank 1\b", lines[0]), text[-3000:]
    # rank 0 left with status 1, and torchrun's summary carries its line
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 1 ", text), text[-3000:]
    # no worker's traceback: the one left is torchrun's own, raising its summary
    frames = re.findall(r"Traceback \(most recent call last\):\n(.*)\n", text)
    assert all("torchrun" in first for first in frames), text[-3000:]


def test_the_doors_default_timeout_is_the_command_lines(tmp_path: Path) -> None:
    from poplar.process.timeouts import COLLECTIVE_TIMEOUT_S
    from poplar.train.config import TrainConfig

    assert TrainConfig.collective_timeout_s == COLLECTIVE_TIMEOUT_S == 300.0
    if importlib.util.find_spec("lightning") is not None:
        from poplar.integrations.lightning import PoplarStrategy
        from tests import toy

        assert PoplarStrategy(plan=toy.plan_of((1, 1, 1))).timeout_s == COLLECTIVE_TIMEOUT_S
    if importlib.util.find_spec("transformers") is not None:
        from transformers import TrainingArguments

        from poplar.integrations.hf import collective_timeout_of

        # Hugging Face's own default (1800 s) gives way to Poplar's; a ddp_timeout the user set is kept
        assert collective_timeout_of(TrainingArguments(str(tmp_path), use_cpu=True)) == COLLECTIVE_TIMEOUT_S
        assert collective_timeout_of(TrainingArguments(str(tmp_path), use_cpu=True, ddp_timeout=42)) == 42.0
