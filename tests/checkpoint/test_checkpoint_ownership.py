"""One job per checkpoint directory (the lock: refused while its owner lives, taken over when it
is gone or an earlier attempt of the same job, nested within a process, released at the end), a
damaged latest checkpoint (checksum mismatch) passed over for the previous kept one, and a
directory holding no complete checkpoint refused with the fix in the API's terms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poplar.checkpoint import CheckpointError, DamagedCheckpoint, NoCompleteCheckpoint, load_checkpoint
from poplar.checkpoint import lock
from poplar.checkpoint.kept import step_name
from tests.checkpoint.test_checkpoint_kept import PLAN1, _two_kept, fit, make_engine, poplar_log  # noqa: F401


def _foreign_lock(directory: Path, **fields: object) -> None:
    """A lock record as another process would have written it."""
    directory.mkdir(parents=True, exist_ok=True)
    record = {**lock.Owner.me().to_json(), "token": "other", **fields}
    (directory / lock.LOCK_FILE).write_text(json.dumps(record))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_owner_refuses_a_second_job_naming_it(tmp_path: Path) -> None:
    parent = os.getppid()  # alive for the whole test, and not this process
    _foreign_lock(tmp_path / "ckpt", pid=parent, pid_start=lock._process_start(parent), started="2026-01-01T00:00:00")
    with pytest.raises(lock.DirectoryLocked, match=rf"in use by another job \(pid {parent} on .*2026-01-01"):
        lock.acquire(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=rf"(?s)claim checkpoint directory .*\(pid {parent}.*another checkpoint dir"):
        fit(make_engine(1, PLAN1), 2, tmp_path / "ckpt", 1)
    assert not list((tmp_path / "ckpt").glob("step-*"))  # nothing was saved, nothing deleted
    assert lock.read_owner(tmp_path / "ckpt").pid == parent


def test_a_lock_on_another_machine_says_which_file_to_remove(tmp_path: Path) -> None:
    _foreign_lock(tmp_path / "ckpt", host="elsewhere-node-7", pid=1)
    with pytest.raises(lock.DirectoryLocked, match=r"on elsewhere-node-7.*another machine; if it is gone, remove"):
        lock.acquire(tmp_path / "ckpt")


def test_a_stale_lock_is_taken_over_with_a_note_and_released_at_the_end(tmp_path: Path,
                                                                       poplar_log: list[str]) -> None:
    directory = tmp_path / "ckpt"
    _foreign_lock(directory, pid=_dead_pid())
    with torch.random.fork_rng(devices=[]):
        fit(make_engine(1, PLAN1), 2, directory, 1)
    assert any("took over the lock" in line and "its process has ended" in line for line in poplar_log), poplar_log
    assert not (directory / lock.LOCK_FILE).exists()
    assert sorted(p.name for p in directory.iterdir()) == ["index.json", step_name(1), step_name(2)]


def test_a_reused_pid_is_not_the_owner(tmp_path: Path) -> None:
    """A live pid that started at another time than the owner did is another process."""
    parent = os.getppid()
    _foreign_lock(tmp_path / "ckpt", pid=parent, pid_start=(lock._process_start(parent) or 0) + 1)
    assert "its process has ended" in lock.acquire(tmp_path / "ckpt")
    lock.release(tmp_path / "ckpt")


def test_an_earlier_attempt_of_the_same_job_is_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    parent = os.getppid()
    _foreign_lock(tmp_path / "ckpt", pid=parent, pid_start=lock._process_start(parent), job="job-1", attempt=0)
    assert "an earlier attempt of this job" in lock.acquire(tmp_path / "ckpt")
    assert lock.read_owner(tmp_path / "ckpt").attempt == 1
    lock.release(tmp_path / "ckpt")
    _foreign_lock(tmp_path / "ckpt", pid=parent, pid_start=lock._process_start(parent), job="job-2", attempt=0)
    with pytest.raises(lock.DirectoryLocked):  # another job, alive
        lock.acquire(tmp_path / "ckpt")


def test_holding_nests_within_a_process_and_release_keeps_a_taken_over_lock(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    assert lock.acquire(directory) is None and lock.acquire(directory) is None
    lock.release(directory)
    assert lock.read_owner(directory).pid == os.getpid()  # one holder left
    lock.release(directory)
    assert not (directory / lock.LOCK_FILE).exists()
    lock.acquire(directory)
    _foreign_lock(directory, pid=os.getppid())  # someone replaced it: not ours to remove
    lock.release(directory)
    assert lock.read_owner(directory).token == "other"


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path: Path,
                                                                               poplar_log: list[str]) -> None:
    directory = _two_kept(tmp_path)  # steps 2 and 4
    rank_file = directory / step_name(4) / "__0_0.distcp"
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the sha256 tells
    rank_file.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match="does not match its sha256"):
        load_checkpoint(make_engine(1, PLAN1), directory)
    with torch.random.fork_rng(devices=[]):
        result = fit(make_engine(1, PLAN1, seed=6), 5, directory, 1)
    assert result.start_iteration == 2
    assert any("not resuming from a damaged or incomplete checkpoint" in line and "does not match its sha256" in line
               for line in poplar_log), poplar_log
    assert any("resumed from" in line and "the previous kept one" in line for line in poplar_log), poplar_log
    assert sorted(p.name for p in directory.iterdir()) == ["index.json", step_name(4), step_name(5)]


def test_damage_in_every_kept_checkpoint_is_an_error(tmp_path: Path) -> None:
    directory = _two_kept(tmp_path)
    for step in (2, 4):
        path = directory / step_name(step) / "__0_0.distcp"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(NoCompleteCheckpoint) as caught:
        fit(make_engine(1, PLAN1), 5, directory, 1)
    text = str(caught.value)
    # every step tried, newest first, and what to do
    assert text.index(step_name(4)) < text.index(step_name(2)) and text.count("does not match its sha256") == 2, text
    assert "Remove the damaged step directories" in text and "CheckpointOptions(resume=False)" in text, text


def test_no_complete_checkpoint_names_the_api_fix(tmp_path: Path) -> None:
    directory = _two_kept(tmp_path)
    for step in (2, 4):
        (directory / step_name(step) / ".metadata").unlink()
    with pytest.raises(NoCompleteCheckpoint, match=r"holds no complete checkpoint(.|\n)*CheckpointOptions\(resume=False\)"):
        fit(make_engine(1, PLAN1), 5, directory, 1)
    assert not (directory / lock.LOCK_FILE).exists()  # a failed resume lets go of the directory
