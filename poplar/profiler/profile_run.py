"""The profiler's run, on every rank: capacity search, stage escalation, lock-step timing, and the
collectives' bandwidth; the result is one ``Profile``, the same on every rank.

Shape (docs/design.md §4, "deadlock trap"), one function per phase of ``profile_rank``:

1. Set-up (``_set_up``): the model's size, and that every rank's device computes in the
   options' precision (``mixed_precision``: bf16 on a V100 / T4 is one clear error everywhere),
   agreed on by every rank.
2. Capacity search and stage escalation (``escalation.find_fitting_stage``): per rank, with no
   collective at all (a ``ZeroRuntime`` over a LocalCommunicator has the real runtime's memory at
   world size N), then one agreement outside any training step, after which every rank takes
   the same decision: escalate to the next ZeRO stage, fail with the same error everywhere, or
   go on.
3. Timing in lock-step rounds at sizes known to fit (``_time_in_lock_step``), with the real
   runtime and its instrumented collectives. The device only records memory overflows here
   (``device.recording_overflows()``: never raising mid-collective); the record is agreed on
   afterwards.
4. Collective bandwidth (``timing.measure_comm``), then the profile is assembled from every
   rank's part (``_assemble_profile``).

Every runtime built here runs under the options' precision policy, so memory (the mbs) and speed
are those of training at that precision; the profile records it (``meta["precision"]``).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from poplar.comm import Communicator, DistributedError
from poplar.profiler.capacity import DEFAULT_MAX_BATCH, CapacityResult, CapacitySearch, trial_budget
from poplar.profiler.devices import Device, to_device
from poplar.profiler.escalation import StageCapacity, find_fitting_stage, format_bytes
from poplar.profiler.local_comm import local_engine, round_plan
from poplar.profiler.precision import agree_precision_support, precision_meta
from poplar.profiler.exposure import (EXPOSURE_PRECISION, STEADY_ROUNDS, ExposureRounds, SteadyConfig, continued,
                                     exposed_costs, exposure_batches, more_steady_rounds)
from poplar.profiler.timing import Confirmation, RoundOptions, measure_comm, run_rounds, summarize, timing_batches
from poplar.types.precision import MixedPrecision, resolve_precision
from poplar.types.profiles import CommProfile, Profile, ProfileError, ProfilePoint, RankProfile
from poplar.zero.runtime import ZeroRuntime


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """fp32 AdamW: 8 bytes of state per parameter, the K of docs/design.md §3."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


@dataclass
class ProfileOptions:
    zero_stage: int = 0
    escalate: bool = True  # move to the next ZeRO stage when batch 1 does not fit on some rank
    max_batch: int = DEFAULT_MAX_BATCH  # the search stops here even if more would fit
    repeats: int = 3  # measurements per timed batch size (the smallest is kept)
    max_extra_passes: int = 3  # re-measure points whose minimum no second measurement confirms
    tolerance: float = 0.02  # ... within this relative difference
    bucket_size_mb: float = 25.0
    wrap_policy: Any = None
    measure_comm: bool = True
    model_name: str = ""
    progress: bool = True  # a progress bar of the timing rounds on rank 0 (on a terminal)
    meta: dict[str, Any] = field(default_factory=dict)
    # the precision policy training will run (None: fp32); "bf16" / "fp16" are resolved to one
    mixed_precision: MixedPrecision | str | None = None
    # the runtime's activation_checkpointing (None / False off, True, or a module policy)
    activation_checkpointing: Any = None
    # steady rounds go on until the exposure is known to this fraction of a round (0: the least)
    exposure_precision: float = EXPOSURE_PRECISION

    def __post_init__(self) -> None:
        self.mixed_precision = resolve_precision(self.mixed_precision)
        if not self.exposure_precision >= 0:
            raise ValueError(f"exposure_precision must be >= 0 (a fraction of a round's time; 0: the fewest "
                             f"steady rounds), got {self.exposure_precision}")


