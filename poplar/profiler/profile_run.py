"""The profiling run: the one owner of the sequence from a job to its ``Profile``
(docs/design.md §4).

``ProfileRun(job, device, ...).measure(target)`` is the entry point; every rank of the process
group calls it together, with the same job and its own device, and gets the same profile. Its
steps, in order, each called from one place:

1. Store reuse (``_look_up``, with a ``StoreRequest``): where the profile store holds every
   device type of the job, the profile is assembled from it and nothing is measured; where it
   holds some, the target becomes the new types (``store_reuse.NewTypes``), with everything as
   the fallback when a new type does not fit batch 1 at the stored configuration.
2. Set-up (``RankPhases``): the observers among the devices prepare for the job, the model's
   size and offload cost, the precision agreed on by every rank.
3. Capacity (``target.capacity``): per rank, with no collective, then one agreement; stage
   escalation and offload escalation for one configuration (``OneConfiguration``:
   ``escalation.find_fitting_stage``), shard weights by room and offload escalation for several
   (``candidate_run.Candidates``).
4. Timing (``target.timing``): lock-step rounds at sizes known to fit, the collectives'
   bandwidth and the assembly of every rank's part, in that order in one place
   (``RankPhases.timed_profile``, which every timing below goes through); for several
   configurations, the timings the choice asks for (auto mode's ``ConfigurationSearch``),
   until it has chosen.
5. Timing past mbs (``_past_mbs``, ``shard_room``): each rank timed past its mbs at shard
   weights that give it the room, where the options ask for it.
6. The target's record (``target.finish``), and the store's write-back (``_keep``).

The steps run their phases on a ``RankPhases`` (``rank_phases``): the set-up and the capacity
search, timing rounds, collectives and assembly of one rank (docs/design.md §4, "deadlock
trap": every collective step is taken by every rank, decided from agreed data only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torch import nn

from poplar.comm import Communicator
from poplar.profiler.devices import Device
from poplar.profiler.escalation import Placements, StageCapacity, find_fitting_stage
from poplar.profiler.job import ProfileJob, ProfileOptions, ProfilingPolicy, default_optimizer, model_size
from poplar.profiler.phases import ProfilePhase, observers_of
from poplar.profiler.rank_phases import RankPhases, Timed, Trial, confirm_plan_memory, search_capacity, trial_fits
from poplar.profiler.shard_room import time_past_mbs
from poplar.profiler.store_reuse import NewTypes, StoreLookup, StoreRequest, StoreUse, look_up
from poplar.profiler.capacity import CapacityResult
from poplar.types.profiles import Profile

__all__ = ["Measured", "OneConfiguration", "ProfileJob", "ProfileOptions", "ProfileRun", "ProfilingPolicy",
           "RankPhases", "StoreRequest", "Target", "Trial", "confirm_plan_memory", "default_optimizer", "model_size",
           "profile_rank", "search_capacity", "trial_fits"]


class Target(Protocol):
    """What a run measures: one configuration, several to choose among, or a store's new types."""

    def job_for(self, job: ProfileJob) -> ProfileJob:
        """The job the run is set up with."""

    def prepare(self, run: ProfileRun, job: ProfileJob) -> None:
        """Before the set-up, every rank together."""

    def capacity(self, phases: RankPhases) -> Any:
        """The capacity step (None: the target cannot be measured; the run falls back)."""

    def timing(self, phases: RankPhases, capacity: Any) -> Timed:
        """The timing step, with the collectives' bandwidth and the assembly."""

    def finish(self, phases: RankPhases, profile: Profile, past_mbs_s: float) -> Profile:
        """The target's record in the profile, after its timing past mbs."""


@dataclass(frozen=True)
class OneConfiguration:
    """The options' configuration, escalated to the next stage (or, at ZeRO-3 where the options
    allow it, to the short ranks' optimizers offloaded) while batch 1 does not fit some rank.
    ``announce``: a line the run logs before its set-up."""

    announce: str = ""

    def job_for(self, job: ProfileJob) -> ProfileJob:
        return job

    def prepare(self, run: ProfileRun, job: ProfileJob) -> None:
        if self.announce and run.log is not None:
            run.log(self.announce)

    def capacity(self, phases: RankPhases) -> StageCapacity:
        """Stage escalation and offload escalation (``escalation.find_fitting_stage``)."""
        options, base = phases.options, phases.job
        phases.progress.expect(ProfilePhase.COMM, int(options.measure_comm))
        phases.progress.expect(ProfilePhase.CAPACITY, 1)  # one stage; each escalation adds one

        def search(stage: int, offloads: Placements) -> CapacityResult:
            phases.job = base.placed(options.shard_weights, offloads)
            try:
                return phases.search_capacity(stage)
            finally:
                phases.job = base

        fit = find_fitting_stage(search, phases.comm, phases.device, stage=options.zero_stage,
                                 escalate=options.escalate, model_size=(phases.param_count, phases.param_bytes),
                                 lead=phases.lead, mine=phases.mine, offloads=options.offloads,
                                 offload_escalation=options.offload_escalation)
        phases.progress.close(ProfilePhase.CAPACITY)
        phases.end_phase("capacity_s")
        phases.lead(f"ZeRO-{fit.stage}: mbs per rank {fit.mbs}")
        return fit

    def timing(self, phases: RankPhases, fit: StageCapacity) -> Timed:
        """Every rank's timing batches, then the collectives' bandwidth (``RankPhases.timed_profile``)."""
        return Timed(phases.job, fit, phases.timed_profile(fit))

    def finish(self, phases: RankPhases, profile: Profile, past_mbs_s: float) -> Profile:
        phases.lead(f"done in {profile.measurement.seconds:.1f} s (in the ranks, from their set-up)")
        return profile


