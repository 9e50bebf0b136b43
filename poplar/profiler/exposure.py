"""Exposed communication: what of the collectives a step's compute did not hide, on the rank
that waited for no one, from the lock-step timing rounds (``timing.run_rounds``) and, at stages
2/3, from steady rounds that repeat one shape the way a training run repeats its plan's.

Every round's facts, per rank: (compute, micro-step comm, end-of-iteration comm, overhead, pass).
On the round's slowest rank the micro-step comm is the communication its compute did not hide
(prefetched all-gathers and reduce-scatters in flight overlap it), the end comm the iteration's
closing collectives, and the overhead the rest of the iteration outside the micro-step.

How much a step exposes depends on how far its slowest rank leads the others. Leading by a
tenth of its compute or more (``LEAD_SCALE``), it finds the others already waiting at every
collective, and its collectives run at once. When every rank finishes together, as in the
planner's steps, each collective waits for whichever rank comes last, block by block at ZeRO-3,
and competes with the others' work: ZeRO-2 plans ran 5-7 % slower than a model priced from
grid rounds, whose slowest device type mostly leads by far. It also depends on the history: the
grid rounds change every rank's batch from round to round, and the first two rounds of a shape
expose more than the rounds after them (2 A100-80G + 2 A100-40G at ZeRO-3: about 0.05 s against
0.035 s). So at stages 2/3 the micro-step exposure comes from steady rounds: one shape for
``STEADY_ROUNDS`` rounds in a row, the first ``SETTLING`` left out, in two configurations
(``exposure_batches``):
- balanced: every rank at the largest compute all ranks reach, where planned steps run;
- small: the same at a third of it or the least all reach, since shorter steps hide less (a plan's last micro-step is
  often short): the balanced exposure is interpolated between the two in the step's compute;
- led: the slowest device type at the balanced compute, the others at half of it.
One round's exposure varies by about a quarter on a shared machine, hence medians of eight. Without
steady rounds (stages 0/1) the grid rounds give the medians, the first pass left out when later
passes give enough rounds (it runs every shape for the first time).
"""

from __future__ import annotations

import statistics
from enum import Enum

import numpy as np

from poplar.types.profiles import LEAD_SCALE

MIN_ROUNDS = 4  # grid rounds needed to leave the first pass out
STEADY_ROUNDS = 10  # rounds of one shape in a row
SETTLING = 2  # of them left out
TIE = 0.02  # ranks whose compute is within this fraction of the slowest's tie with it


class ExposureRounds(Enum):
    """Which rounds a timing measures the exposed communication in."""

    GRID = "grid"  # its timing rounds alone (a probe)
    STEADY = "steady"  # and, at stages 2/3 with two ranks or more, the steady rounds


class SteadyRounds(Enum):
    """The configurations of the steady rounds."""

    BALANCED = "balanced"  # every rank's compute about the same, the largest all reach
    SMALL = "small"  # the same at a third of that: how exposure grows as steps get shorter
    LED = "led"  # the slowest device type leads the others by about half its compute


def exposure_batches(best: list[dict[int, float]], mbs: list[int], types: list[str]) -> dict[SteadyRounds, list[int]]:
    """Per configuration, every rank's batch, from ``best`` (per rank, its measured seconds per
    timed batch, interpolated in between): the balanced one at the largest compute every rank
    reaches, the small one at a third of it (or the least every rank reaches, if that is under 70 %
    of the balanced compute; else none), the led one (with two
    device types or more) with the slowest type there and the others at half of it. The slowest type is the one with the most seconds per sample at its
    smallest timed batch."""
    top = min(max(times.values()) for times in best)

    def batch_near(rank: int, seconds: float) -> int:
        times = best[rank]
        xs = sorted(times)
        curve = np.interp(np.arange(1, mbs[rank] + 1), xs, [times[b] for b in xs])
        return int(np.argmin(np.abs(curve - seconds))) + 1

    ranks = range(len(best))
    low = max(min(times.values()) for times in best)
    out = {SteadyRounds.BALANCED: [batch_near(i, top) for i in ranks]}
    short = max(top / 3, low)
    if short < 0.7 * top:
        out[SteadyRounds.SMALL] = [batch_near(i, short) for i in ranks]
    if len(set(types)) > 1:
        slowest = types[max(ranks, key=lambda i: best[i][min(best[i])] / min(best[i]))]
        out[SteadyRounds.LED] = [batch_near(i, top if types[i] == slowest else top / 2) for i in ranks]
    return out


def _critical(everyone: list[list[tuple]], settled_from: int) -> list[tuple[tuple, float]]:
    """Per round, the facts of its slowest rank and by how much it led the next slower rank that
    did not tie with it; the rounds of passes before ``settled_from`` left out if enough remain."""
    rounds = min(len(f) for f in everyone)
    out = []
    for k in range(rounds):
        slowest = max((f[k] for f in everyone), key=lambda x: x[0])
        others = [f[k][0] for f in everyone if f[k][0] < slowest[0] * (1 - TIE)]
        out.append((slowest, (slowest[0] - max(others)) / slowest[0] if others and slowest[0] > 0 else 0.0))
    later = [c for c in out if c[0][4] >= settled_from]
    return later if later and len(later) >= min(MIN_ROUNDS, rounds - settled_from) else out


def exposed_costs(grid: list[list[tuple]],
                  steady: dict[SteadyRounds, list[list[tuple]]] | None = None) -> dict[str, float | None]:
    """The profile's exposed communication (``CommProfile.exposed_*``) from every rank's facts of
    the grid rounds and, at stages 2/3, of the steady rounds. Without steady rounds the grid
    rounds give the balanced exposure (those whose slowest rank did not lead, or all) and the
    lead one (those whose slowest rank led by ``LEAD_SCALE`` or more)."""
    if min(len(f) for f in grid) == 0:
        return {}
    critical = _critical(grid, 1)
    settled = {k: _critical(v, SETTLING) for k, v in (steady or {}).items() if min(len(f) for f in v) > 0}
    ends, small, at = critical, None, None
    if SteadyRounds.BALANCED in settled:
        ends = settled[SteadyRounds.BALANCED]
        together = [facts[1] for facts, _ in ends]
        led = [facts[1] for facts, _ in settled.get(SteadyRounds.LED, [])]
        if SteadyRounds.SMALL in settled:
            shorter = settled[SteadyRounds.SMALL]
            small = statistics.median(facts[1] for facts, _ in shorter)
            at = [statistics.median(facts[0] for facts, _ in shorter), statistics.median(facts[0] for facts, _ in ends)]
    else:
        together = [facts[1] for facts, lead in critical if lead < LEAD_SCALE]
        if len(together) < MIN_ROUNDS:
            together = [facts[1] for facts, _ in critical]
        led = [facts[1] for facts, lead in critical if lead >= LEAD_SCALE]
        led = led if len(led) >= MIN_ROUNDS else []
    return {"exposed_micro_step_s": statistics.median(together),
            "exposed_micro_step_lead_s": statistics.median(led) if led else None,
            "exposed_short_step_s": small, "exposed_compute_s": at,
            "exposed_iteration_s": statistics.median(facts[2] for facts, _ in ends),
            "iteration_overhead_s": max(0.0, statistics.median(facts[3] for facts, _ in ends))}