def _log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def model_size(model: nn.Module) -> tuple[int, int]:
    """(parameter count, bytes of one copy of the parameters), tied weights once."""
    params = list(model.parameters())  # unique objects
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def runtime_collectives(runtime: ZeroRuntime) -> tuple[list[list], list[list]]:
    """The collectives of the runtime's last iteration (a timing round: one micro-step per rank),
    as ``[op, bytes]``: those inside its micro-step, and those at the iteration's end."""
    last = runtime.iteration - 1
    records = [r for r in runtime.comm_ledger.records if r.iteration == last and r.op != "all_gather_object"]
    micro = [[r.op, r.bytes] for r in records if r.phase in ("forward", "backward") and r.micro_step == 0]
    end = [[r.op, r.bytes] for r in records if r.phase == "step"]
    return micro, end


def search_capacity(model_fn: Callable[[], nn.Module], optimizer_fn: Callable, loss_fn: Callable,
                    sample_fn: Callable[[int], Any], device: Device, *, world_size: int, rank: int, stage: int,
                    options: ProfileOptions, log: Callable[[str], None], guided: bool = False,
                    reference: CapacityResult | None = None) -> CapacityResult:
    """This rank's capacity search at ``stage``, without collectives, at the hardware's own speed
    (the trial steps are not timed). ``guided``: the model-guided search (``CapacitySearch.run_guided``,
    from ``reference`` if given), else Algorithm 1."""
    attached = contextlib.ExitStack()

    def build() -> ZeroRuntime:
        attached.close()  # detach from the previous runtime, if any
        device.release()
        model = model_fn().to(device.torch_device)
        runtime = local_engine(model, optimizer_fn(model), world_size=world_size, rank=rank, zero_stage=stage,
                               device=device.torch_device, bucket_size_mb=options.bucket_size_mb,
                               wrap_policy=options.wrap_policy, mixed_precision=options.mixed_precision,
                               activation_checkpointing=options.activation_checkpointing)
        attached.enter_context(device.attach(runtime))
        return runtime

    with device.unpadded(), _young_garbage_only():
        search: CapacitySearch | None = None
        try:
            search = CapacitySearch(build(), device, sample_fn, loss_fn, stage, options.max_batch, log, rebuild=build)
            result = search.run_guided(reference) if guided else search.run()
            state_bytes = device.static_bytes()
            if state_bytes is not None:
                result.state_bytes = state_bytes
            return result
        finally:
            # drop the runtime before collecting: held here, it would outlive the release below as
            # reference cycles that keep its GPU memory until some later collection
            search = None
            attached.close()
            device.release()


@contextlib.contextmanager
def _young_garbage_only() -> Iterator[None]:
    """While the block runs, garbage collections (a device's ``release`` after each out-of-memory
    trial) skip every object that existed before it (``gc.freeze``): a failed trial's reference
    cycles are all new, and a full collection of the process's heap cost ~0.18 s per failed trial,
    far more than the trial itself on a small model."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass
class RankRun:
    """One rank's profiling run: its inputs, its logs and the clock of its phases."""

    model_fn: Callable[[], nn.Module]
    loss_fn: Callable
    sample_fn: Callable[[int], Any]
    optimizer_fn: Callable
    device: Device
    options: ProfileOptions
    comm: Communicator
    process_group: Any
    log: Callable[[str], None]
    param_count: int = 0
    param_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    late_steps_before: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def lead(self, message: str) -> None:
        """A line about the whole cluster (rank 0 says it)."""
        if self.comm.rank == 0:
            self.log(f"[poplar profile] {message}")

    def mine(self, message: str) -> None:
        """A line about this rank."""
        self.log(f"[poplar profile] rank {self.comm.rank} ({self.device.name}): {message}")

    def search_capacity(self, stage: int, guided: bool = False,
                        reference: CapacityResult | None = None) -> CapacityResult:
        """This rank's capacity search at ``stage`` (no collectives); see ``search_capacity``."""
        return search_capacity(self.model_fn, self.optimizer_fn, self.loss_fn, self.sample_fn, self.device,
                               world_size=self.comm.world_size, rank=self.comm.rank, stage=stage,
                               options=self.options, log=lambda m: None, guided=guided, reference=reference)

    def end_phase(self, name: str) -> None:
        """Close the phase that ran since the previous one ended: its seconds go under ``name``."""
        self.phase_seconds[name] = time.perf_counter() - self.started - sum(self.phase_seconds.values())


