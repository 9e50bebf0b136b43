"""One rank's part of a profiling run: its set-up and its phases (``RankPhases``), and the
collective-free capacity search and trial steps they rest on (``search_capacity``,
``trial_fits``).

``RankPhases`` holds what the phases share: what the run trains (a ``ProfileJob``), this rank's
device, its communicator, its logs and the clock of its phases. Set-up (at construction): the
profiling observers among the devices prepare for the job (``phases``), then the model's size,
what offloading the optimizer would cost this rank (``offload_cost``), and that every rank's
device computes in the options' precision (``mixed_precision``: bf16 on a V100 / T4 is one
clear error everywhere), agreed on by every rank. Its phases: this rank's capacity search (no
collective; a ``ZeroRuntime`` over a LocalCommunicator has the real runtime's memory at world
size N), and the timing (``timed_profile``): lock-step timing rounds (``lock_step``), the
collectives' bandwidth (once a run) and the assembly of every rank's part into one ``Profile``,
the only road to a timed profile. Which phases run, in which order, is ``ProfileRun``'s
(``profile_run``).

Every runtime built here runs under the options' precision policy, so memory (the mbs) and speed
are those of training at that precision; the profile records it (``Profile.precision``).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from poplar.comm import Communicator
from poplar.profiler.assemble import assemble_profile
from poplar.profiler.capacity import CapacityResult, CapacitySearch, NoRoomToBuild, oom_message
from poplar.profiler.devices import Device
from poplar.profiler.escalation import Placements, StageCapacity, format_bytes
from poplar.profiler.exposure import ExposureRounds
from poplar.profiler.job import ProfileJob, ProfileOptions, model_size
from poplar.profiler.local_comm import local_engine
from poplar.profiler.lock_step import LockStepTiming, time_rounds, young_garbage_only
from poplar.profiler.links import probe_sizes
from poplar.profiler.offload_cost import measure_offload_cost
from poplar.profiler.phases import ProfileObserver, ProfilePhase, in_phase, observers_of
from poplar.profiler.precision import agree_precision_support, precision_meta
from poplar.profiler.progress import PhaseProgress
from poplar.profiler.timing import Confirmation, measure_comm
from poplar.types.plans import Offload
from poplar.types.profiles import CommProfile, OffloadCost, Profile, ProfileError, ProfilePoint
from poplar.zero.failures import is_oom
from poplar.zero.runtime import ZeroRuntime


class Timed(NamedTuple):
    """A timed configuration: the job at its configuration, shard weights and optimizer
    placements, what the capacity searches found there, and its profile (every rank)."""

    job: ProfileJob
    fit: StageCapacity
    profile: Profile


def _log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Trial:
    """One step of ``batch`` samples with these shard weights and optimizer placements (None:
    on the device), instead of a capacity search."""

    batch: int
    shard_weights: tuple[float, ...] | None = None
    offloads: tuple[Offload, ...] | None = None


def confirm_plan_memory(job: ProfileJob, device: Device, comm: Any, plan: Any) -> list[int]:
    """The ranks on which one step of their row's largest micro-batch, at ``plan``'s stage, shard
    weights and optimizer placements, does not fit (every rank together; [] when it fits everywhere): the trial that
    confirms the planner's memory model at the point it chose."""
    row = plan.ranks[comm.rank]
    batch = max(row.micro_batch_size if row.accum_steps else 0, row.last_batch_size)
    fits = trial_fits(job, device, comm, plan.zero_stage, Trial(batch, plan.shard_weights, plan.offloads))
    return [r for r, ok in enumerate(fits) if not ok]


def trial_fits(job: ProfileJob, device: Device, comm: Any, stage: int, trial: Trial,
               observers: list[ProfileObserver] | None = None) -> list[bool]:
    """Per rank, whether one local step of its ``trial`` (its own batch, at the trial's shard
    weights and optimizer placements) fits at ``stage``, every rank together."""
    result = search_capacity(job, device, world_size=comm.world_size, rank=comm.rank, stage=stage, trial=trial,
                             observers=observers)
    return comm.all_gather_object(result.mbs == trial.batch, tag="profile:trial")


