"""Lock-step timing rounds: every rank runs one micro-step of its own batch per round, on the real
runtime with its instrumented collectives, at sizes the capacity search found to fit
(docs/design.md §4.3). Each rank's compute per batch comes from the rounds of the timing grid;
steady rounds (configurations of ``exposure.exposure_batches`` repeated in a row) measure the
communication a step leaves exposed. The ``TIMING`` phase is entered around all of them, so an
observer records memory overflows instead of raising inside a collective; every rank learns of
any after the rounds.

``time_rounds`` takes the profiling run (``rank_phases.RankPhases``) as a ``TimedRun``: the
attributes it reads, and nothing more.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from poplar.comm import Communicator, DistributedError
from poplar.profiler.devices import Device, to_device
from poplar.profiler.escalation import StageCapacity
from poplar.profiler.exposure import (STEADY_ROUNDS, ExposureRounds, SteadyConfig, continued, exposed_costs,
                                      exposure_batches, more_steady_rounds)
from poplar.profiler.local_comm import round_plan
from poplar.profiler.phases import ProfileObserver, ProfilePhase, in_phase
from poplar.profiler.timing import Confirmation, RoundOptions, run_rounds, summarize, timing_batches
from poplar.types.profiles import Exposure, ProfileError, ProfilePoint
from poplar.zero.runtime import ZeroRuntime


class TimedRun(Protocol):
    """What the timing rounds read of a profiling run."""

    job: Any  # a ``ProfileJob``: its model_fn, loss_fn, sample_fn, optimizer_fn and options
    device: Device
    comm: Communicator
    observers: list[ProfileObserver]
    process_group: Any

    def lead(self, message: str) -> None:
        ...


def runtime_collectives(runtime: ZeroRuntime) -> tuple[list[list], list[list]]:
    """The collectives of the runtime's last iteration (a timing round: one micro-step per rank),
    as ``[op, bytes]``: those inside its micro-step, and those at the iteration's end."""
    last = runtime.iteration - 1
    records = [r for r in runtime.comm_ledger.records if r.iteration == last and r.op != "all_gather_object"]
    micro = [[r.op, r.bytes] for r in records if r.phase in ("forward", "backward") and r.micro_step == 0]
    end = [[r.op, r.bytes] for r in records if r.phase == "step"]
    return micro, end


@contextlib.contextmanager
def young_garbage_only() -> Iterator[None]:
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
class LockStepTiming:
    """What the timing rounds measured on this rank, and what they say about the collectives."""

    points: list[ProfilePoint]
    rounds: int
    exposure: Exposure  # exposed communication and overhead (``exposure.exposed_costs``)
    comm_seconds: float  # seconds in collectives over all rounds
    collectives: tuple[list[list], list[list]]  # ``runtime_collectives`` of the last round
    confirm: Confirmation = Confirmation.REPEAT  # when a measurement was trusted
    overflowing_rounds: int = 0  # rounds skipped for an fp16 overflow (their times count all the same)


def time_rounds(run: TimedRun, fit: StageCapacity, per_rank: list[list[int]] | None = None, warmup: bool = True,
                confirm: Confirmation = Confirmation.REPEAT,
                exposure: ExposureRounds = ExposureRounds.STEADY) -> LockStepTiming:
    """Lock-step timing rounds at every rank's timing batches (``per_rank``: these instead),
    with the real runtime and its collectives; a memory overflow in any round fails the run on
    every rank. ``warmup``: an unmeasured first round; ``confirm``: when a measurement is
    trusted (``run_rounds``); ``exposure``: which rounds measure the exposed communication.
    The garbage collections in it, the device's ``release`` at the end among them, skip what
    existed before it."""
    with young_garbage_only():
        return _timing_rounds(run, fit, per_rank, warmup, confirm, exposure)


