"""The profile a profiling run ends with: every rank's part (its mbs, timed points, memory,
offload cost and notes) gathered into one ``Profile``, the same on every rank, with the run's
collectives, options and the placement the profile was measured at (``Profile.offloads``)."""

from __future__ import annotations

import time
from typing import Any

from poplar.profiler.capacity import trial_budget
from poplar.profiler.escalation import StageCapacity
from poplar.profiler.lock_step import LockStepTiming
from poplar.profiler.precision import precision_meta
from poplar.profiler.timing import Confirmation
from poplar.types.profiles import CommProfile, Profile, RankProfile


def assemble_profile(run: Any, fit: StageCapacity, timing: LockStepTiming,
                      comm_profile: CommProfile | None) -> Profile:
    """Every rank's part, gathered: the same ``Profile`` on every rank. ``run``: the profiling run
    (``profile_run.ProfileRun``: its comm, device, options, observers, model size, offload cost,
    start time and phase seconds)."""
    comm, device, options, result = run.comm, run.device, run.options, fit.result
    part = RankProfile(rank=comm.rank, device_type=device.device_type, mbs=result.mbs, points=timing.points,
                       device_name=device.name, capacity_bytes=int(device.capacity_bytes),
                       base_bytes=result.base_bytes, bytes_per_sample=result.bytes_per_sample,
                       shard_bytes=result.shard_bytes, nominal_tflops=device.nominal_tflops, trial_steps=result.trial_steps,
                       offload_cost=run.offload_cost)
    notes = {"estimate": result.estimate, "trials": result.trials, "trial_budget": trial_budget(result.mbs),
             "trial_steps_per_stage": fit.trials_per_stage,
             "state_bytes": result.state_bytes, "capped": result.capped,
             "oom_events": [vars(e) for e in result.oom_events], "device": device.describe(),
             "timing_comm_s": timing.comm_seconds,
             "overflowing_trials": result.overflowing_trials + timing.overflowing_rounds,
             "phase_seconds": {k: round(v, 3) for k, v in run.phase_seconds.items()}}
    parts = comm.all_gather_object((part, notes), tag="profile:assemble")
    if comm_profile is None:
        comm_profile = CommProfile(bandwidth_bytes_per_s=1e15, backend=comm.backend)
    comm_profile.collectives_stage = fit.stage
    comm_profile.micro_step, comm_profile.iteration = timing.collectives
    for key, value in timing.costs.items():
        setattr(comm_profile, key, value)
    meta = dict(options.meta)
    for observer in run.observers:
        meta.update(observer.profile_meta())
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
                 "overflowing_trials": sum(rank_notes["overflowing_trials"] for _, rank_notes in parts),
                 "seconds": round(time.perf_counter() - run.started, 3)})
    weights = options.shard_weights
    return Profile(zero_stage=fit.stage, world_size=comm.world_size, param_count=run.param_count,
                   param_bytes=run.param_bytes, ranks=[p for p, _ in parts], comm=comm_profile,
                   model_name=options.model_name, meta=meta,
                   shard_weights=None if weights is None else [float(w) for w in weights],
                   offloads=None if fit.offloads is None else [o.value for o in fit.offloads])
