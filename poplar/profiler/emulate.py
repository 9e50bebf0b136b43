"""Emulated clusters on one CPU machine: one process per rank, each with a ``VirtualDevice`` made
from its preset in the cluster description.

``emulate_cluster`` resolves the cluster and picks the scales (below) in one process: the
``EmulatedCluster`` it returns makes every rank's device. ``poplar.profile`` calls it, then
spawns the ranks (``poplar.comm.launch.spawn``, entry point ``emulated_rank``); inside a running
job (auto mode) every rank calls ``emulate_cluster_together``, where rank 0 calibrates and all
ranks share its result.

Scales. Presets describe real GPUs and a real model; a CPU-sized model needs both memory and
time scaled down:

- ``memory_scale`` multiplies every preset's memory. ``"auto"`` measures the model (model
  states at the requested stage and bytes per sample, on a LocalCommunicator runtime of the
  cluster's world size) and picks the scale at which the cluster's smallest-memory device fits
  a batch of about ``target_min_mbs`` (8): then the others land between that and a few dozen.
- ``time_scale`` multiplies every preset's step time. ``"auto"`` times the model's real CPU
  compute and picks the smallest scale at which (a) the fastest device's batch-1 step lasts
  ``min_step_s`` (sleep precision makes shorter steps noisy) and (b) the real compute, with the
  ranks sharing the machine's cores, stays under half of every device's curve up to its
  mbs, so that the padded compute equals the curve.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from poplar.comm import Communicator
from poplar.profiler.capacity import CapacitySearch
from poplar.profiler.local_comm import local_engine
from poplar.profiler.virtual_device import VirtualDevice
from poplar.types.cluster import ClusterSpec
from poplar.types.presets import GIB, get_preset
from poplar.types.profiles import ProfileError

TARGET_MIN_MBS = 8
MIN_STEP_S = 0.004


@dataclass
class Calibration:
    memory_scale: float
    time_scale: float
    state_bytes: int  # model states at the stage, one rank
    peak_batch1: int  # peak bytes of a batch-1 step
    bytes_per_sample: float
    real_s_per_step: tuple[float, float]  # CPU compute: seconds = a + b * batch
    predicted_mbs: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def calibrate(model_fn: Callable, loss_fn: Callable, sample_fn: Callable[[int], Any], cluster: ClusterSpec | str,
              zero_stage: int, *, optimizer_fn: Callable, bucket_size_mb: float = 25.0, wrap_policy: Any = None,
              memory_scale: float | str = "auto", time_scale: float | str = "auto",
              target_min_mbs: int = TARGET_MIN_MBS, min_step_s: float = MIN_STEP_S, max_batch: int = 4096,
              cores: int | None = None) -> Calibration:
    """Pick the scales for emulating ``cluster`` with this model (see the module doc)."""
    spec = ClusterSpec.resolve(cluster)
    world = spec.world_size
    types = list(dict.fromkeys(spec.rank_types()))
    presets = [get_preset(t) for t in types]
    model = model_fn()
    runtime = local_engine(model, optimizer_fn(model), world_size=world, rank=0, zero_stage=zero_stage,
                           device=torch.device("cpu"), bucket_size_mb=bucket_size_mb, wrap_policy=wrap_policy)
    probe = VirtualDevice("calibration", 2 ** 62)
    peaks: dict[int, int] = {}
    seconds: dict[int, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each spawned rank runs
    try:
        with probe.attach(runtime):
            search = CapacitySearch(runtime, probe, sample_fn, loss_fn, zero_stage)
            for b in (1, 2, 4, 8) * 3:  # the smallest of 3: the first includes one-off set-up
                t0 = time.perf_counter()
                if not search.trial(b):
                    raise RuntimeError("calibration step failed")
                seconds[b] = min(seconds.get(b, math.inf), time.perf_counter() - t0)
                peaks[b] = probe.last_step.peak
            state = probe.static_bytes()
    finally:
        torch.set_num_threads(threads)
    slope = max((peaks[8] - peaks[1]) / 7, 1.0)
    real_b = max((seconds[8] - seconds[1]) / 7, 0.0)
    real_a = max(seconds[1] - real_b, 0.0)
    if memory_scale == "auto":
        smallest = min(presets, key=lambda p: p.memory_gb)
        capacity = peaks[1] + (target_min_mbs - 1 + 0.5) * slope
        memory_scale = capacity / (smallest.memory_gb * GIB)
    memory_scale = float(memory_scale)
    mbs = {p.name: max(1, min(max_batch, int((p.capacity_bytes(memory_scale) - peaks[1]) // slope) + 1))
           for p in presets}
    if time_scale == "auto":
        share = max(1.0, world / (cores or os.cpu_count() or 1))  # ranks sharing a core
        need = min_step_s / min(p.time_s(1) for p in presets)
        for p in presets:
            for b in (1, mbs[p.name]):
                need = max(need, 2.0 * share * (real_a + real_b * b) / p.time_s(b))
        time_scale = need
    return Calibration(memory_scale, float(time_scale), state, peaks[1], slope, (real_a, real_b), mbs)


@dataclass
class CalibrationInputs:
    """What calibration trains: the profiler's own model, loss, batches and ZeRO set-up."""

    model_fn: Callable[[], nn.Module]
    loss_fn: Callable
    sample_fn: Callable[[int], Any]
    optimizer_fn: Callable
    zero_stage: int
    bucket_size_mb: float = 25.0
    wrap_policy: Any = None
    max_batch: int = 4096


