"""Blocked time on a GPU (``poplar.comm.ledger``, Note: blocked time on a GPU), two NCCL ranks
(sharing a GPU where there is one: ``poplar.emulation.gpu_ranks``): a rank whose peer reaches an
all-reduce late is blocked on its compute stream for about that long, and the ledger says so,
while its host returned from the wait at once, free to queue the next kernels. Skipped without
CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from poplar.comm import Communicator
from poplar.process.launch import spawn
from poplar.emulation.gpu_ranks import rank_gpu

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.multiprocess]

LATE_CYCLES = 200_000_000  # about 0.1-0.3 s of one spinning kernel at a GPU's clock


def _sleep_seconds(device: torch.device) -> float:
    """How long ``torch.cuda._sleep(LATE_CYCLES)`` keeps this rank's stream busy."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(LATE_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def late_peer_worker(rank: int, world: int) -> tuple[float, float, float, float]:
    device = rank_gpu(rank, world)
    comm = Communicator(device=device)
    x = torch.full((1 << 20,), float(rank + 1), device=device)
    comm.all_reduce(x)  # NCCL builds its communicator at the first call
    late = _sleep_seconds(device) if rank == 1 else 0.0
    torch.cuda.synchronize(device)
    comm.all_reduce(torch.zeros(1, device=device))  # both ranks start together
    torch.cuda.synchronize(device)
    comm.ledger.clear()
    if rank == 1:
        torch.cuda._sleep(LATE_CYCLES)  # this rank's stream reaches the all-reduce late
    t0 = time.perf_counter()
    comm.all_reduce(x, async_op=True).wait()
    host_s = time.perf_counter() - t0
    blocked = comm.ledger.records[-1].seconds  # read here: waits for the end event
    return host_s, blocked, late, x[0].item()


def test_blocked_time_is_the_compute_streams_not_the_hosts() -> None:
    (host0, blocked0, _, sum0), (host1, blocked1, late, sum1) = spawn(late_peer_worker, 2, (), backend="nccl",
                                                                         timeout_s=180)
    assert sum0 == sum1 == 2 * (1 + 2)  # (1 + 2) after the first all-reduce, doubled by the second
    assert late > 0.05, late
    assert blocked0 > 0.5 * late, (blocked0, late)  # rank 0's stream waited for the late peer
    assert host0 < 0.5 * late, (host0, late)  # and its host did not
    assert blocked1 < 0.5 * late, (blocked1, late)  # the late rank itself hardly waited
