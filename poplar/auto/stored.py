"""Auto mode with the profile store (``poplar.profiler.store``): what a start reuses, and the
profiling of the device types the store lacks.

Every rank takes the same path, decided from rank 0's reading of the store (one gather):

- every device type of the job stored, at one configuration: no profiling; the profile is
  assembled from the entries (``StoreUse.REUSED``);
- some types stored: the new ones are profiled at the stored configuration
  (``profile_new_types``): their capacity search, then lock-step timing rounds in which the
  stored ranks run their cheapest batch (a round needs every rank); the stored ranks keep their
  stored points and capacity (``StoreUse.PARTIAL``), and every rank is timed past its mbs
  (``shard_room``) where shard weights give it room in this mix;
- none stored, or the entries disagree on the configuration: the full profile, as without a
  store (``StoreUse.MEASURED``).

Whatever was measured is written back (rank 0), one entry per device type.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable

import torch
from torch import nn

from poplar.comm import Communicator
from poplar.profiler.capacity import CapacityResult
from poplar.profiler.devices import Device
from poplar.profiler.escalation import StageCapacity
from poplar.profiler.exposure import ExposureRounds
from poplar.profiler.phases import observers_of
from poplar.profiler.profile_run import ProfileJob, ProfileRun
from poplar.profiler.shard_room import time_past_mbs
from poplar.profiler.store import (Entry, ProfileStore, StoreKey, agreed_configuration, assemble, model_config,
                                   module_structure)
from poplar.profiler.timing import Confirmation, TimingGrid, timing_batches
from poplar.types.configuration import Configuration
from poplar.types.precision import MixedPrecision, precision_of
from poplar.types.profiles import Profile, ProfileError, StoreRecord


class StoreUse(Enum):
    """How a start used the store."""

    REUSED = "reused"  # every device type's profile came from the store
    PARTIAL = "partial"  # stored types reused, new types profiled
    MEASURED = "measured"  # everything profiled


def _shapes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return [list(x.shape[1:]), str(x.dtype)]  # one sample: the batch dimension left out
    if isinstance(x, dict):
        return {str(k): _shapes(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_shapes(v) for v in x]
    return type(x).__name__


def model_fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The model's class, parameter and buffer names, shapes, dtypes and trainability, and the
    optimizer's class (its state is part of memory); not the values."""
    parts: list[Any] = [type(model).__qualname__, type(optimizer).__qualname__]
    parts += [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    parts += [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def store_key(model: nn.Module, optimizer: torch.optim.Optimizer, sample_fn: Callable[[int], Any], *,
              zero_stage: int, stages: tuple[int, ...], checkpointing: Any, rule: str, bucket_size_mb: float,
              policy: MixedPrecision | None) -> StoreKey:
    """What this job's profiles depend on (every rank computes the same key)."""
    setting = "auto" if checkpointing is None and rule != "single" else \
        "off" if checkpointing in (None, False) else "on" if checkpointing is True else repr(checkpointing)
    return StoreKey(model=model_fingerprint(model, optimizer), structure=module_structure(model),
                    config=model_config(model), zero_stage=zero_stage,
                    stages=tuple(sorted(set(stages))), checkpointing=setting, rule=rule,
                    precision=str(precision_of(policy).value), sample=repr(_shapes(sample_fn(1))),
                    bucket_size_mb=float(bucket_size_mb), torch_version=torch.__version__)


@dataclass
class StoreLookup:
    """Rank 0's reading of the store, the same on every rank."""

    cluster: list[str]  # every rank's device type
    entries: dict[str, Entry]  # the fresh ones
    warnings: list[str]

    @property
    def configuration(self) -> tuple[int, bool] | None:
        return agreed_configuration(self.entries)

    @property
    def new_types(self) -> list[str]:
        return [t for t in dict.fromkeys(self.cluster) if t not in self.entries]


def look_up(comm: Communicator, store: ProfileStore, key: StoreKey, device: Device) -> StoreLookup:
    """Every rank: the job's device types and rank 0's fresh entries for them."""
    devices = comm.all_gather_object((device.device_type, device.identity()), tag="auto:store types")
    cluster = [t for t, _ in devices]
    found: tuple[dict[str, Entry], list[str]] = ({}, [])
    if comm.rank == 0:
        found = (store.lookup(key, cluster, dict(reversed(devices))), store.take_warnings())
    entries, warnings = comm.all_gather_object(found, tag="auto:store entries")[0]
    return StoreLookup(cluster, entries, warnings)


def stored_configuration(lookup: StoreLookup, checkpointing: Any) -> Configuration:
    """The stored configuration as the runtime's setting (the job's own policy when it gave one)."""
    config = lookup.configuration
    assert config is not None
    stage, checkpointed = config
    return Configuration(stage, (checkpointing if checkpointing not in (None, False) else True)
                         if checkpointed else None)


def reuse_all(comm: Communicator, job: ProfileJob, device: Device | None, lookup: StoreLookup) -> Profile:
    """The job's profile from the store alone; devices that observe profiling prepare for it."""
    profile = assemble(lookup.entries, lookup.cluster)
    for observer in observers_of(device):
        observer.prepare_profiling(comm, job, profile)
    return profile


def _stored_capacity(entry: Entry, stage: int) -> CapacityResult:
    r = entry.rank
    return CapacityResult(stage=stage, capacity_bytes=int(r.capacity_bytes or 0), mbs=r.mbs, trial_steps=0,
                          base_bytes=r.base_bytes, bytes_per_sample=r.bytes_per_sample, shard_bytes=r.shard_bytes)


def profile_new_types(comm: Communicator, job: ProfileJob, device: Device, lookup: StoreLookup,
                      config: Configuration, log: Callable[[str], None]) -> Profile | None:
    """Profile the device types the store lacks at ``config``, the stored ones keeping their
    entries (see the module doc); None on every rank when a new type does not fit batch 1 there
    (the caller then profiles everything)."""
    stored_part = assemble(lookup.entries, [t for t in lookup.cluster if t in lookup.entries])
    configured = job.at(config)
    for observer in observers_of(device):  # emulate at the scales the stored types were measured at
        observer.prepare_profiling(comm, configured, stored_part)
    run = ProfileRun(configured, device, process_group=comm.group, log=log)
    mine = lookup.entries.get(device.device_type)
    error, result = None, None
    try:
        result = _stored_capacity(mine, config.stage) if mine is not None else run.search_capacity(config.stage)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        error = f"capacity search at {config.name} failed: {type(e).__name__}: {e}"
    mbs = comm.agree(error, "profile new device types", result.mbs if result is not None else 0,
                     error_type=ProfileError)
    run.end_phase("capacity_s")
    if any(m < 1 for m in mbs):
        return None
    assert result is not None
    fit = StageCapacity(config.stage, result, list(mbs))
    per_rank = [[1] if t in lookup.entries else timing_batches(m, TimingGrid.SPARSE)
                for t, m in zip(lookup.cluster, mbs)]
    timing = run.time(fit, per_rank, warmup=False, confirm=Confirmation.CURVE, exposure=ExposureRounds.GRID)
    if mine is not None:
        timing.points = [p for p in mine.rank.points if p.batch <= mine.rank.mbs]
    run.end_phase("timing_s")
    comm_profile = run.measure_comm()
    run.end_phase("comm_s")
    profile = run.assemble(fit, timing, comm_profile)
    if configured.options.time_past_mbs:
        # every rank, the stored ones too: how far a rank's micro-batch grows under shard weights
        # depends on the room of every card in this mix, not of the mix its entry was measured in
        profile = time_past_mbs(run, fit, profile)
    profile = replace(profile, store=StoreRecord(reused=sorted(lookup.entries), profiled=lookup.new_types))
    return profile


def profile_from_store(comm: Communicator, store: ProfileStore, key: Any, job: ProfileJob, device: Device,
                       checkpointing: Any, say: Callable[[str], None]) -> tuple[Profile | None, StoreUse]:
    """The profile the store gives (whole or with the new types profiled), or None to profile
    everything; every rank the same (``poplar.auto.stored``)."""
    lookup = look_up(comm, store, key, device)
    for warning in lookup.warnings:
        say(warning)
    if not lookup.entries:
        say(f"profile store {store.directory}: nothing stored for this model and settings; profiling")
        return None, StoreUse.MEASURED
    config = lookup.configuration
    if config is None:
        say("profile store: the stored device types were chosen at different configurations; profiling again")
        return None, StoreUse.MEASURED
    reused = ", ".join(sorted(lookup.entries))
    if not lookup.new_types:
        say(f"profile store {store.directory}: reusing the profiles of {reused} (ZeRO-{config[0]}"
            f"{' +ckpt' if config[1] else ''}); nothing to profile")
        return reuse_all(comm, job, device, lookup), StoreUse.REUSED
    configuration = stored_configuration(lookup, checkpointing)
    say(f"profile store {store.directory}: reusing the profiles of {reused}; profiling only "
        f"{', '.join(lookup.new_types)} at {configuration.name} (the stored configuration)")
    profile = profile_new_types(comm, job, device, lookup, configuration,
                                log=lambda m: say(m.removeprefix("[poplar profile] ")))
    if profile is None:
        say(f"profile store: batch 1 does not fit {', '.join(lookup.new_types)} at {configuration.name}; "
            "profiling every device type")
        return None, StoreUse.MEASURED
    profile = Profile.from_dict(comm.all_gather_object(profile.to_dict() if comm.rank == 0 else None,
                                                       tag="auto:store profile")[0])
    return profile, StoreUse.PARTIAL