@dataclass(frozen=True)
class Measured:
    """A run's profile (this rank's copy) and how the store served it (None: no store)."""

    profile: Profile
    store_use: StoreUse | None = None


class ProfileRun:
    """One profiling run, every rank together (the module doc): ``measure(target)``."""

    def __init__(self, job: ProfileJob, device: Device, *, process_group: Any = None,
                 log: Callable[[str], None] | None = None, store: StoreRequest | None = None) -> None:
        self.job, self.device, self.process_group, self.store = job, device, process_group, store
        self.log = log
        self.comm = Communicator(process_group, device.torch_device)

    def measure(self, target: Target | None = None) -> Measured:
        """The profile of ``target`` (default: the options' configuration), from the store where
        it holds every device type, else measured (the new types first where it holds some)."""
        target = target or OneConfiguration()
        lookup = self._look_up()
        if lookup is not None and lookup.configuration is not None and not lookup.new_types:
            return Measured(self._reuse_all(lookup), StoreUse.REUSED)
        attempts: list[Target] = [target]
        if lookup is not None and lookup.configuration is not None and self.store is not None:
            attempts.insert(0, NewTypes(lookup, lookup.stored_configuration(self.store.checkpointing)))
        profile = None
        for attempt in attempts:  # the new types, where the store has some; else (or then) everything
            profile = self._measure(attempt)
            if profile is not None:
                break
        assert profile is not None
        use = None if self.store is None else StoreUse.PARTIAL if attempt is not target else StoreUse.MEASURED
        self._keep(profile)
        return Measured(profile, use)

    def _measure(self, target: Target) -> Profile | None:
        """Set-up, capacity, timing, timing past mbs and the target's record."""
        job = target.job_for(self.job)
        target.prepare(self, job)
        phases = RankPhases(job, self.device, process_group=self.process_group, log=self.log)
        capacity = target.capacity(phases)
        if capacity is None:
            return None
        timed = target.timing(phases, capacity)
        started = time.perf_counter()
        profile = self._past_mbs(phases, timed) if job.options.time_past_mbs else timed.profile
        return target.finish(phases, profile, time.perf_counter() - started)

    def _past_mbs(self, phases: RankPhases, timed: Timed) -> Profile:
        """``timed``'s profile with every rank timed past its mbs (``shard_room.time_past_mbs``)."""
        base = phases.job
        phases.job = timed.job
        try:
            return time_past_mbs(phases, timed.fit, timed.profile)
        finally:
            phases.job = base

    def _look_up(self) -> StoreLookup | None:
        """The store's entries for this job (None: no store), and what the run does with them."""
        if self.store is None:
            return None
        say = self.log or (lambda m: None)
        lookup = look_up(self.comm, self.store.store, self.store.key, self.device, self.store.refresh)
        for warning in lookup.warnings:
            say(warning)
        directory = self.store.store.directory
        if not lookup.entries:
            say(f"profile store {directory}: nothing to reuse ({lookup.why_measured(lookup.new_types)}); profiling")
        elif lookup.configuration is None:
            say("profile store: the stored device types were chosen at different configurations; profiling again")
        elif not lookup.new_types:
            stage, checkpointed = lookup.configuration
            say(f"profile store {directory}: reusing the profiles of {', '.join(sorted(lookup.entries))} "
                f"(ZeRO-{stage}{' +ckpt' if checkpointed else ''}); nothing to profile")
        else:
            say(f"profile store {directory}: reusing the profiles of {', '.join(sorted(lookup.entries))}; "
                f"profiling only {', '.join(lookup.new_types)} at "
                f"{lookup.stored_configuration(self.store.checkpointing).name} (the stored configuration): "
                f"{lookup.why_measured(lookup.new_types)}")
        return lookup

    def _reuse_all(self, lookup: StoreLookup) -> Profile:
        """The job's profile from the store alone; devices that observe profiling prepare for it."""
        profile = lookup.assembled()
        for observer in observers_of(self.device):
            observer.prepare_profiling(self.comm, self.job, profile)
        return profile

    def _keep(self, profile: Profile) -> None:
        """Rank 0 writes what was measured back to the store, one entry per device type."""
        if self.store is None or self.comm.rank != 0:
            return
        say = self.log or (lambda m: None)
        uneven = profile.shard_weights is not None and len(set(profile.shard_weights)) > 1
        if uneven or profile.offloads is not None:  # this mix's own mbs
            say("profile store: not kept: it was measured at uneven shard weights or with ranks offloaded, which "
                "hold for this mix of ranks only")
            return
        new = set(profile.store.profiled if profile.store is not None else profile.device_types())
        store = self.store.store
        kept = store.save(profile, self.store.key, profile.activation_checkpointing, only=new)
        for warning in store.take_warnings():  # a store that cannot be written is a cache miss, not a failure
            say(warning)
        if kept:
            say(f"profile store: kept {', '.join(sorted(p.stem for p in kept))} in {store.directory}")


def profile_rank(model_fn: Callable[[], nn.Module], loss_fn: Callable, sample_fn: Callable[[int], Any],
                 device: Device, *, optimizer_fn: Callable | None = None, options: ProfileOptions | None = None,
                 log: Callable[[str], None] | None = None, process_group: Any = None) -> Profile:
    """Profile this rank at the options' configuration; every rank of the process group must call
    it with the same arguments (but its own ``device``). Returns the whole cluster's profile, the
    same on every rank."""
    job = ProfileJob(model_fn, loss_fn, sample_fn, optimizer_fn or default_optimizer, options or ProfileOptions())
    return ProfileRun(job, device, process_group=process_group, log=log).measure().profile
