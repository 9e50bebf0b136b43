"""Calibration of a virtual link (``virtual_link``): the slowest link the machine's real
collectives still fit under, measured the way a run issues them.

One process per rank of the cluster runs every kind of collective (all-reduce, reduce-scatter,
all-gather) at a small size and at the model's size, ``reps`` times each. Before each one a
rank computes for a random 0-4 ms, so the ranks arrive at different moments with cores busy, as
they do from padded micro-steps whose real compute runs late into the pad. Each collective's
real seconds are counted from the last rank's issue (a pass-through link of no latency records
them). The link is then

    latency   = the ``quantile`` of the small collectives' seconds / ``margin``
    bandwidth = the lowest that still gives every large collective its ``quantile`` / ``margin``

so at most ~(1 - quantile) of the real collectives overshoot it (*late*), and a machine that
grows ``1 / margin`` slower still fits the rest.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import torch

from poplar.emulation.virtual_link import LinkSpec, VirtualLink
from poplar.planner.cost_model import bus_bytes

LINK_QUANTILE = 0.9
LINK_MARGIN = 0.8  # the real collectives' quantile at most this share of the link's time
SMALL_BYTES = 4096
REPS = 30
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _time_collectives(rank: int, world: int, spec: LinkSpec, sizes: list[int], reps: int) -> list[tuple[str, int, float]]:
    """One rank of the measuring job ``measure_link`` spawns."""
    from poplar.comm import Communicator

    torch.set_num_threads(1)
    return time_collectives(Communicator(), VirtualLink(spec, rank, record=True), sizes, reps)


def time_collectives(comm: Any, link: VirtualLink, sizes: list[int], reps: int) -> list[tuple[str, int, float]]:
    """This rank's part of a measurement (every rank of ``comm`` together; ``link``: a
    pass-through link that records): (op, bytes, real seconds) per measured collective."""
    world = comm.world_size
    rng = random.Random(comm.rank)
    x = torch.randn(64, 64)
    out = []
    with comm.observed(link):
        for size in sizes:
            numel = max(world, size // 4 // world * world)
            full, shard = torch.zeros(numel), torch.zeros(numel // world)
            calls = {"all_reduce": lambda: comm.all_reduce(full),
                     "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
                     "all_gather": lambda: comm.all_gather(full, shard)}
            for op in OPS:
                for rep in range(reps + 1):  # the first of each shape warms up
                    busy_until = time.perf_counter() + rng.uniform(0.0, 0.004)
                    while time.perf_counter() < busy_until:
                        x @ x
                    calls[op]()
                    if rep > 0:
                        out.append((op, numel * 4, link.real_seconds[-1]))
    return out


def fit_link(samples: list[tuple[str, int, float]], world: int, *, quantile: float = LINK_QUANTILE,
             margin: float = LINK_MARGIN) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) of the link from every rank's samples (module doc)."""
    if not 0 < margin <= 1 or not 0 < quantile <= 1:
        raise ValueError(f"quantile and margin must be in (0, 1], got {quantile} and {margin}")
    need: dict[tuple[str, int], float] = {}
    for key in {(op, n) for op, n, _ in samples}:
        need[key] = float(np.quantile([s for op, n, s in samples if (op, n) == key], quantile)) / margin
    small = min(n for _, n in need)
    latency = max(v for (op, n), v in need.items() if n == small)
    bandwidth = 1e15
    for (op, n), v in need.items():
        if n != small and v > latency:
            bandwidth = min(bandwidth, bus_bytes(op, n, world) / (v - latency))
    return latency, bandwidth


def measure_link(world: int, model_bytes: int, *, reps: int = REPS, quantile: float = LINK_QUANTILE,
                 margin: float = LINK_MARGIN, timeout_s: float = 300.0) -> dict[str, Any]:
    """Measure this machine's collectives on ``world`` spawned processes and fit a link:
    {"latency_s", "bandwidth_bytes_per_s", "quantile", "margin", "median_s"}."""
    from poplar.process.launch import spawn

    scratch = LinkSpec.create(0.0, 1e15, world)
    try:
        sizes = [SMALL_BYTES, max(int(model_bytes), 2 * SMALL_BYTES)]
        per_rank = spawn(_time_collectives, world, (scratch, sizes, reps), timeout_s=timeout_s,
                         collective_timeout_s=timeout_s)
    finally:
        scratch.remove()
    samples = [s for rank in per_rank for s in rank]
    latency, bandwidth = fit_link(samples, world, quantile=quantile, margin=margin)
    return {"latency_s": latency, "bandwidth_bytes_per_s": bandwidth, "quantile": quantile, "margin": margin,
            "median_s": {f"{op}:{n}": float(np.median([s for o, m, s in samples if (o, m) == (op, n)]))
                         for op, n in sorted({(o, m) for o, m, _ in samples})}}


def measure_link_together(comm: Any, model_bytes: int, *, reps: int = REPS, what: str = "link calibration",
                          error_type: type[Exception] = RuntimeError) -> dict[str, Any]:
    """``measure_link`` inside a running job: every rank of ``comm`` times the collectives
    together, and every rank fits the same link from everyone's samples. Rank 0 makes the scratch
    link's board and removes it once every rank is done. Any failure is ``error_type`` on every
    rank (``what`` names the caller)."""
    scratch, error = None, None
    if comm.rank == 0:
        try:
            scratch = LinkSpec.create(0.0, 1e15, comm.world_size)
        except OSError as e:
            error = f"the scratch link's board could not be made: {e}"
    scratch = comm.agree(error, f"{what}: scratch link", scratch, error_type=error_type)[0]
    samples, error = [], None
    try:
        samples = time_collectives(comm, VirtualLink(scratch, comm.rank, record=True),
                                   [SMALL_BYTES, max(int(model_bytes), 2 * SMALL_BYTES)], reps)
    except Exception as e:  # noqa: BLE001 - agreed below
        error = f"timing the collectives failed: {type(e).__name__}: {e}"
    try:
        everyone = comm.agree(error, f"{what}: timing", samples, error_type=error_type)
    finally:
        if comm.rank == 0:
            scratch.remove()
    every = [s for rank in everyone for s in rank]
    latency, bandwidth = fit_link(every, comm.world_size)
    return {"latency_s": latency, "bandwidth_bytes_per_s": bandwidth, "quantile": LINK_QUANTILE,
            "margin": LINK_MARGIN}
