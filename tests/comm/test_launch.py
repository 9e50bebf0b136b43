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
