"""Profiling several configurations (ZeRO stage x activation checkpointing) in one run, for auto
mode's choice (docs/design.md §7.1).

``CandidateProfiler`` runs the phases of one ``RankPhases`` in the shape of a single
configuration's profile (docs/design.md §4.1): the capacity search of every configuration runs
on each rank without any collective, and one agreement then hands every rank every
configuration's mbs per rank; timing rounds (collective, lock-step) run only for the
configurations the caller asks for, one at a time, each ending in a ``Profile`` that is the same
on every rank. The collectives' bandwidth is measured once and shared (``RankPhases.timed_profile``). The caller
(``candidate_run.Candidates``, a step of ``ProfileRun``) must make the same calls on every rank,
deciding only from agreed data.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

from poplar.profiler.capacity import CapacityResult
from poplar.profiler.escalation import StageCapacity
from poplar.profiler.exposure import ExposureRounds
from poplar.profiler.phases import ProfilePhase
from poplar.profiler.job import ProfileJob
from poplar.profiler.rank_phases import RankPhases
from poplar.profiler.timing import Confirmation, TimingGrid, timing_batches
from poplar.types.configuration import Configuration
from poplar.types.plans import Offload
from poplar.types.profiles import Profile, ProfileError, ProfilePoint


class Reuse(Enum):
    """How a timed profile given to ``CandidateProfiler.time`` relates to the configuration timed."""

    SAME_COMPUTE = "same_compute"  # another configuration whose micro-steps compute the same
    SAME_CONFIG = "same_config"  # this configuration, timed at some batches (a probe)


@dataclass(frozen=True)
class ShardMemory:
    """What one rank's search says about its memory and its shard: its capacity, the bytes of
    its batch-1 step that do not move with the shard, and its shard's bytes (both None where
    batch 1 did not fit)."""

    capacity_bytes: int
    fixed_bytes: int | None
    shard_bytes: int | None

    @classmethod
    def of(cls, result: CapacityResult | None) -> "ShardMemory":
        if result is None:
            return cls(0, None, None)
        peak, shard = result.peaks.get(1), result.shard_bytes
        fixed = peak - shard if peak is not None and shard is not None and result.mbs >= 1 else None
        return cls(int(result.capacity_bytes), fixed, shard if fixed is not None else None)


POPLAR_DIR = Path(__file__).resolve().parents[1]  # the package's own files


def raised_at(error: BaseException, frames: int = 3) -> str:
    """Where in Poplar ``error`` was raised (file:line function, innermost first; any frame where
    none is Poplar's): the agreement that carries a rank's error to every rank carries its text,
    not its traceback."""
    stack = traceback.extract_tb(error.__traceback__)
    ours = [f for f in stack if Path(f.filename).resolve().is_relative_to(POPLAR_DIR)] or stack
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(ours[-frames:]))


@dataclass
class ConfigCapacity:
    """What the capacity searches found for one configuration, on every rank."""

    config: Configuration
    mbs: list[int]  # per rank; 0: batch 1 does not fit there
    reasons: list[str]  # per rank, why batch 1 does not fit ("" where it does)
    result: CapacityResult | None  # this rank's search
    memory: list[ShardMemory] = field(default_factory=list)  # per rank
    shard_weights: tuple[float, ...] | None = None  # the searches' shard weights (None: even)
    offloads: tuple[Offload, ...] | None = None  # the searches' optimizer placements (None: on every device)

    @property
    def fits(self) -> bool:
        return all(m >= 1 for m in self.mbs)

    def placed(self, job: ProfileJob) -> ProfileJob:
        """``job`` at this configuration, with its searches' shard weights and placements."""
        return job.at(self.config).placed(self.shard_weights, self.offloads)

    def stage_capacity(self) -> StageCapacity:
        """This configuration's capacity as the timing rounds take it (placements only where
        some rank offloads)."""
        assert self.result is not None
        offloading = self.offloads is not None and Offload.OPTIMIZER in self.offloads
        return StageCapacity(self.config.stage, self.result, list(self.mbs),
                             offloads=self.offloads if offloading else None)


def uncovered(grid: list[int], have: set[int], mbs: int) -> set[int]:
    """The batches of ``grid`` (sorted, up to ``mbs``) that no batch in ``have`` stands in for:
    one from a grid batch up to, not including, the grid's next (after the last: ``mbs``) does."""
    bounds = grid[1:] + [mbs + 1]
    return {b for b, nxt in zip(grid, bounds) if not any(b <= p < nxt for p in have)}


class CandidateProfiler:
    """Capacity of every configuration, then timing of chosen ones, on every rank together."""

    def __init__(self, phases: RankPhases) -> None:
        """Over ``phases``: a run set up already (``ProfileRun``'s, or a bench's own)."""
        self.run = phases
        self.seconds = {"capacity_s": 0.0, "timing_s": 0.0, "comm_s": 0.0}
        self.rounds = 0  # lock-step timing rounds run
        self.trial_steps = 0  # this rank's capacity trial steps

    def capacities(self, configs: list[Configuration], shard_weights: tuple[float, ...] | None = None,
                   offloads: tuple[Offload, ...] | None = None) -> list[ConfigCapacity]:
        """Every configuration's capacity search on this rank (no collective), then one agreement;
        at these shard weights (None: even) and optimizer placements (None: the options')."""
        offloads = offloads if offloads is not None else self.run.options.offloads
        places = [offloads if c.stage >= 1 else None for c in configs]  # ZeRO-0 has no shard to offload
        t0 = time.perf_counter()
        run, base = self.run, self.run.job
        run.progress.expect(ProfilePhase.CAPACITY, len(configs))
        mine: list[tuple[CapacityResult | None, str | None]] = []
        references: dict[bool, CapacityResult] = {}  # per checkpointing setting: its first search
        for c in configs:
            # the search's own stage is c.stage
            run.job = base.at(replace(c, stage=base.options.zero_stage)).placed(shard_weights, places[len(mine)])
            try:
                result = run.search_capacity(c.stage, guided=True, reference=references.get(c.checkpointed))
                if result.mbs >= 1:
                    references.setdefault(c.checkpointed, result)
                mine.append((result, None))
            except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
                mine.append((None, f"capacity search of ZeRO-{c.stage}, checkpointing "
                                   f"{'on' if c.checkpointed else 'off'} failed: {type(e).__name__}: {e} "
                                   f"(at {raised_at(e)})"))
        run.job = base
        self.trial_steps += sum(r.trial_steps for r, _ in mine if r is not None)
        error = next((e for _, e in mine if e), None)
        verdicts = run.comm.agree(error, "auto mode capacity",
                                  [(r.mbs, r.reason, ShardMemory.of(r)) if r else (0, "", ShardMemory.of(None))
                                   for r, _ in mine], error_type=ProfileError)
        self.seconds["capacity_s"] += time.perf_counter() - t0
        return [ConfigCapacity(c, [v[i][0] for v in verdicts], [v[i][1] for v in verdicts], mine[i][0],
                               [v[i][2] for v in verdicts], shard_weights, places[i]) for i, c in enumerate(configs)]

    def time(self, capacity: ConfigCapacity, reuse: Profile | None = None, how: Reuse = Reuse.SAME_COMPUTE,
             sizes: list[list[int]] | None = None, grid: TimingGrid = TimingGrid.DENSE,
             confirm: Confirmation = Confirmation.REPEAT, exposure: ExposureRounds = ExposureRounds.STEADY
             ) -> Profile:
        """Lock-step timing rounds of one fitting configuration: its ``Profile`` (every rank).

        ``reuse``: a timed profile whose points up to each rank's mbs are kept, so that only the
        batches it lacks are timed (``uncovered``). ``how`` says what it is: ``SAME_COMPUTE``, a
        configuration whose micro-steps compute the same (the same checkpointing at another of
        stages 0-2: they differ only in communication, which a micro-step's measured compute
        leaves out), and each rank's mbs is timed again, since the rounds also measure this
        stage's own communication and fixed overhead; ``SAME_CONFIG``, this configuration's own
        probe. ``sizes``: per rank,
        the batches to time (a probe; the profile then holds only those points), else ``grid``'s
        batches up to each rank's mbs; ``confirm``: when a measurement is trusted; ``exposure``:
        which rounds measure the exposed communication (``GRID`` for a probe). Only the
        profiler's first timing can have a warm-up round: the later ones run computations this
        process has already run (and so did its capacity searches)."""
        if not capacity.fits or capacity.result is None:
            raise ValueError("only a configuration that fits every rank can be timed")
        per_rank = sizes or [timing_batches(m, grid) for m in capacity.mbs]
        if reuse is not None:
            have = [{p.batch for p in r.points} for r in reuse.ranks]
            again = [{m} if how is Reuse.SAME_COMPUTE else set() for m in capacity.mbs]
            per_rank = [sorted(uncovered(bs, h, m) | a) for bs, h, a, m in zip(per_rank, have, again, capacity.mbs)]
            per_rank = [bs or [1] for bs in per_rank]  # a rank with every point still runs each round: its cheapest
        run, base, rank = self.run, self.run.job, self.run.comm.rank
        mbs = capacity.mbs[rank]

        def merged(points: list[ProfilePoint]) -> list[ProfilePoint]:  # this timing's points, then reuse's others
            assert reuse is not None
            mine = {p.batch for p in points}
            kept = [p for p in reuse.ranks[rank].points if p.batch not in mine and p.batch <= mbs]
            return sorted(points + kept, key=lambda p: p.batch)

        since = [time.perf_counter()]

        def clock(name: str) -> None:  # this profiler's seconds, over all its timings, are the profile's
            now = time.perf_counter()
            self.seconds[name] += now - since[0]
            since[0] = now
            run.phase_seconds = dict(self.seconds)

        run.job = capacity.placed(base)
        try:
            # with CURVE a first round still slow enough to matter breaks the curve's shape and
            # is measured again, so only a first REPEAT timing has a warm-up round
            warmup = self.rounds == 0 and confirm is Confirmation.REPEAT
            profile = run.timed_profile(capacity.stage_capacity(), per_rank, warmup=warmup, confirm=confirm,
                                        exposure=exposure, own_points=merged if reuse is not None else None,
                                        clock=clock)
            self.rounds += profile.measurement.timing_rounds
            return profile
        finally:
            run.job = base

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())
