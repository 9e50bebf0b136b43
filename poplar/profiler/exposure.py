"""Exposed communication: what of the collectives a step's compute did not hide, on the rank
that waited for no one, measured in the lock-step timing rounds (``timing.run_rounds``), and the
balanced rounds that measure it where the planner's steps run: with every rank finishing its
compute at about the same time.

Every round's facts, per rank: (compute, micro-step comm, end-of-iteration comm, overhead, pass).
On the round's slowest rank the micro-step comm is the communication its compute did not hide
(prefetched all-gathers and reduce-scatters in flight overlap it), the end comm the iteration's
closing collectives, and the overhead the rest of the iteration outside the micro-step.

Two things move the micro-step exposure, and a plan's steps differ from the timing grid's in
both:
- the step's compute: longer compute hides more of the collectives. The grid rounds span the
  ranks' whole range of batches, so they give the slope (a Theil-Sen line: the median of pairwise
  slopes, robust to a disturbed round), kept in [-1, 0] so that a step never gets shorter as its
  compute grows.
- how many ranks finish together: a grid round's slowest rank usually leads the other device
  types by far, while in a planned step every rank finishes at about the same time, each one's
  collectives then wait on the others' late starts and compete with their work. Balanced rounds
  (``balanced_batches``) measure the exposure there; the line keeps the grid's slope through them.

The first pass over a set of batch sizes runs each shape for the first time (allocator growth,
first kernels of a shape, on every rank at once) and exposes more than any later iteration does,
so it is left out when later passes give enough rounds.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import scipy.stats

MIN_ROUNDS = 4  # rounds needed to fit a slope, or to leave the first pass out
BALANCED_LEVELS = 2  # compute levels of the balanced rounds
BALANCED_REPEATS = 3  # passes over them (the first is left out)


def balanced_batches(best: list[dict[int, float]], mbs: list[int], levels: int = BALANCED_LEVELS) -> list[list[int]]:
    """Per rank, one batch per level such that every rank's compute (``best``: per rank, its
    measured seconds per timed batch, interpolated in between) is about the level's: levels
    spread up to the largest compute every rank reaches, where planned steps run."""
    low = max(min(times.values()) for times in best)
    high = min(max(times.values()) for times in best)
    if high <= low:
        targets = [high]
    else:
        targets = list(np.linspace(low, high, levels + 1)[1:])
    out = []
    for times, top in zip(best, mbs):
        xs = sorted(times)
        curve = np.interp(np.arange(1, top + 1), xs, [times[b] for b in xs])
        out.append([int(np.argmin(np.abs(curve - t))) + 1 for t in targets])
    return out


def _critical(everyone: list[list[tuple]]) -> list[tuple]:
    """Per round, the facts of its slowest rank; the first pass left out if enough remain."""
    rounds = min(len(f) for f in everyone)
    critical = [max((f[k] for f in everyone), key=lambda x: x[0]) for k in range(rounds)]
    later = [c for c in critical if c[4] > 0]
    return later if len(later) >= MIN_ROUNDS else critical


def exposed_costs(grid: list[list[tuple]], balanced: list[list[tuple]] | None = None) -> dict[str, Any]:
    """The profile's exposed communication (``CommProfile.exposed_*``) from every rank's facts of
    the grid rounds and, if any, of the balanced rounds."""
    if min(len(f) for f in grid) == 0:
        return {}
    critical = _critical(grid)
    compute = np.array([c[0] for c in critical])
    micro = np.array([c[1] for c in critical])
    slope = 0.0
    if len(critical) >= MIN_ROUNDS and np.ptp(compute) > 0:
        slope = float(np.clip(scipy.stats.theilslopes(micro, compute).slope, -1.0, 0.0))
    at = float(np.median(compute))
    where = critical
    if balanced and min(len(f) for f in balanced) > 0:
        where = _critical(balanced)
    level = float(np.median([c[1] - slope * (c[0] - at) for c in where]))
    return {"exposed_micro_step_s": max(0.0, level), "exposed_micro_step_slope": slope,
            "exposed_at_compute_s": at, "exposed_compute_range_s": [float(compute.min()), float(compute.max())],
            "exposed_iteration_s": statistics.median(c[2] for c in critical),
            "iteration_overhead_s": max(0.0, statistics.median(c[3] for c in critical))}