@dataclass
class LockStepTiming:
    """What the timing rounds measured on this rank, and what they say about the collectives."""

    points: list[ProfilePoint]
    rounds: int
    costs: dict[str, float]  # exposed communication and overhead (``exposure.exposed_costs``)
    comm_seconds: float  # seconds in collectives over all rounds
    collectives: tuple[list[list], list[list]]  # ``runtime_collectives`` of the last round
    confirm: Confirmation = Confirmation.REPEAT  # when a measurement was trusted


def profile_rank(model_fn: Callable[[], nn.Module], loss_fn: Callable, sample_fn: Callable[[int], Any],
                 device: Device, *, optimizer_fn: Callable | None = None, options: ProfileOptions | None = None,
                 log: Callable[[str], None] | None = None, process_group: Any = None) -> Profile:
    """Profile this rank; every rank of the process group must call it with the same arguments
    (but its own ``device``). Returns the whole cluster's profile, the same on every rank."""
    run = _set_up(model_fn, loss_fn, sample_fn, device, optimizer_fn or default_optimizer,
                  options or ProfileOptions(), log or _log_to_stderr, process_group)
    fit = find_fitting_stage(run.search_capacity, run.comm, device, stage=run.options.zero_stage,
                             escalate=run.options.escalate, model_size=(run.param_count, run.param_bytes),
                             lead=run.lead, mine=run.mine)
    run.end_phase("capacity_s")
    run.lead(f"ZeRO-{fit.stage}: mbs per rank {fit.mbs}")
    timing = _time_in_lock_step(run, fit)
    run.end_phase("timing_s")
    with device.pacing(run.comm):  # an emulated cluster's link carries the probes too
        comm_profile = measure_comm(run.comm) if run.options.measure_comm else None
    run.end_phase("comm_s")
    profile = _assemble_profile(run, fit, timing, comm_profile)
    run.lead(f"done in {profile.meta['seconds']:.1f} s")
    return profile


def _set_up(model_fn: Callable[[], nn.Module], loss_fn: Callable, sample_fn: Callable[[int], Any], device: Device,
            optimizer_fn: Callable, options: ProfileOptions, log: Callable[[str], None],
            process_group: Any) -> RankRun:
    """Check the options, then measure the model's size; every rank agrees that ``model_fn`` works."""
    comm = Communicator(process_group, device.torch_device)
    if options.zero_stage not in (0, 1, 2, 3):
        raise ProfileError(f"zero_stage must be 0, 1, 2 or 3, got {options.zero_stage!r}")
    run = RankRun(model_fn, loss_fn, sample_fn, optimizer_fn, device, options, comm, process_group, log)
    run.late_steps_before = device.late_steps
    error = None
    try:
        run.param_count, run.param_bytes = model_size(model_fn())
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        error = f"model_fn() failed: {type(e).__name__}: {e}"
    comm.agree(error, "profile set-up", error_type=ProfileError)
    policy = agree_precision_support(comm, device, options.mixed_precision, "profile precision")
    run.lead(f"{comm.world_size} ranks, model {options.model_name or 'model'} with {run.param_count:,} parameters "
             f"({format_bytes(run.param_bytes)}), ZeRO-{options.zero_stage}, {precision_meta(policy)['precision']}")
    return run


def _time_in_lock_step(run: RankRun, fit: StageCapacity, per_rank: list[list[int]] | None = None,
                       warmup: bool = True, confirm: Confirmation = Confirmation.REPEAT,
                       exposure: ExposureRounds = ExposureRounds.STEADY) -> LockStepTiming:
    """Lock-step timing rounds at every rank's timing batches (``per_rank``: these instead), with
    the real runtime and its collectives; a memory overflow in any round fails the run on every
    rank. ``warmup``: an unmeasured first round; ``confirm``: when a measurement is trusted
    (``run_rounds``); ``exposure``: which rounds measure the exposed communication. The garbage
    collections in it, the device's ``release`` at the end among them, skip what existed before it."""
    with _young_garbage_only():
        return _timing_rounds(run, fit, per_rank, warmup, confirm, exposure)


