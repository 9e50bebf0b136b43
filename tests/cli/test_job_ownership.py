"""`poplar train` owns its checkpoint directory and says so once: a second job on the directory
is refused at once (before it builds anything) naming the owner, while the first finishes with all its checkpoints; a
plan that disagrees with ``train_batch_size`` (or with the resumed run's global batch) is one
error naming both numbers, exit 1 on every rank; a directory with no complete checkpoint names
the config key that starts over."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poplar.checkpoint.lock import LOCK_FILE
from poplar.types.plans import Plan
from tests.cli.test_train_cli import CPU_ONLY, REPO, TORCHRUN, _config, _torchrun

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY}
DEADLINE_S = 120.0
# `poplar train` in a process that has imported torch and the command line already and runs it
# once the file argv[1] exists: its start-up (seconds under load) is then behind it when it goes
READY_THEN_TRAIN = """
import pathlib, sys, time
import torch
from poplar.cli import main
go = pathlib.Path(sys.argv[1])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.02)
sys.exit(main(["train", "--config", "run.json"]))
"""


def failure_lines(stderr: str) -> list[str]:
    """Each failure paragraph: a line that starts with "poplar train:" and the indented lines under it."""
    out: list[str] = []
    inside = False
    for line in stderr.splitlines():
        if line.startswith("poplar train:"):
            out.append(line)
            inside = True
        elif inside and line.startswith("  "):
            out[-1] += "\n" + line
        else:
            inside = False
    return out


def rank_exit_codes(stderr: str) -> dict[int, int]:
    """Each failed rank's exit status, from torchrun's summary."""
    return {int(r): int(c) for r, c in re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", stderr)}


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_a_second_job_on_a_checkpoint_directory_is_refused_and_the_first_keeps_every_checkpoint(
        tmp_path: Path) -> None:
    _config(tmp_path, iterations=300, log_every=10, checkpoint={"dir": "ckpt", "every": 50, "keep": 100})
    log, go = tmp_path / "first.log", tmp_path / "go"
    # the second job imports torch before the first starts: refused at once, it cannot lose a race
    # with the first's 300 iterations to its own start-up on a loaded machine
    second = subprocess.Popen([sys.executable, "-c", READY_THEN_TRAIN, str(go)], cwd=tmp_path, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert second.stdout is not None and second.stdout.readline().strip() == "ready"
    first = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "poplar", "train",
                              "--config", "run.json"], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=log.open("w"), start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    try:
        # the second job starts once the first holds the directory, so the first's whole run (its
        # plan and 300 iterations) stands against the second's start-up, not what is left after 10
        while not (tmp_path / "ckpt" / LOCK_FILE).exists():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        go.touch()
        _, second_err = second.communicate(timeout=60)
        assert first.poll() is None, "the first job ended before the second was refused: make it longer"
        code = first.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if first.poll() is None:
            os.killpg(first.pid, 9)
        if second.poll() is None:
            second.kill()
    lines = failure_lines(second_err)
    assert second.returncode == 1 and len(lines) == 1, second_err[-3000:]
    assert re.search(r"ckpt is in use by another job \(pid \d+ on .*, started .*torchrun job", lines[0]), lines
    assert "Give this run another checkpoint directory" in lines[0]
    # refused at once: before the model, data or plan are built (the subprocess's timeout is the
    # hang guard; its seconds, mostly Python importing torch, are not asserted: at load 37 a
    # refusal took 31.6 s)
    assert "data:" not in second_err and "plan (" not in second_err, second_err[-3000:]
    text = log.read_text()
    assert code == 0, text[-3000:]
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["index.json", "profile.json", "profile.fingerprint.json",
                                                      *[f"step-{i:08d}" for i in range(50, 301, 50)]] \
        or sorted(p.name for p in ckpt.iterdir()) == ["index.json", *[f"step-{i:08d}" for i in range(50, 301, 50)]]
    assert json.loads((tmp_path / "report" / "metrics.json").read_text())["end_iteration"] == 300


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_a_plan_that_disagrees_with_train_batch_size_is_one_error_exit_1_on_every_rank(tmp_path: Path) -> None:
    _config(tmp_path, plan="plan.json", iterations=2)
    cfg = json.loads((tmp_path / "run.json").read_text())
    cfg.pop("train_micro_batch_size_per_gpu")
    (tmp_path / "run.json").write_text(json.dumps(cfg))  # train_batch_size 12
    Plan.even(2, 10, 2).save(tmp_path / "plan.json")
    run = _torchrun(tmp_path)
    lines = failure_lines(run.stderr)
    assert run.returncode == 1 and len(lines) == 1, run.stderr[-3000:]
    assert "global batch of 10 samples" in lines[0] and '"train_batch_size" is 12' in lines[0], lines
    assert '"train_batch_size": 10' in lines[0] and "poplar plan --gbs 12" in lines[0], lines
    assert rank_exit_codes(run.stderr) == {0: 1, 1: 1}, run.stderr[-3000:]
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step-*"))

    # without train_batch_size the plan file decides, but a resumed run keeps its global batch
    cfg.pop("train_batch_size")
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    assert _torchrun(tmp_path).returncode == 0  # trains 2 iterations at a global batch of 10
    Plan.even(2, 8, 2).save(tmp_path / "plan.json")
    again = _torchrun(tmp_path, "--iterations", "4")
    lines = failure_lines(again.stderr)
    assert again.returncode == 1 and len(lines) == 1, again.stderr[-3000:]
    assert "global batch of 8 samples" in lines[0] and "ckpt trained 10" in lines[0], lines
    assert rank_exit_codes(again.stderr) == {0: 1, 1: 1}, again.stderr[-3000:]


@pytest.mark.multiprocess
def test_no_complete_checkpoint_names_the_config_key(tmp_path: Path) -> None:
    _config(tmp_path, iterations=2)
    first = subprocess.run([sys.executable, "-m", "poplar", "train", "--config", "run.json"], cwd=tmp_path, env=ENV,
                           capture_output=True, text=True, timeout=DEADLINE_S)
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "ckpt" / "step-00000002" / ".metadata").unlink()
    again = subprocess.run([sys.executable, "-m", "poplar", "train", "--config", "run.json"], cwd=tmp_path, env=ENV,
                           capture_output=True, text=True, timeout=DEADLINE_S)
    assert again.returncode == 1, again.stderr[-3000:]
    assert 'set "poplar.checkpoint.resume": false' in again.stderr and "resume=False" not in again.stderr
