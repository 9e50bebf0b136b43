"""Emulated clusters on one CPU machine: one process per rank (``poplar.comm.launch.spawn``), each
with a ``VirtualDevice`` made from its preset in the cluster description.

Scales. Presets describe real GPUs and a real model; a CPU-sized model needs both memory and
time scaled down:

- ``memory_scale`` multiplies every preset's memory. ``"auto"`` measures the model (model
  states at the requested stage and bytes per sample, on a LocalCommunicator engine of the
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

from poplar.types.cluster import ClusterSpec
from poplar.profiler.capacity import CapacitySearch
from poplar.profiler.local_comm import local_engine
from poplar.types.presets import GIB, get_preset
from poplar.profiler.virtual_device import VirtualDevice

TARGET_MIN_MBS = 8
MIN_STEP_S = 0.004


def cluster_devices(cluster: ClusterSpec | str, memory_scale: float, time_scale: float) -> list[VirtualDevice]:
    """One virtual device per rank of ``cluster`` (a ClusterSpec, built-in name or file)."""
    spec = ClusterSpec.resolve(cluster)
    return [VirtualDevice.from_preset(t, memory_scale, time_scale) for t in spec.rank_types()]


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
    engine = local_engine(model, optimizer_fn(model), world_size=world, rank=0, zero_stage=zero_stage,
                          device=torch.device("cpu"), bucket_size_mb=bucket_size_mb, wrap_policy=wrap_policy)
    probe = VirtualDevice("calibration", 2 ** 62)
    peaks: dict[int, int] = {}
    seconds: dict[int, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each spawned rank runs
    try:
        with probe.attach(engine):
            search = CapacitySearch(engine, probe, sample_fn, loss_fn, zero_stage)
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
    return {"profile": profile.to_dict(), "device": device.describe(), "late_steps": getattr(device, "late_steps", 0)}
