"""The multi-process harness: results come back, a failing or dead rank fails the run with its story,
ranks that reported leave on their own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from poplar.process.launch import RankFailure, spawn


def sum_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def rank1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


def rank0_dies(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()  # the survivor must not wait forever


def sleeps(rank: int, world: int) -> None:
    time.sleep(60)


@pytest.mark.multiprocess
def test_results_per_rank() -> None:
    assert spawn(sum_ranks, 3) == [3.0, 3.0, 3.0]


@pytest.mark.multiprocess
def test_failing_rank_reports_traceback() -> None:
    with pytest.raises(RankFailure, match="rank one is broken") as info:
        spawn(rank1_raises, 2, grace_s=5)
    assert 1 in info.value.failures and "Traceback" in info.value.failures[1]


@pytest.mark.multiprocess
def test_dead_rank_fails_fast() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="exit code 3"):
        spawn(rank0_dies, 2, grace_s=5, collective_timeout_s=30)
    assert time.monotonic() - t0 < 30


def counts_its_start_and_raises(rank: int, world: int, path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{rank}\n")
    raise RuntimeError("fails inside fn")


@pytest.mark.multiprocess
def test_a_failure_inside_fn_is_not_started_again(tmp_path) -> None:
    """Only a group that failed to form starts again: ranks that ran fn are never run twice."""
    starts = tmp_path / "starts"
    with pytest.raises(RankFailure, match="fails inside fn") as info:
        spawn(counts_its_start_and_raises, 2, (str(starts),), grace_s=5)
    assert sorted(starts.read_text().split()) == ["0", "1"]
    assert "failed to form" not in str(info.value)


@pytest.mark.multiprocess
def test_a_group_that_fails_to_form_starts_once_more_then_reports_both() -> None:
    """Every rank fails to join (no such backend): the group starts a second time, and the
    failure names both attempts with the cause."""
    with pytest.raises(RankFailure, match="failed to form 2 times") as info:
        spawn(sum_ranks, 2, backend="no-such-backend", grace_s=5)
    assert str(info.value).count("no-such-backend") >= 2 and set(info.value.failures) == {0, 1}


@pytest.mark.multiprocess
def test_timeout() -> None:
    # the ranks sleep 60 s: any deadline well under that shows the run ending on it, not hanging
    with pytest.raises(RankFailure, match="timed out"):
        spawn(sleeps, 2, timeout_s=2)


def environment_and_threads(rank: int, world: int) -> tuple[str | None, str | None, int]:
    return os.environ.get("POPLAR_TEST_LAUNCH"), os.environ.get("POPLAR_TEST_GONE"), torch.get_num_threads()


@pytest.mark.multiprocess
def test_ranks_see_the_callers_environment_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks fork from a server started at the first call; each call's ranks still see the
    caller's environment as it is then (set and unset variables), not the server's."""
    monkeypatch.setenv("POPLAR_TEST_GONE", "set")
    monkeypatch.setenv("POPLAR_TEST_LAUNCH", "first")
    assert spawn(environment_and_threads, 2, threads_per_rank=2) == [("first", "set", 2)] * 2
    monkeypatch.setenv("POPLAR_TEST_LAUNCH", "second")
    monkeypatch.delenv("POPLAR_TEST_GONE")
    assert spawn(environment_and_threads, 2) == [("second", None, 1)] * 2


def holds_a_lock_and_leaves_slowly(rank: int, world: int) -> int:
    """A rank that creates a named semaphore (as a progress bar's lock does) and whose exit
    handlers take a second before the semaphore's release runs."""
    import multiprocessing
    import multiprocessing.util

    holds_a_lock_and_leaves_slowly.lock = multiprocessing.RLock()  # type: ignore[attr-defined]
    multiprocessing.util.Finalize(None, time.sleep, (1.0,), exitpriority=10)  # runs before the release
    return rank


@pytest.mark.multiprocess
def test_ranks_that_reported_leave_on_their_own() -> None:
    """Ranks that reported get time to run their exit handlers; terminated in the middle of them
    they would leave their semaphores behind, and the caller would exit with the resource
    tracker's "leaked semaphore" warning."""
    script = ("from poplar.process.launch import spawn\n"
              "from tests.process.test_launch import holds_a_lock_and_leaves_slowly\n"
              "if __name__ == '__main__':\n"
              "    print(spawn(holds_a_lock_and_leaves_slowly, 2, timeout_s=60))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[0, 1]", done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr
