"""Timing: compute seconds of one micro-step at several batch sizes, measured in lock-step rounds
with the real runtime and its real, instrumented collectives; and the collectives' bandwidth.

Every round is one runtime iteration in which every rank runs one micro-step of its own batch
size, each known to fit (it is at most the rank's ``mbs`` from the capacity search, which ran
the same runtime code at the same world size). Ranks with fewer sizes to time repeat theirs, so
every rank runs the same number of rounds. A failure inside a round is reported by the runtime
at its iteration agreement, on every rank, so no rank is left waiting.

The measured window of a micro-step opens when ``loss_fn`` is called and closes when
``runtime.backward`` returns (the stage's end-of-micro-step collectives included). Its compute
time is ``TimeConsumedDuringStep`` of docs/design.md §4: wall time minus the seconds the runtime's
comm ledger recorded inside collectives during the window. At stages 0/1 there are none (the
first synchronisation is after backward), at stage 2 these are the reduce-scatters, at stage 3
the all-gathers of forward and backward and the reduce-scatters; a collective's seconds include
the time spent waiting for slower ranks, which is exactly what must not count as compute.

Each round also records, per rank, what the iteration cost besides compute (its micro-step and
closing communication and its overhead); ``exposure.exposed_costs`` turns them into the planner's
model of the communication compute did not hide.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, NamedTuple

import torch

from poplar.logs import progress_bar
from poplar.profiler.devices import Device
from poplar.profiler.local_comm import round_plan
from poplar.profiler.links import DEFAULT_COMM_SIZES, measure_links
from poplar.types.profiles import CommProfile, ProfilePoint
from poplar.types.topology import Topology
from poplar.comm import Communicator
from poplar.zero.observers import MicroStep, StepObserver
from poplar.zero.runtime import PlanCheck, ZeroRuntime


class TimingGrid(Enum):
    """Which batch sizes up to a rank's mbs are timed."""

    DENSE = "dense"  # powers of two, the points halfway between them in log scale, and mbs
    SPARSE = "sparse"  # powers of two and mbs: half the cost, for candidates after the first (auto mode)


