"""The profile a profiling run ends with: every rank's part (its mbs, timed points, memory,
offload cost and notes) gathered into one ``Profile``, the same on every rank, with the run's
collectives, options and the placement the profile was measured at (``Profile.offloads``)."""

from __future__ import annotations

import importlib.metadata
import time
from dataclasses import replace
from typing import Any

import torch

from poplar.profiler.capacity import trial_budget
from poplar.profiler.escalation import StageCapacity
from poplar.profiler.lock_step import LockStepTiming
from poplar.profiler.precision import precision_meta
from poplar.types.profiles import (CapacityNotes, CommProfile, Emulated, Links, Measurement, OomRecord, Profile,
                                   Provenance, RankProfile)


def poplar_version() -> str:
    """The installed Poplar's version (informational: the profile's schema decides what is read)."""
    try:
        return importlib.metadata.version("poplar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def provenance(run: Any) -> Provenance:
    """Where the run's profile comes from: this torch and Poplar, and the emulator's scales where
    the devices are emulated (a device that observes profiling says so; the options may add how
    its scales were calibrated)."""
    emulated: Emulated | None = run.options.emulated
    for observer in run.observers:
        seen = observer.emulation()
        if seen is not None:
            emulated = seen if emulated is None else replace(seen, calibration=emulated.calibration)
    return Provenance(torch_version=torch.__version__, poplar_version=poplar_version(), emulated=emulated)


def assemble_profile(run: Any, fit: StageCapacity, timing: LockStepTiming,
                      comm_profile: CommProfile | None) -> Profile:
    """Every rank's part, gathered: the same ``Profile`` on every rank. ``run``: the profiling run
    (``profile_run.ProfileRun``: its comm, device, options, observers, model size, offload cost,
    start time and phase seconds)."""
    comm, device, options, result = run.comm, run.device, run.options, fit.result
    part = RankProfile(rank=comm.rank, device_type=device.device_type, mbs=result.mbs, points=timing.points,
                       device_name=device.name, device_identity=device.identity(),
                       capacity_bytes=int(device.capacity_bytes),
                       base_bytes=result.base_bytes, bytes_per_sample=result.bytes_per_sample,
                       shard_bytes=result.shard_bytes, nominal_tflops=device.nominal_tflops, trial_steps=result.trial_steps,
                       offload_cost=run.offload_cost)
    notes = CapacityNotes(estimate=result.estimate, trials=tuple(result.trials), trial_budget=trial_budget(result.mbs),
                          trial_steps_per_stage=dict(fit.trials_per_stage), state_bytes=result.state_bytes,
                          capped=result.capped, oom_events=tuple(OomRecord(**vars(e)) for e in result.oom_events),
                          device=device.describe(), timing_comm_s=timing.comm_seconds,
                          overflowing_trials=result.overflowing_trials + timing.overflowing_rounds,
                          phase_seconds={k: round(v, 3) for k, v in run.phase_seconds.items()})
    parts = comm.all_gather_object((part, notes), tag="profile:assemble")
    links = comm_profile.links if comm_profile is not None else Links(bandwidth_bytes_per_s=1e15, backend=comm.backend)
    micro_step, iteration = timing.collectives
    measured_comm = CommProfile(links, collectives_stage=fit.stage, micro_step=micro_step, iteration=iteration,
                                exposure=timing.exposure)
    measurement = Measurement(requested_stage=options.zero_stage, escalations=list(fit.escalations),
                              seconds=round(time.perf_counter() - run.started, 3), timing_rounds=timing.rounds,
                              repeats=options.repeats,
                              overflowing_trials=sum(rank_notes.overflowing_trials for _, rank_notes in parts),
                              ranks=[rank_notes for _, rank_notes in parts])
    precision = precision_meta(options.mixed_precision)
    weights = options.shard_weights
    return Profile(zero_stage=fit.stage, world_size=comm.world_size, param_count=run.param_count,
                   param_bytes=run.param_bytes, ranks=[p for p, _ in parts], comm=measured_comm,
                   model_name=options.model_name,
                   shard_weights=None if weights is None else [float(w) for w in weights],
                   offloads=None if fit.offloads is None else [o.value for o in fit.offloads],
                   precision=precision["precision"], mixed_precision=precision["mixed_precision"],
                   activation_checkpointing=options.activation_checkpointing not in (None, False),
                   provenance=provenance(run), measurement=measurement)