def search_capacity(job: ProfileJob, device: Device, *, world_size: int, rank: int, stage: int,
                    guided: bool = False, reference: CapacityResult | None = None,
                    log: Callable[[str], None] | None = None, trial: Trial | None = None,
                    observers: list[ProfileObserver] | None = None) -> CapacityResult:
    """This rank's capacity search at ``stage``, without collectives (the ``CAPACITY`` phase:
    trial steps are not timed). ``guided``: the model-guided search (``CapacitySearch.run_guided``,
    from ``reference`` if given), else Algorithm 1. ``trial``: instead of a search, one step of
    its batch at its shard weights (``mbs`` = the batch if it fitted, else 0)."""
    options = job.options
    weights = trial.shard_weights if trial is not None else options.shard_weights
    offloads = trial.offloads if trial is not None else options.offloads
    attached = contextlib.ExitStack()
    current: list[ZeroRuntime] = []  # the runtime of the trials now, whose skipped steps are counted
    overflows = 0

    def build() -> ZeroRuntime:
        nonlocal overflows
        overflows += sum(r.skipped_steps for r in current)
        current.clear()
        attached.close()  # detach from the previous runtime, if any
        device.release()
        try:
            model = job.model_fn().to(device.torch_device)
            runtime = local_engine(model, job.optimizer_fn(model), world_size=world_size, rank=rank,
                                   zero_stage=options.zero_config(stage), device=device.torch_device,
                                   mixed_precision=options.mixed_precision,
                                   activation_checkpointing=options.activation_checkpointing, shard_weights=weights,
                                   offloads=offloads)
        except Exception as e:  # noqa: BLE001 - only an OOM is an answer; anything else is re-raised
            if not is_oom(e):
                raise
            raise NoRoomToBuild(oom_message(e)) from None
        attached.enter_context(device.attach(runtime))
        current.append(runtime)
        return runtime

    observers = observers_of(device) if observers is None else observers
    with in_phase(observers, ProfilePhase.CAPACITY, None), young_garbage_only():
        search: CapacitySearch | None = None
        try:
            search = CapacitySearch(build(), device, job.sample_fn, job.loss_fn, stage, options.max_batch,
                                    log or (lambda m: None), rebuild=build)
            if trial is not None:
                result = search.result
                result.mbs = trial.batch if trial.batch == 0 or search.steady_fits(trial.batch) else 0
            else:
                result = search.run_guided(reference) if guided else search.run()
            state_bytes = device.static_bytes()
            if state_bytes is not None:
                result.state_bytes = state_bytes
            result.overflowing_trials = overflows + sum(r.skipped_steps for r in current)
            return result
        except NoRoomToBuild as e:
            # [Note: no room to build] The model goes to the device whole and is then cut into
            # shards, so a card can run out before any step, or when the runtime is built again
            # after a failed trial (beside what the trials left for good: cuBLAS's workspaces):
            # then no batch fits at these weights, as when batch 1 does not, and other weights
            # may still fit
            result = search.result if search is not None else CapacityResult(stage, device.capacity_bytes, 0, 0)
            result.mbs, result.capped = 0, False
            result.reason = f"out of memory while the model was placed and sharded ({e})"
            return result
        finally:
            current.clear()
            # drop the runtime before collecting: held here, it would outlive the release below as
            # reference cycles that keep its GPU memory until some later collection
            search = None
            attached.close()
            device.release()


