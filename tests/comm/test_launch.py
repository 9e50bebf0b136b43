"""The multi-process harness: results come back, a failing or dead rank fails the run with its story."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from poplar.comm.launch import RankFailure, spawn


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


@pytest.mark.multiprocess
def test_timeout() -> None:
    with pytest.raises(RankFailure, match="timed out"):
        spawn(sleeps, 2, timeout_s=8)


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