def _timing_rounds(run: TimedRun, fit: StageCapacity, per_rank: list[list[int]] | None,
                   warmup: bool, confirm: Confirmation, exposure: ExposureRounds) -> LockStepTiming:
    comm, device, options = run.comm, run.device, run.job.options
    per_rank = per_rank or [timing_batches(m) for m in fit.mbs]
    error, batches = None, {}
    try:
        batches = {b: to_device(run.job.sample_fn(b), device.torch_device) for b in sorted(set(per_rank[comm.rank]))}
        model = run.job.model_fn().to(device.torch_device)
        optimizer = run.job.optimizer_fn(model)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        error = f"timing set-up failed: {type(e).__name__}: {e}"
    comm.agree(error, "profile timing set-up", error_type=ProfileError)
    runtime = ZeroRuntime(model, optimizer, zero_stage=options.zero_config(fit.stage, run.process_group),
                          plan=round_plan([max(b) for b in per_rank], options.shard_weights, fit.offloads),
                          mixed_precision=options.mixed_precision,
                          activation_checkpointing=options.activation_checkpointing)
    try:
        with in_phase(run.observers, ProfilePhase.TIMING, comm) as record, device.attach(runtime):
            measured, rounds, facts = run_rounds(
                runtime, device, per_rank, batches, run.job.loss_fn, comm,
                RoundOptions(options.repeats, options.max_extra_passes, options.tolerance, warmup, confirm),
                log=run.lead, progress=options.progress and comm.rank == 0)
    except DistributedError as e:  # the runtime reported a failed round on every rank
        raise ProfileError(f"a lock-step timing round failed: {e}") from None
    _agree_it_fitted(comm, record.overflows, "timing")
    steady: dict[SteadyConfig, list[list[tuple]]] = {}
    if exposure is ExposureRounds.STEADY and comm.world_size > 1:
        steady = _steady_rounds(run, fit, runtime, measured, batches)
        rounds += sum(len(facts[comm.rank]) for facts in steady.values())
    costs = exposed_costs(comm.all_gather_object(facts, tag="profile:costs"), steady)
    timing = LockStepTiming(summarize(measured), rounds, costs, runtime.comm_ledger.seconds(),
                            runtime_collectives(runtime), confirm, runtime.skipped_steps)
    del runtime, model, optimizer, batches
    device.release()
    return timing


def _steady_rounds(run: TimedRun, fit: StageCapacity, runtime: ZeroRuntime,
                   measured: dict[int, list[tuple[float, float]]], batches: dict[int, Any]
                   ) -> dict[SteadyConfig, list[list[tuple]]]:
    """Per configuration of ``exposure_batches``, rounds of one shape in a row (``STEADY_ROUNDS``,
    then more while ``more_steady_rounds`` asks): every rank's facts of them."""
    comm, device = run.comm, run.device
    best = {b: min(c for c, _ in ms) for b, ms in measured.items()}
    everyone = comm.all_gather_object((best, device.device_type), tag="profile:steady")
    configs = exposure_batches([b for b, _ in everyone], fit.mbs, [t for _, t in everyone])
    error = None
    try:
        for per_rank in configs.values():
            if per_rank[comm.rank] not in batches:
                batches[per_rank[comm.rank]] = to_device(run.job.sample_fn(per_rank[comm.rank]), device.torch_device)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        error = f"steady timing set-up failed: {type(e).__name__}: {e}"
    comm.agree(error, "profile steady timing set-up", error_type=ProfileError)
    out = {}
    try:
        with in_phase(run.observers, ProfilePhase.TIMING, comm) as record, device.attach(runtime):
            for config, per_rank in configs.items():
                so_far, more = [[] for _ in range(comm.world_size)], STEADY_ROUNDS  # every rank's facts
                while more:
                    facts = run_rounds(runtime, device, [[b] for b in per_rank], batches, run.job.loss_fn, comm,
                                       RoundOptions(repeats=more, max_extra_passes=0, warmup=False)).facts
                    tag = f"profile:steady:{config.kind.value}:{config.leader}:{len(so_far[0])}"
                    so_far = [continued(a, b) for a, b in zip(so_far, comm.all_gather_object(facts, tag=tag))]
                    more = more_steady_rounds(so_far, run.job.options.exposure_precision)
                out[config] = so_far
    except DistributedError as e:
        raise ProfileError(f"a steady timing round failed: {e}") from None
    _agree_it_fitted(comm, record.overflows, "steady timing")
    return out


def _agree_it_fitted(comm: Communicator, overflows: list[str], rounds: str) -> None:
    """Every rank learns whether any rank's ``rounds`` rounds exceeded its device memory."""
    error = None
    if overflows:
        error = (f"a {rounds} round exceeded the device memory although the capacity search found that it fits: "
                 + overflows[0])
    comm.agree(error, f"profile {rounds} memory", error_type=ProfileError)


