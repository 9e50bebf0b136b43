"""Exposed communication: what of the collectives a step's compute did not hide, on the rank
that waited for no one, from the lock-step timing rounds (``timing.run_rounds``) and, with two
ranks or more, from steady rounds that repeat one shape the way a training run repeats its plan's.

Every round's facts, per rank, are a ``timing.RoundFacts``: compute, micro-step comm,
end-of-iteration comm, overhead and pass. On the round's slowest rank the micro-step comm is the
communication its compute did not hide (prefetched all-gathers and reduce-scatters in flight
overlap it), the end comm the iteration's closing collectives, and the overhead the rest of the
iteration outside the micro-step.

How much a step, or the iteration's end, exposes depends on how far its slowest rank leads the
others. Leading by far, it finds the others already waiting at every collective, and its
collectives run at once (a grid round leading by ``LEAD_SCALE`` counts as led; the planner
prices a step's lead in proportion, up to ``LED_ROUNDS_LEAD``, where the led rounds measure).
When every rank finishes together, as in the planner's plans, each collective waits for
whichever rank comes last, block by block at ZeRO-3, and competes with the others' work, so a
balanced step exposes more than a led one, and a model priced from grid rounds (whose slowest
device type mostly leads by far) under-prices balanced plans.
It also depends on the history: the grid rounds change every rank's batch from round to round,
and the first rounds of a new shape expose more than the rounds after them. So with two ranks or
more the exposure comes from steady rounds: one shape for ``STEADY_ROUNDS`` rounds in a row, the
first ``SETTLING`` left out, in these configurations (``exposure_batches``):
- balanced: every rank at the largest compute all ranks reach, where planned steps run;
- led, one per device type: that type there, the others at half of it, since who leads matters
  (a lone fast rank leading exposes less than several that tie, which wait on each other);
- led by a little, one per device type: that type there, the others at ``1 - SMALL_LEAD`` of it,
  since how the change grows with the lead differs (a lone leader takes most of it early, several
  leaders more gradually); its measured median lead goes to the profile too
  (``LedExposure.small_lead``), and the cost model uses that, not ``SMALL_LEAD``;
- short and shortest: balanced at a third of it and at the least all reach, since shorter steps
  hide less (a plan's last micro-step is often short, one sample at times); the balanced
  micro-step exposure (stages 2/3) is interpolated between the levels in the step's compute, and
  so is the iteration's end (stages 0/1, whose closing collectives overlap the rank's last
  micro-step: ``Exposure.end_s``);
- long (where a rank's largest batch computes well past the balanced level): every rank at its
  own largest batch, so longer steps are priced from a measurement, not as the balanced level (a
  longer step hides more). It is led by its slowest type, so its level is its exposure less that
  lead's change.
A step whose batches differ from the step before it (an iteration of a full micro-step and a
shorter last one alternates shapes) exposes what a grid round does, which changes shape every
round: the grid's led rounds less the steady led rounds is that step's extra (``Exposure.switch_s``).
Grid rounds compute less than steady ones, and where the levels show that less compute exposes
more, each grid round is first moved to the steady led rounds' compute along the levels' slope,
so that the extra is what changing shape adds, not what computing less exposes.
One round's exposure varies from round to round on a shared machine, where a whole plan's
prediction needs its exposure to about a percent of the iteration: the steady rounds of a
configuration go on, ``STEADY_CHUNK`` at a time, until the median of the step's exposure plus the
end's is known that well (``more_steady_rounds``: its standard error at most ``precision`` of
the round's median time), at most ``MAX_STEADY_ROUNDS`` rounds; a steady device stops at the first.
The largest of the configurations' standard errors goes to the profile (``Exposure.error``): under
load a configuration can end at the cap still known less well, and the planner then asks a larger
predicted gain before it leaves a conventional plan.
Without steady rounds (a probe) the grid rounds that did not lead give the balanced medians and
there is no lead exposure; the first pass is left out when later passes give enough rounds (it
runs every shape for the first time).

The emulated runs that showed each of these effects, with their figures, are in
docs/experiments.md.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from enum import Enum
from operator import attrgetter
from typing import Callable, NamedTuple

import numpy as np

from poplar.profiler.timing import RoundFacts
from poplar.types.profiles import Exposure, LedExposure
from poplar.planner.lead import LEAD_SCALE, LED_ROUNDS_LEAD, SMALL_LEAD, lead_change

# Round counts and thresholds. Each was chosen on the CPU emulator (emulated clusters on a 2-core
# machine; docs/experiments.md), not on GPUs; where the profiler measures the quantity instead,
# its comment says so.
MIN_ROUNDS = 4  # grid rounds needed to leave the first pass out
# a new shape's first rounds expose more than the rest (its history), so steady rounds run one
# shape at least this long and leave the first ``SETTLING`` out; tuned on the CPU emulator
STEADY_ROUNDS = 10
SETTLING = 2
# while the exposure is not known to ``EXPOSURE_PRECISION``: this many more rounds at a time, and
# at most ``MAX_STEADY_ROUNDS`` in all (the cost of a profile is bounded); tuned on the CPU emulator
STEADY_CHUNK = 8
MAX_STEADY_ROUNDS = 42
# the standard error of the median exposure to reach, in round times: a plan's prediction needs its
# exposure to about a percent of the iteration. Tuned on the CPU emulator; the error each
# configuration actually reached is measured and goes to the profile (``Exposure.error``), where
# the planner's tie reads it
EXPOSURE_PRECISION = 0.01
# ranks whose compute is within this fraction of the slowest's tie with it (they wait on each other
# like ranks of one type); the same as the timing's confirmation tolerance; chosen on the CPU emulator
TIE = 0.02
# a shorter (or longer) steady configuration runs only where its compute is under this fraction of
# the next level's, so that each level is distinct from its neighbour; chosen on the CPU emulator
DISTINCT_LEVEL = 0.7


class ExposureRounds(Enum):
    """Which rounds a timing measures the exposed communication in."""

    GRID = "grid"  # its timing rounds alone (a probe)
    STEADY = "steady"  # and, with two ranks or more, the steady rounds


class SteadyRounds(Enum):
    """The configurations of the steady rounds."""

    BALANCED = "balanced"  # every rank's compute about the same, the largest all reach
    SHORT = "short"  # the same at a third of that: how exposure grows as steps get shorter
    SHORTEST = "shortest"  # the same at the least compute every rank reaches
    LONG = "long"  # every rank at its own largest batch: the slowest type leads, far past balanced
    LED = "led"  # one device type leads the others by about half its compute
    LED_SMALL = "led_small"  # the same, the others at ``1 - SMALL_LEAD`` of it: how the change grows


@dataclass(frozen=True)
class SteadyConfig:
    """One configuration of steady rounds: its kind, and the device type that leads in a LED one."""

    kind: SteadyRounds
    leader: str = ""


def exposure_batches(best: list[dict[int, float]], mbs: list[int], types: list[str]) -> dict[SteadyConfig, list[int]]:
    """Per configuration, every rank's batch, from ``best`` (per rank, its measured seconds per
    timed batch, interpolated in between): the balanced one at the largest compute every rank
    reaches, the short one at a third of it and the shortest one at the least every rank reaches
    (each only if under ``DISTINCT_LEVEL`` of the next level up) and the long one, every rank at
    its mbs (only if the balanced level is under ``DISTINCT_LEVEL`` of the longest rank's), and
    with two device types or more one led configuration per type, that type there and the others
    at half of it, and one led by ``SMALL_LEAD`` where the batches give a distinct lead between a
    half and twice that. Every stage has the levels: at stages 2/3 each micro-step's exposure
    depends on the step's compute, at stages 0/1 the iteration's end on its last micro-step's."""
    top = min(max(times.values()) for times in best)

    curves = [np.interp(np.arange(1, mbs[i] + 1), sorted(times), [times[b] for b in sorted(times)])
              for i, times in enumerate(best)]  # seconds at every batch 1..mbs

    def batch_near(rank: int, seconds: float) -> int:
        return int(np.argmin(np.abs(curves[rank] - seconds))) + 1

    ranks = range(len(best))
    low = max(min(times.values()) for times in best)
    out = {SteadyConfig(SteadyRounds.BALANCED): [batch_near(i, top) for i in ranks]}
    above = top
    for config, seconds in ((SteadyRounds.SHORT, top / 3), (SteadyRounds.SHORTEST, low)):
        if low <= seconds < DISTINCT_LEVEL * above:
            out[SteadyConfig(config)] = [batch_near(i, seconds) for i in ranks]
            above = seconds
    longest = max(ranks, key=lambda i: max(best[i].values()))
    if top < DISTINCT_LEVEL * max(best[longest].values()):
        out[SteadyConfig(SteadyRounds.LONG, types[longest])] = list(mbs)
    if len(set(types)) > 1:
        for leader in sorted(set(types)):
            def led(lead: float) -> list[int]:
                return [batch_near(i, top if types[i] == leader else top * (1 - lead)) for i in ranks]

            out[SteadyConfig(SteadyRounds.LED, leader)] = led(LED_ROUNDS_LEAD)
            batches = led(SMALL_LEAD)
            seconds = [curves[i][b - 1] for i, b in enumerate(batches)]
            slowest = max(x for x, t in zip(seconds, types) if t == leader)
            led_by = 1 - max(x for x, t in zip(seconds, types) if t != leader) / slowest
            if SMALL_LEAD / 2 <= led_by <= 2 * SMALL_LEAD and batches not in out.values():
                out[SteadyConfig(SteadyRounds.LED_SMALL, leader)] = batches
    return out


class CriticalRound(NamedTuple):
    """One round as its slowest rank saw it."""

    facts: RoundFacts  # the slowest rank's
    lead: float  # how far it led the next slower rank that did not tie with it (a fraction of its compute)


class Level(NamedTuple):
    """A configuration's median compute and the median exposure at it."""

    compute_s: float
    exposed_s: float


class SmallLed(NamedTuple):
    """A leader's small led rounds: their median lead and the micro-step's median exposure."""

    lead: float
    exposed_s: float


def _critical(everyone: list[list[RoundFacts]], settled_from: int) -> list[CriticalRound]:
    """Per round, the facts of its slowest rank and by how much it led the next slower rank that
    did not tie with it; the rounds of passes before ``settled_from`` left out if enough remain."""
    rounds = min(len(f) for f in everyone)
    out = []
    for k in range(rounds):
        slowest = max((f[k] for f in everyone), key=lambda x: x.compute_s)
        top = slowest.compute_s
        others = [f[k].compute_s for f in everyone if f[k].compute_s < top * (1 - TIE)]
        out.append(CriticalRound(slowest, (top - max(others)) / top if others and top > 0 else 0.0))
    later = [c for c in out if c.facts.pass_index >= settled_from]
    return later if later and len(later) >= min(MIN_ROUNDS, rounds - settled_from) else out


def exposure_error(everyone: list[list[RoundFacts]]) -> float:
    """The standard error of one steady configuration's median exposed seconds (the slowest
    rank's micro-step plus end-of-iteration comm, settled rounds; 1.25 x 1.48 x MAD / sqrt(n) for
    a median of a roughly normal sample), as a fraction of its median round time; 0 with no
    settled round."""
    if min(len(f) for f in everyone) <= SETTLING:
        return 0.0
    settled = [c.facts for c in _critical(everyone, SETTLING)]
    exposed = [f.micro_step_comm_s + f.end_comm_s for f in settled]
    middle = statistics.median(exposed)
    spread = statistics.median(abs(x - middle) for x in exposed)
    round_s = statistics.median(f.compute_s + f.micro_step_comm_s + f.end_comm_s for f in settled)
    return 1.2533 * 1.4826 * spread / len(exposed) ** 0.5 / round_s if round_s > 0 else 0.0


def more_steady_rounds(everyone: list[list[RoundFacts]], precision: float = EXPOSURE_PRECISION) -> int:
    """How many more rounds one steady configuration needs (0: none), from every rank's facts of
    its rounds so far: ``STEADY_CHUNK`` while its ``exposure_error`` exceeds ``precision``, up to
    ``MAX_STEADY_ROUNDS`` in all. The same facts give every rank the same answer."""
    rounds = min(len(f) for f in everyone)
    if rounds >= MAX_STEADY_ROUNDS or rounds <= SETTLING or precision <= 0:
        return 0
    if exposure_error(everyone) <= precision:
        return 0
    return min(STEADY_CHUNK, MAX_STEADY_ROUNDS - rounds)


def continued(earlier: list[RoundFacts], later: list[RoundFacts]) -> list[RoundFacts]:
    """One rank's facts of a configuration's rounds, ``later`` run right after ``earlier``: their
    pass numbers (the round's index in a steady run) go on from there."""
    return earlier + [f._replace(pass_index=f.pass_index + len(earlier)) for f in later]


Part = Callable[[RoundFacts], float]  # which exposure of a round: its micro-step's or its end's
_micro_step: Part = attrgetter("micro_step_comm_s")
_end: Part = attrgetter("end_comm_s")


def _long_level(steady: dict[SteadyConfig, list[list[RoundFacts]]], led: dict[str, list[RoundFacts]],
                small: dict[str, list[CriticalRound]], balanced: float, part: Part) -> Level | None:
    """(compute, exposure) of the long rounds as a balanced level of ``part``: their median
    exposure less what their leader's lead changes (the led rounds' change, in proportion to the
    long rounds' median lead, ``lead_change``), since the cost model adds that back for a led step."""
    config = next((k for k in steady if k.kind is SteadyRounds.LONG), None)
    if config is None or min(len(f) for f in steady[config]) == 0:
        return None
    critical = _critical(steady[config], SETTLING)
    lead = statistics.median(c.lead for c in critical)
    change = statistics.median(part(f) for f in led[config.leader]) - balanced if config.leader in led else 0.0
    rounds = small.get(config.leader)
    at = None if rounds is None else statistics.median(r.lead for r in rounds)
    small_change = None if rounds is None else statistics.median(part(r.facts) for r in rounds) - balanced
    return Level(statistics.median(c.facts.compute_s for c in critical),
                 statistics.median(part(c.facts) for c in critical)
                 - float(lead_change(lead, change, at, small_change)))


def _levels(settled: dict[SteadyConfig, list[RoundFacts]], steady: dict[SteadyConfig, list[list[RoundFacts]]],
            led: dict[str, list[RoundFacts]], small: dict[str, list[CriticalRound]],
            part: Part) -> tuple[list[float], list[float]] | None:
    """The balanced exposure of ``part`` at each measured compute (ascending): the shortest and
    short rounds', the balanced ones', and the long ones' as a balanced level; None with the
    balanced level alone."""
    together = settled[SteadyConfig(SteadyRounds.BALANCED)]
    shorter = [settled[SteadyConfig(k)] for k in (SteadyRounds.SHORTEST, SteadyRounds.SHORT)
               if SteadyConfig(k) in settled]
    at = [statistics.median(f.compute_s for f in fs) for fs in shorter + [together]]
    levels = [statistics.median(part(f) for f in fs) for fs in shorter + [together]]
    long_level = _long_level(steady, led, small, levels[-1], part)
    if long_level is not None and long_level.compute_s > at[-1]:
        at.append(long_level.compute_s)
        levels.append(long_level.exposed_s)
    return (at, levels) if len(at) > 1 else None


def _switch(critical: list[CriticalRound], led: dict[str, list[RoundFacts]], together: list[RoundFacts],
            steps: tuple[list[float], list[float]] | None) -> float | None:
    """``Exposure.switch_s``: the grid's led rounds' micro-step exposure less the steady led
    rounds' (None without enough of both). A grid round computes less than a steady led one, and
    a shorter step hides less: each is compared at the steady rounds' compute along the levels'
    slope up to the balanced one, so that the switch is what changing shape adds, not what
    computing less exposes."""
    pooled = [f for fs in led.values() for f in fs]
    grid_led = [c.facts for c in critical if c.lead >= LEAD_SCALE]
    if not pooled or len(grid_led) < MIN_ROUNDS:
        return None
    slope = 0.0
    if steps is not None:
        at, levels = steps
        top = at.index(statistics.median(f.compute_s for f in together))
        if at[top] > at[0]:
            slope = (levels[top] - levels[0]) / (at[top] - at[0])
    c_led = statistics.median(f.compute_s for f in pooled)
    grid = [f.micro_step_comm_s + slope * (c_led - f.compute_s) for f in grid_led]
    return max(0.0, statistics.median(grid) - statistics.median(f.micro_step_comm_s for f in pooled))


def exposed_costs(grid: list[list[RoundFacts]],
                  steady: dict[SteadyConfig, list[list[RoundFacts]]] | None = None) -> Exposure:
    """The profile's exposed communication (``CommProfile.exposure``) from every rank's facts of
    the grid rounds and of the steady rounds, if any. Without steady rounds the grid
    rounds give the balanced exposure (those whose slowest rank did not lead, or all), and there
    is no lead exposure per device type."""
    if min(len(f) for f in grid) == 0:
        return Exposure()
    critical = _critical(grid, 1)
    steady = steady or {}
    settled = {k: [c.facts for c in _critical(v, SETTLING)] for k, v in steady.items() if min(len(f) for f in v) > 0}
    steps: tuple[list[float], list[float]] | None = None
    ends: tuple[list[float], list[float]] | None = None
    switch: float | None = None
    led: dict[str, list[RoundFacts]] = {k.leader: v for k, v in settled.items() if k.kind is SteadyRounds.LED}
    small: dict[str, list[CriticalRound]] = {k.leader: _critical(steady[k], SETTLING) for k in settled
                                             if k.kind is SteadyRounds.LED_SMALL}
    small_led = {t: SmallLed(statistics.median(r.lead for r in c),
                             statistics.median(r.facts.micro_step_comm_s for r in c)) for t, c in small.items()}
    if SteadyConfig(SteadyRounds.BALANCED) in settled:
        together = settled[SteadyConfig(SteadyRounds.BALANCED)]
        steps = _levels(settled, steady, led, small, _micro_step)
        ends = _levels(settled, steady, led, small, _end)
        switch = _switch(critical, led, together, steps)
    else:
        together = [c.facts for c in critical if c.lead < LEAD_SCALE]
        if len(together) < MIN_ROUNDS:
            together = [c.facts for c in critical]
    leaders = sorted(set(led) | set(small_led))
    return Exposure(
        micro_step_s=statistics.median(f.micro_step_comm_s for f in together),
        iteration_s=statistics.median(f.end_comm_s for f in together),
        step_compute_s=None if steps is None else tuple(steps[0]), step_s=None if steps is None else tuple(steps[1]),
        end_s=None if steps is None or ends is None else tuple(ends[1]),
        switch_s=switch,
        leaders=tuple(LedExposure(
            t,
            micro_step_s=statistics.median(f.micro_step_comm_s for f in led[t]) if t in led else None,
            iteration_s=statistics.median(f.end_comm_s for f in led[t]) if t in led else None,
            small_lead=small_led[t].lead if t in small_led else None,
            micro_step_small_lead_s=small_led[t].exposed_s if t in small_led else None,
            iteration_small_lead_s=statistics.median(r.facts.end_comm_s for r in small[t]) if t in small else None)
            for t in leaders),
        overhead_s=max(0.0, statistics.median(f.overhead_s for f in together)),
        error=max((exposure_error(steady[k]) for k in settled), default=None))