def _timing_rounds(run: RankRun, fit: StageCapacity, per_rank: list[list[int]] | None,
                   warmup: bool, confirm: Confirmation, exposure: ExposureRounds) -> LockStepTiming:
    comm, device, options = run.comm, run.device, run.options
    per_rank = per_rank or [timing_batches(m) for m in fit.mbs]
    error, batches = None, {}
    try:
        batches = {b: to_device(run.sample_fn(b), device.torch_device) for b in sorted(set(per_rank[comm.rank]))}
        model = run.model_fn().to(device.torch_device)
        optimizer = run.optimizer_fn(model)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        error = f"timing set-up failed: {type(e).__name__}: {e}"
    comm.agree(error, "profile timing set-up", error_type=ProfileError)
    runtime = ZeroRuntime(model, optimizer, zero_stage=fit.stage, plan=round_plan([max(b) for b in per_rank]),
                          process_group=run.process_group, bucket_size_mb=options.bucket_size_mb,
                          wrap_policy=options.wrap_policy, mixed_precision=options.mixed_precision,
                          activation_checkpointing=options.activation_checkpointing)
    try:
        with device.recording_overflows() as overflows, device.attach(runtime):
            measured, rounds, facts = run_rounds(
                runtime, device, per_rank, batches, run.loss_fn, comm,
                RoundOptions(options.repeats, options.max_extra_passes, options.tolerance, warmup, confirm),
                log=run.lead, progress=options.progress and comm.rank == 0)
    except DistributedError as e:  # the runtime reported a failed round on every rank
        raise ProfileError(f"a lock-step timing round failed: {e}") from None
    _agree_it_fitted(comm, overflows, "timing")
    steady: dict[SteadyConfig, list[list[tuple]]] = {}
    if exposure is ExposureRounds.STEADY and comm.world_size > 1:
        steady = _steady_rounds(run, fit, runtime, measured, batches)
        rounds += sum(len(facts[comm.rank]) for facts in steady.values())
    costs = exposed_costs(comm.all_gather_object(facts, tag="profile:costs"), steady)
    timing = LockStepTiming(summarize(measured), rounds, costs, runtime.comm_ledger.seconds(),
                            runtime_collectives(runtime), confirm)
    del runtime, model, optimizer, batches
    device.release()
    return timing


def _steady_rounds(run: RankRun, fit: StageCapacity, runtime: ZeroRuntime,
                   measured: dict[int, list[tuple[float, float]]], batches: dict[int, Any]
                   ) -> dict[SteadyConfig, list[list[tuple]]]:
    """Per configuration of ``exposure_batches``, rounds of one shape in a row (``STEADY_ROUNDS``,
    then more while ``more_steady_rounds`` asks): every rank's facts of them."""
    comm, device = run.comm, run.device
    best = {b: min(c for c, _ in ms) for b, ms in measured.items()}
    everyone = comm.all_gather_object((best, device.device_type), tag="profile:steady")
    configs = exposure_batches([b for b, _ in everyone], fit.mbs, [t for _, t in everyone], fit.stage)
    error = None
    try:
        for per_rank in configs.values():
            if per_rank[comm.rank] not in batches:
                batches[per_rank[comm.rank]] = to_device(run.sample_fn(per_rank[comm.rank]), device.torch_device)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        error = f"steady timing set-up failed: {type(e).__name__}: {e}"
    comm.agree(error, "profile steady timing set-up", error_type=ProfileError)
    out = {}
    try:
        with device.recording_overflows() as overflows, device.attach(runtime):
            for config, per_rank in configs.items():
                so_far, more = [[] for _ in range(comm.world_size)], STEADY_ROUNDS  # every rank's facts
                while more:
                    facts = run_rounds(runtime, device, [[b] for b in per_rank], batches, run.loss_fn, comm,
                                       RoundOptions(repeats=more, max_extra_passes=0, warmup=False)).facts
                    tag = f"profile:steady:{config.kind.value}:{config.leader}:{len(so_far[0])}"
                    so_far = [continued(a, b) for a, b in zip(so_far, comm.all_gather_object(facts, tag=tag))]
                    more = more_steady_rounds(so_far, run.options.exposure_precision)
                out[config] = so_far
    except DistributedError as e:
        raise ProfileError(f"a steady timing round failed: {e}") from None
    _agree_it_fitted(comm, overflows, "steady timing")
    return out


