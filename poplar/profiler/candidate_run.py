"""``ProfileRun``'s target for several configurations (ZeRO stage x activation checkpointing):
capacity of every one, then the timings a ``CandidateChoice`` asks for, until it has chosen
(docs/design.md §7.1).

The profiler runs the steps; the choice (auto mode's ``ConfigurationSearch``, which prices
candidates with the planner) decides from agreed data only, so every rank makes the same calls:
which shard weights let a configuration fit when even shards do not, which candidate to time or
probe next, and which one wins.

Capacity: every candidate's search, collective-free, one agreement; where none fits batch 1 on
every rank, each is searched again at the weights the choice gives by room
(``weights_to_fit``), then, where the options allow it, with the short ranks' optimizers
offloaded (offload escalation, at the highest stage); where still none fits, the higher stages
are searched (even shards, by room) only to name the stage that would fit in the error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from poplar.profiler.configurations import CandidateProfiler, ConfigCapacity, Reuse, ShardMemory
from poplar.profiler.escalation import OffloadEscalation, Placements, escalate_offload
from poplar.profiler.exposure import ExposureRounds
from poplar.profiler.job import ProfileJob
from poplar.profiler.rank_phases import RankPhases, Timed
from poplar.profiler.timing import Confirmation, TimingGrid
from poplar.types.configuration import Configuration
from poplar.types.profiles import OffloadSearch, Profile, ProfileError


@dataclass(frozen=True)
class TimingRequest:
    """One timing a choice asks for: candidate ``index``'s timing on the sparse grid (reusing
    ``reuse``'s points, as ``how`` says), or its probe: one round at every rank's mbs."""

    index: int
    probe: bool = False
    reuse: Profile | None = None
    how: Reuse = Reuse.SAME_COMPUTE


@dataclass(frozen=True)
class ChoiceRecord:
    """What the profiling of the candidates cost, for the choice's record in the profile."""

    seconds: dict[str, float]  # capacity_s, timing_s, comm_s
    rounds: int  # lock-step timing rounds
    wall_s: float  # from the run's set-up to the choice
    offload_escalations: list[OffloadSearch]  # the searches again with short ranks' optimizers offloaded


class CandidateChoice(Protocol):
    """What decides among the candidates (auto mode's ``ConfigurationSearch``)."""

    def configurations(self, higher: bool = False) -> list[Configuration]:
        """The candidates (``higher``: the stages above them, searched only to name the fix)."""

    def weights_to_fit(self, memory: list[ShardMemory]) -> tuple[float, ...] | None:
        """Shard weights by room, where even shards do not fit batch 1 (None: none)."""

    def start(self, capacities: list[ConfigCapacity], device_types: list[str]) -> None:
        """The agreed capacities of the candidates, every rank's device type."""

    def none_fit(self, higher: list[ConfigCapacity], offload: OffloadEscalation) -> ProfileError:
        """The error when no candidate fits batch 1 on every rank (``higher``: what would)."""

    def next_timing(self) -> TimingRequest | None:
        """The next timing or probe (None: chosen)."""

    def record(self, request: TimingRequest, profile: Profile) -> None:
        """The profile ``request`` measured."""

    def chosen(self) -> tuple[int, Profile]:
        """The chosen candidate's index and timed profile."""

    def finish(self, profile: Profile, record: ChoiceRecord) -> Profile:
        """The chosen profile (after its timing past mbs) with the choice recorded."""