class RankPhases:
    """One rank's part of a profiling run (every rank of the process group builds it together,
    with the same job and its own device): set-up at construction, then its phases as methods,
    which ``ProfileRun``'s steps call."""

    def __init__(self, job: ProfileJob, device: Device, *, process_group: Any = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.job, self.device = job, device
        self.log = log or _log_to_stderr
        self.process_group = process_group
        self.comm = Communicator(process_group, device.torch_device)
        # a bar per phase on rank 0 (poplar.profiler.progress), heard as the device's observers are
        self.progress = PhaseProgress(job.options.progress and self.comm.rank == 0,
                                      lambda m: self.log(f"[poplar profile] {m}"))
        self.observers: list[ProfileObserver] = observers_of(device) + [self.progress]
        self.param_count = self.param_bytes = 0
        self.offload_cost: OffloadCost | None = None
        self.started = time.perf_counter()
        self.phase_seconds: dict[str, float] = {}
        self._comm: CommProfile | None = None  # the collectives' bandwidth, once measured
        self._set_up()

    def _set_up(self) -> None:
        """Observers prepare for the job; every rank agrees that ``model_fn`` works and that its
        device computes in the options' precision."""
        options, comm = self.options, self.comm
        if options.zero_stage not in (0, 1, 2, 3):
            raise ProfileError(f"zero_stage must be 0, 1, 2 or 3, got {options.zero_stage!r}")
        if options.offloads is not None and len(options.offloads) != comm.world_size:
            raise ProfileError(f"{len(options.offloads)} offload placements for {comm.world_size} ranks; give one per rank")
        if options.offloads is not None and Offload.OPTIMIZER in options.offloads and options.zero_stage == 0:
            raise ProfileError("ZeRO-0 replicates the optimizer state and has no shard to offload; profile at "
                               "ZeRO-1, 2 or 3, or without offloads")
        for observer in self.observers:
            observer.prepare_profiling(comm, self.job, None)
        error, model = None, None
        try:
            model = self.job.model_fn()
            self.param_count, self.param_bytes = model_size(model)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
            error = f"model_fn() failed: {type(e).__name__}: {e}"
        try:  # what offloading would cost this rank; an optimizer it cannot twin leaves it unknown
            self.offload_cost = None if model is None else measure_offload_cost(
                self.device, self.job.optimizer_fn(model), options.mixed_precision is not None)
        except Exception:  # noqa: BLE001 - the planner then offers no offload
            self.offload_cost = None
        comm.agree(error, "profile set-up", error_type=ProfileError)
        policy = agree_precision_support(comm, self.device, options.mixed_precision, "profile precision")
        self.lead(f"{comm.world_size} ranks, model {options.model_name or 'model'} with {self.param_count:,} "
                  f"parameters ({format_bytes(self.param_bytes)}), ZeRO-{options.zero_stage}, "
                  f"{precision_meta(policy)['precision']}")

    @property
    def options(self) -> ProfileOptions:
        return self.job.options

    # ---- logs and the clock ----
    def lead(self, message: str) -> None:
        """A line about the whole cluster (rank 0 says it)."""
        if self.comm.rank == 0:
            self.log(f"[poplar profile] {message}")

    def mine(self, message: str) -> None:
        """A line about this rank."""
        self.log(f"[poplar profile] rank {self.comm.rank} ({self.device.name}): {message}")

    def end_phase(self, name: str) -> None:
        """Close the phase that ran since the previous one ended: its seconds go under ``name``."""
        self.phase_seconds[name] = time.perf_counter() - self.started - sum(self.phase_seconds.values())

    # ---- the phases ----
    def search_capacity(self, stage: int, guided: bool = False,
                        reference: CapacityResult | None = None) -> CapacityResult:
        """This rank's capacity search at ``stage`` (no collectives); see ``search_capacity``."""
        return search_capacity(self.job, self.device, world_size=self.comm.world_size, rank=self.comm.rank,
                               stage=stage, guided=guided, reference=reference, observers=self.observers)

    def time(self, fit: StageCapacity, per_rank: list[list[int]] | None = None, warmup: bool = True,
             confirm: Confirmation = Confirmation.REPEAT,
             exposure: ExposureRounds = ExposureRounds.STEADY) -> LockStepTiming:
        """Lock-step timing rounds at every rank's timing batches (``per_rank``: these instead),
        with the real runtime and its collectives; a memory overflow in any round fails the run
        on every rank. ``warmup``: an unmeasured first round; ``confirm``: when a measurement is
        trusted (``run_rounds``); ``exposure``: which rounds measure the exposed communication.
        The garbage collections in it, the device's ``release`` at the end among them, skip what
        existed before it. The timing step (``timed_profile``) and timing past mbs
        (``shard_room``, whose points lie past the mbs a profile holds) call it."""
        return time_rounds(self, fit, per_rank, warmup, confirm, exposure)

    def timed_profile(self, fit: StageCapacity, per_rank: list[list[int]] | None = None, *, warmup: bool = True,
                      confirm: Confirmation = Confirmation.REPEAT, exposure: ExposureRounds = ExposureRounds.STEADY,
                      own_points: Callable[[list[ProfilePoint]], list[ProfilePoint]] | None = None,
                      clock: Callable[[str], None] | None = None) -> Profile:
        """The timing step, the one road from a capacity to a timed ``Profile``: lock-step timing
        rounds (``time``, with these arguments), the collectives' bandwidth, the assembly of
        every rank's part. ``own_points``: this rank's points as the profile keeps them (reused
        points merged in). The bandwidth is measured at the run's first timing, if the options
        ask for it, and shared by its later ones. ``clock(name)`` closes the phase that ran
        (default ``end_phase``): ``timing_s``, then ``comm_s``."""
        clock = clock or self.end_phase
        timing = self.time(fit, per_rank, warmup, confirm, exposure)
        if own_points is not None:
            timing.points = own_points(timing.points)
        clock("timing_s")
        comm_profile = self._comm_profile()
        clock("comm_s")
        return assemble_profile(self, fit, timing, comm_profile)

    def _comm_profile(self) -> CommProfile | None:
        """The collectives' bandwidth fit (the ``COMM`` phase; None where the options ask for
        none): measured once a run, a copy for each profile."""
        if not self.options.measure_comm:
            return None
        if self._comm is None:
            with in_phase(self.observers, ProfilePhase.COMM, self.comm):
                self._comm = measure_comm(self.comm, self.options.comm_sizes or probe_sizes(self.param_bytes),
                                          topology=self.options.topology)
        return copy.deepcopy(self._comm)

    def trial_fits(self, stage: int, batch: int, shard_weights: tuple[float, ...],
                   offloads: Placements) -> list[bool]:
        """Per rank, whether one local step of its ``batch`` fits at these shard weights and
        optimizer placements (every rank together, its own batch)."""
        return trial_fits(self.job, self.device, self.comm, stage, Trial(batch, shard_weights, offloads),
                          self.observers)