def _agree_it_fitted(comm: Communicator, overflows: list[dict], rounds: str) -> None:
    """Every rank learns whether any rank's ``rounds`` rounds exceeded its device memory."""
    error = None
    if overflows:
        error = (f"a {rounds} round exceeded the device memory although the capacity search found that it fits: "
                 + overflows[0]["message"])
    comm.agree(error, f"profile {rounds} memory", error_type=ProfileError)


def _assemble_profile(run: RankRun, fit: StageCapacity, timing: LockStepTiming,
                      comm_profile: CommProfile | None) -> Profile:
    """Every rank's part, gathered: the same ``Profile`` on every rank."""
    comm, device, options, result = run.comm, run.device, run.options, fit.result
    part = RankProfile(rank=comm.rank, device_type=device.device_type, mbs=result.mbs, points=timing.points,
                       device_name=device.name, capacity_bytes=int(device.capacity_bytes),
                       base_bytes=result.base_bytes, bytes_per_sample=result.bytes_per_sample,
                       nominal_tflops=device.nominal_tflops, trial_steps=result.trial_steps)
    notes = {"estimate": result.estimate, "trials": result.trials, "trial_budget": trial_budget(result.mbs),
             "trial_steps_per_stage": fit.trials_per_stage,
             "state_bytes": result.state_bytes, "capped": result.capped,
             "oom_events": [vars(e) for e in result.oom_events], "device": device.describe(),
             "late_steps": device.late_steps - run.late_steps_before, "timing_comm_s": timing.comm_seconds,
             "phase_seconds": {k: round(v, 3) for k, v in run.phase_seconds.items()}}
    parts = comm.all_gather_object((part, notes), tag="profile:assemble")
    if comm_profile is None:
        comm_profile = CommProfile(bandwidth_bytes_per_s=1e15, backend=comm.backend)
    comm_profile.collectives_stage = fit.stage
    comm_profile.micro_step, comm_profile.iteration = timing.collectives
    for key, value in timing.costs.items():
        setattr(comm_profile, key, value)
    meta = dict(options.meta)
    meta.update(precision_meta(options.mixed_precision))
    meta.update({"requested_stage": options.zero_stage,
                 "activation_checkpointing": options.activation_checkpointing not in (None, False), "escalations": fit.escalations,
                 "timing_rounds": timing.rounds, "repeats": options.repeats,
                 "timing_estimator": "min over repeats, confirmed by a 2nd measurement within "
                                     f"{options.tolerance:.0%} (up to {options.max_extra_passes} extra passes)"
                                     + (", or by a single one that keeps the curve's shape"
                                        if timing.confirm is Confirmation.CURVE else ""),
                 "comm_fit": "seconds = latency_s + bus volume / bandwidth (ring: 2(N-1)/N V all-reduce, "
                             "(N-1)/N V reduce-scatter/all-gather)",
                 "ranks": {str(r): rank_notes for r, (_, rank_notes) in enumerate(parts)},
                 "seconds": round(time.perf_counter() - run.started, 3)})
    return Profile(zero_stage=fit.stage, world_size=comm.world_size, param_count=run.param_count,
                   param_bytes=run.param_bytes, ranks=[p for p, _ in parts], comm=comm_profile,
                   model_name=options.model_name, meta=meta)