class Candidates:
    """The target: capacity of every candidate, the timings ``choice`` asks for, its choice."""

    def __init__(self, choice: CandidateChoice) -> None:
        self.choice = choice
        self.started = time.perf_counter()
        self.offloaded: list[OffloadSearch] = []  # the searches again with short ranks' optimizers offloaded
        self.prof: CandidateProfiler | None = None

    def job_for(self, job: ProfileJob) -> ProfileJob:
        return job

    def prepare(self, run: Any, job: ProfileJob) -> None:
        self.started = time.perf_counter()

    def capacity(self, phases: RankPhases) -> list[ConfigCapacity]:
        """Every candidate's capacity (and by room, and offloaded; module doc), agreed."""
        self.prof = CandidateProfiler(phases)
        types = phases.comm.all_gather_object(phases.device.device_type, tag="auto:types")
        escalation = phases.options.offload_escalation
        caps = self._fitting(phases, self.choice.configurations(), escalation)
        self.choice.start(caps, types)
        if not any(c.fits for c in caps):
            higher = self.choice.configurations(higher=True)
            found = self._fitting(phases, higher, OffloadEscalation.NEVER) if higher else []
            raise self.choice.none_fit(found, escalation)
        return caps

    def timing(self, phases: RankPhases, caps: list[ConfigCapacity]) -> Timed:
        """The timings the choice asks for, one at a time; the chosen candidate's."""
        assert self.prof is not None
        while (request := self.choice.next_timing()) is not None:
            cap = caps[request.index]
            # a probe: one measurement a point at every rank's mbs (a disturbed probe can only raise
            # a bound); else the sparse grid, a point measured again only where it breaks the
            # curve's shape
            probe = [[m] for m in cap.mbs] if request.probe else None
            profile = self.prof.time(cap, reuse=None if request.probe else request.reuse, how=request.how, sizes=probe,
                                     grid=TimingGrid.SPARSE, confirm=Confirmation.CURVE, exposure=ExposureRounds.GRID)
            self.choice.record(request, profile)
        index, profile = self.choice.chosen()
        return Timed(caps[index].placed(phases.job), caps[index].stage_capacity(), profile)

    def finish(self, phases: RankPhases, profile: Profile, past_mbs_s: float) -> Profile:
        assert self.prof is not None
        self.prof.seconds["timing_s"] += past_mbs_s
        return self.choice.finish(profile, ChoiceRecord(dict(self.prof.seconds), self.prof.rounds,
                                                        time.perf_counter() - self.started, self.offloaded))

    def _fitting(self, phases: RankPhases, configs: list[Configuration],
                 escalation: OffloadEscalation) -> list[ConfigCapacity]:
        """The capacities of ``configs``: at even shards, else by room, else offloaded."""
        assert self.prof is not None
        caps = self.prof.capacities(configs)
        if not any(c.fits for c in caps):
            caps = self._fit_by_shards(phases, caps)
        if not any(c.fits for c in caps) and escalation is OffloadEscalation.SHORT_RANKS:
            caps = self._escalate_offload(phases, caps)
        return caps

    def _fit_by_shards(self, phases: RankPhases, caps: list[ConfigCapacity]) -> list[ConfigCapacity]:
        """Each configuration that fits no rank set at even shards, searched again at the shard
        weights the choice gives by every rank's room (from the agreed searches: the same on
        every rank)."""
        assert self.prof is not None
        out = []
        for c in caps:
            weights = self.choice.weights_to_fit(c.memory) if c.config.stage >= 1 else None
            if weights is None:
                out.append(c)
                continue
            phases.log(f"ZeRO-{c.config.stage}, checkpointing {'on' if c.config.checkpointed else 'off'}: batch 1 "
                       f"does not fit every rank at even shards; searching again at shard weights {list(weights)} "
                       "(by memory)")
            out.append(self.prof.capacities([c.config], weights)[0])
        return out

    def _escalate_offload(self, phases: RankPhases, caps: list[ConfigCapacity]) -> list[ConfigCapacity]:
        """Offload escalation (``escalation.escalate_offload``) of the configurations at the
        highest stage (ZeRO-1 or above): searched again with the optimizer of the ranks batch 1
        does not fit offloaded to host memory, until they fit or those ranks already offload."""
        prof = self.prof
        assert prof is not None
        top = max(c.config.stage for c in caps)

        def announce(c: ConfigCapacity, short: list[int], more: Placements) -> None:
            phases.log(f"{c.config.name}: batch 1 does not fit ranks {short}; searching again with their "
                       "optimizer offloaded to host memory")
            self.offloaded.append(OffloadSearch(c.config.name, list(short), [o.value for o in more]))

        def escalated(c: ConfigCapacity) -> ConfigCapacity:
            if not c.config.stage == top >= 1:
                return c
            return escalate_offload(c, c.offloads, short=lambda f: [r for r, m in enumerate(f.mbs) if m < 1],
                                    search=lambda more: prof.capacities([c.config], c.shard_weights, more)[0],
                                    world_size=len(c.mbs), announce=announce)[0]

        return [escalated(c) for c in caps]