def timing_batches(mbs: int, grid: TimingGrid = TimingGrid.DENSE) -> list[int]:
    """Batch sizes to time on a rank whose largest batch is ``mbs``: powers of two, with the
    ``DENSE`` grid the points halfway between them in log scale (3 * 2^k), and ``mbs`` itself."""
    if mbs < 1:
        return []
    sizes = {mbs}
    k = 1
    while k <= mbs:
        sizes.add(k)
        if grid is TimingGrid.DENSE and 3 * k // 2 <= mbs and k >= 2:
            sizes.add(3 * k // 2)
        k *= 2
    return sorted(sizes)


def round_schedule(per_rank: list[list[int]], repeats: int, warmup: bool = True) -> list[list[int]]:
    """Rounds of lock-step timing: ``rounds[r][i]`` is rank i's batch in round r. The first round
    (if ``warmup``) is a warm-up at each rank's largest size; then ``repeats`` passes over every
    rank's list (a shorter list is cycled so that all ranks run the same number of rounds)."""
    length = max(len(s) for s in per_rank)
    rounds = [[max(s) for s in per_rank]] if warmup else []
    for rep in range(repeats):
        for r in range(length):
            rounds.append([s[(r + rep * length) % len(s)] for s in per_rank])
    return rounds


def settled(times: list[float], tolerance: float) -> bool:
    """A batch's minimum is trusted once a second measurement confirms it within ``tolerance``."""
    if len(times) < 2:
        return False
    a, b = sorted(times)[:2]
    return b <= a * (1 + tolerance)


class Confirmation(Enum):
    """When a timed batch's measurement is trusted, or measured again."""

    REPEAT = "repeat"  # once a second measurement confirms its minimum (``settled``)
    CURVE = "curve"  # its minimum keeps the curve's shape (``breaks_curve``), or as REPEAT


def breaks_curve(batch: int, best: dict[int, float], tolerance: float) -> bool:
    """Whether ``batch``'s time (``best``: per batch, the smallest measured) is out of shape:
    more per sample than a smaller batch, or more than a larger batch's time, by over
    ``tolerance``. A device's time per sample does not rise with the batch, nor its time fall,
    and interference only ever adds time, so such a point is the one that was disturbed."""
    t = best[batch]
    return any(b < batch and t / batch > best[b] / b * (1 + tolerance) or
               b > batch and t > best[b] * (1 + tolerance) for b in best)


def unconfirmed(measured: dict[int, list[float]], batches: list[int], tolerance: float,
                rule: Confirmation) -> list[int]:
    """The batches among ``batches`` to measure again under ``rule`` (``measured``: per batch,
    its compute seconds so far)."""
    best = {b: min(ts) for b, ts in measured.items() if ts}
    out = []
    for b in batches:
        times = measured.get(b, [])
        if settled(times, tolerance):
            continue
        if rule is Confirmation.REPEAT or not times or breaks_curve(b, best, tolerance):
            out.append(b)
    return out


class StepTime(NamedTuple):
    """One measured micro-step window."""

    compute_s: float  # wall time less the seconds in collectives: ``TimeConsumedDuringStep``
    comm_s: float  # seconds the comm ledger recorded inside collectives during the window


class RoundFacts(NamedTuple):
    """What one lock-step round cost one rank: its iteration's wall time split into the four
    parts ``exposure.exposed_costs`` models, and which pass the round belongs to. A NamedTuple,
    so it pickles through ``all_gather_object``."""

    compute_s: float  # the micro-step's compute (``StepTime.compute_s``)
    micro_step_comm_s: float  # seconds in collectives inside the micro-step window
    end_comm_s: float  # seconds in the iteration's closing collectives (its "step" phase)
    overhead_s: float  # the rest of the iteration's wall time, outside the micro-step
    pass_index: int  # 0: the first pass over the ranks' batches (in steady rounds: the round's index)


@dataclass(frozen=True)
class RoundOptions:
    """How ``run_rounds`` schedules and confirms its measurements. The defaults are those of
    ``ProfileOptions``, chosen on the CPU emulator (a shared 2-core machine), not on GPUs."""

    repeats: int = 3  # passes over every rank's batches
    max_extra_passes: int = 3  # more passes, at most, over the batches not yet confirmed
    tolerance: float = 0.02  # two measurements within this fraction confirm a minimum (``settled``)
    warmup: bool = True  # an unmeasured first round at each rank's largest batch
    confirm: Confirmation = Confirmation.REPEAT  # when a measurement is trusted


class TimedRounds(NamedTuple):
    """What ``run_rounds`` measured on this rank."""

    measured: dict[int, list[StepTime]]  # per batch size this rank ran, its windows (warm-up dropped)
    rounds: int  # rounds run, warm-up included
    facts: list[RoundFacts]  # per measured round, this rank's facts


class MicroStepTimer(StepObserver):
    """Measures each micro-step window of a runtime, from ``micro_step_start`` to
    ``micro_step_end`` (after an attached device's own end of the step), less the seconds spent
    blocked in collectives. Attach it after any device."""

    def __init__(self, runtime: ZeroRuntime, device: Device) -> None:
        self.runtime, self.device = runtime, device
        self.records: list[StepTime] = []  # per micro-step
        self._t0 = 0.0
        self._c0 = 0.0

    def micro_step_start(self, step: MicroStep) -> None:
        self.device.synchronize()
        self._c0 = self.runtime.comm_ledger.total_seconds
        self._t0 = time.perf_counter()

    def micro_step_end(self, step: MicroStep) -> None:
        self.device.synchronize()
        comm = self.runtime.comm_ledger.total_seconds - self._c0
        self.records.append(StepTime(time.perf_counter() - self._t0 - comm, comm))

    def __enter__(self) -> "MicroStepTimer":
        """Observe the runtime's micro-steps until the block ends."""
        self._handle = self.runtime.add_observer(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


def run_rounds(runtime: ZeroRuntime, device: Device, per_rank: list[list[int]], batches: dict[int, Any],
               loss_fn: Callable, comm: Communicator, options: RoundOptions = RoundOptions(), *,
               log: Callable[[str], None] = lambda m: None, progress: bool = False) -> TimedRounds:
    """Run the lock-step rounds (``per_rank``: each rank's batch sizes; ``batches``: this rank's
    batch of each size); return what this rank measured (``TimedRounds``).

    After ``options.repeats`` passes, batches whose smallest compute time is not yet confirmed
    (``options.confirm``: by a second measurement within ``options.tolerance``, or, with
    ``CURVE``, by a minimum that keeps the curve's shape; interference on a shared machine) are
    measured again, in up to ``options.max_extra_passes`` more passes. Which batches each rank
    re-measures is agreed with one ``all_gather_object`` between rounds, outside any training step.
    ``progress`` draws a progress bar of the rounds (on a terminal). ``options.warmup=False``
    leaves out the unmeasured first round (the process already ran this computation); a first
    round slowed by it is then a measurement the confirmation rule discards or measures again."""
    rank = runtime.rank
    repeats, warmup = options.repeats, options.warmup
    out: dict[int, list[StepTime]] = {}
    facts: list[RoundFacts] = []
    count = 0
    with MicroStepTimer(runtime, device) as timer:

        def run(rounds: list[list[int]], skip_first: bool, first_pass: int) -> None:
            nonlocal count
            for r, row in enumerate(rounds):
                runtime.set_plan(round_plan(row, runtime.shard_weights, runtime.plan.offloads), PlanCheck.LOCAL)
                n = len(timer.records)
                runtime.train_step(batches[row[rank]], loss_fn)
                count += 1
                bar.update(1)
                if not (skip_first and r == 0) and len(timer.records) == n + 1:
                    window = timer.records[-1]
                    out.setdefault(row[rank], []).append(window)
                    stats = runtime.last_stats
                    end_comm = runtime.comm_ledger.seconds(iteration=stats.iteration, phase="step")
                    facts.append(RoundFacts(window.compute_s, window.comm_s, end_comm,
                                            stats.wall_s - window.compute_s - window.comm_s - end_comm,
                                            first_pass + (r - int(skip_first)) // length))

        length = max(len(s) for s in per_rank)
        rounds = round_schedule(per_rank, repeats, warmup)
        log(f"timing: {len(rounds)} lock-step rounds")
        bar = progress_bar(len(rounds), "profiling: timing rounds", progress)
        run(rounds, skip_first=warmup, first_pass=0)
        for extra in range(options.max_extra_passes):
            mine = unconfirmed({b: [m.compute_s for m in ms] for b, ms in out.items()}, per_rank[rank],
                               options.tolerance, options.confirm)
            everyone = comm.all_gather_object(mine, tag="profile:unsettled")
            if not any(everyone):
                break
            again = [u or per_rank[i] for i, u in enumerate(everyone)]
            log(f"timing: re-measuring {sum(map(len, everyone))} unconfirmed points (pass {extra + 1})")
            extra_rounds = round_schedule(again, 1, warmup=False)
            bar.total += len(extra_rounds)
            run(extra_rounds, skip_first=False, first_pass=repeats + extra)
        bar.close()
    return TimedRounds(out, count, facts)


def summarize(measured: dict[int, list[StepTime]]) -> list[ProfilePoint]:
    """One point per batch: the *smallest* compute time of its measurements (and the median comm).

    Interference only ever adds time to a compute section (another process on the core, a late
    wake-up, a cache flush), never removes it, so the minimum is the estimate least disturbed by
    it (the reasoning of Python's ``timeit``), where a median still moves with one bad repeat of
    three. Collective seconds include waiting on other ranks, so for them the median is reported."""
    return [ProfilePoint(b, float(min(m.compute_s for m in ms)), float(statistics.median(m.comm_s for m in ms)))
            for b, ms in sorted(measured.items())]


# ---------------------------------------------------------------------- collective bandwidth
def measure_comm(comm: Communicator, sizes: tuple[int, ...] = DEFAULT_COMM_SIZES, reps: int = 3,
                 topology: Topology | None = None) -> CommProfile:
    """The job's fitted links (``poplar.profiler.links.measure_links``: the ring over every rank,
    and on a topology that spans nodes each node's link and the cross-node one) as a
    ``CommProfile``. Every rank runs the same calls in the same order."""
    return CommProfile(measure_links(comm, topology, sizes, reps))