@dataclass
class EmulatedCluster:
    """A cluster emulated on CPU: its description, the scales of its presets, and the
    calibration that picked them (None when both were given)."""

    spec: ClusterSpec
    memory_scale: float
    time_scale: float
    calibration: Calibration | None = None

    def device(self, rank: int) -> VirtualDevice:
        """The virtual device of ``rank``: its preset's memory and speed curve, scaled."""
        device = VirtualDevice.from_preset(self.spec.rank_types()[rank], self.memory_scale, self.time_scale)
        device.cluster = self.spec
        return device

    def devices(self) -> list[VirtualDevice]:
        return [self.device(rank) for rank in range(self.spec.world_size)]

    def meta(self) -> dict[str, Any]:
        """What a profile of this cluster records in its meta."""
        return {"cluster": self.spec.to_dict(), "memory_scale": self.memory_scale, "time_scale": self.time_scale,
                "calibration": self.calibration.to_dict() if self.calibration else None}


def emulate_cluster(cluster: ClusterSpec | str, inputs: CalibrationInputs, memory_scale: float | str = "auto",
                    time_scale: float | str = "auto") -> EmulatedCluster:
    """``cluster`` (a ClusterSpec, built-in name or file) emulated with this model: the scales
    given, or calibrated where "auto" (see the module doc). In one process."""
    spec = ClusterSpec.resolve(cluster)
    if memory_scale != "auto" and time_scale != "auto":
        return EmulatedCluster(spec, float(memory_scale), float(time_scale))
    cal = calibrate(inputs.model_fn, inputs.loss_fn, inputs.sample_fn, spec, inputs.zero_stage,
                    optimizer_fn=inputs.optimizer_fn, bucket_size_mb=inputs.bucket_size_mb,
                    wrap_policy=inputs.wrap_policy, memory_scale=memory_scale, time_scale=time_scale,
                    max_batch=inputs.max_batch)
    return EmulatedCluster(spec, cal.memory_scale, cal.time_scale, cal)


def emulate_cluster_together(comm: Communicator, cluster: Any, inputs: CalibrationInputs,
                             memory_scale: float | str = "auto", time_scale: float | str = "auto", *,
                             what: str = "emulated cluster") -> EmulatedCluster:
    """``emulate_cluster`` inside a running job, on every rank of ``comm``: the cluster must have
    one device per rank; rank 0 calibrates, and every rank gets its result, so all emulate the
    same cluster. Any failure is a ``ProfileError`` on every rank (``what`` names the caller)."""
    error, spec = None, None
    try:
        spec = ClusterSpec.resolve(cluster)
        if spec.world_size != comm.world_size:
            error = (f"cluster {spec.name!r} has {spec.world_size} devices ({spec.describe()}) but the job has "
                     f"{comm.world_size} ranks; launch one rank per device")
    except (ValueError, OSError) as e:
        error = str(e)
    comm.agree(error, f"{what}: cluster", error_type=ProfileError)
    assert spec is not None
    emulated: EmulatedCluster | str | None = None
    if comm.rank == 0:
        try:
            emulated = emulate_cluster(spec, inputs, memory_scale, time_scale)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            emulated = f"calibrating the emulated cluster failed: {type(e).__name__}: {e}"
    emulated = comm.all_gather_object(emulated, tag="emulate:calibrate")[0]
    if isinstance(emulated, str):
        raise ProfileError(f"{what}: {emulated}")
    assert emulated is not None
    return emulated


def cluster_devices(cluster: ClusterSpec | str, memory_scale: float, time_scale: float) -> list[VirtualDevice]:
    """One virtual device per rank of ``cluster`` (a ClusterSpec, built-in name or file)."""
    return EmulatedCluster(ClusterSpec.resolve(cluster), memory_scale, time_scale).devices()


def emulated_rank(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Entry point of one spawned rank: profile with this rank's virtual device. Profile errors
    (the same on every rank, by agreement) come back as data, not as a crashed rank."""
    from poplar.profiler.profile_run import profile_rank
    from poplar.types.profiles import ProfileError

    torch.manual_seed(job.get("seed", 0) + rank)
    device = job["devices"][rank]
    progress = job.get("progress", True)
    try:
        profile = profile_rank(job["model_fn"], job["loss_fn"], job["sample_fn"], device,
                               optimizer_fn=job["optimizer_fn"], options=job["options"],
                               log=None if progress else (lambda m: None))
    except ProfileError as e:
        return {"error": str(e)}
    return {"profile": profile.to_dict(), "device": device.describe(), "late_steps": device.late_steps}
