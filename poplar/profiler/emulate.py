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

Precision. Under a mixed-precision policy (``CalibrationInputs.mixed_precision``) the devices
emulate their presets at that precision (fp16 / bf16 curves are faster by the presets' dtype
factors; memory is counted at the real dtypes). The scales do not depend on the precision: the
memory scale is picked from an fp32 pass (a GPU's memory does not shrink with the dtype, so
fp16 shows as a larger mbs), and the time scale satisfies both an fp32 pass and the policy's,
so an fp32 and a bf16 run of the same model emulate the same GPUs. A cluster with a device that
lacks the precision (bf16 on V100 / T4) is refused before anything runs.
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
from poplar.types.cluster import ClusterError, ClusterSpec
from poplar.types.precision import MixedPrecision, Precision, resolve_precision
from poplar.types.presets import GIB, DevicePreset, get_preset, precision_of
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
    precision: str = "fp32"  # the run's precision (the numbers above are measured at it)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class CalibrationPass:
    """Trial steps of batch 1, 2, 4, 8 at one precision: model states, peak bytes and the real
    CPU seconds per batch (the smallest of three)."""

    precision: Precision
    state_bytes: int
    peaks: dict[int, int]
    seconds: dict[int, float]

    @property
    def bytes_per_sample(self) -> float:
        return max((self.peaks[8] - self.peaks[1]) / 7, 1.0)

    @property
    def real_s_per_step(self) -> tuple[float, float]:
        """(a, b): the real compute of a step of ``n`` samples is about a + b n seconds."""
        b = max((self.seconds[8] - self.seconds[1]) / 7, 0.0)
        return max(self.seconds[1] - b, 0.0), b

    def mbs(self, preset: DevicePreset, memory_scale: float, max_batch: int) -> int:
        """The batch that ``preset`` at ``memory_scale`` is predicted to fit."""
        room = preset.capacity_bytes(memory_scale) - self.peaks[1]
        return max(1, min(max_batch, int(room // self.bytes_per_sample) + 1))

    def time_scale_needed(self, presets: list[DevicePreset], mbs: dict[str, int], share: float,
                          min_step_s: float) -> float:
        """The smallest time scale at which every preset's curve at this precision is slow enough
        (module doc: min_step_s at batch 1 on the fastest, twice the real compute up to mbs)."""
        real_a, real_b = self.real_s_per_step
        need = min_step_s / min(p.time_s(1, precision=self.precision) for p in presets)
        for p in presets:
            for b in (1, mbs[p.name]):
                need = max(need, 2.0 * share * (real_a + real_b * b) / p.time_s(b, precision=self.precision))
        return need


def _measure(model_fn: Callable, loss_fn: Callable, sample_fn: Callable[[int], Any], world: int, zero_stage: int,
             optimizer_fn: Callable, policy: MixedPrecision | None, **runtime_options: Any) -> CalibrationPass:
    """One calibration pass (``CalibrationPass``) on a LocalCommunicator runtime under ``policy``."""
    model = model_fn()
    runtime = local_engine(model, optimizer_fn(model), world_size=world, rank=0, zero_stage=zero_stage,
                           device=torch.device("cpu"), mixed_precision=policy, **runtime_options)
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
    return CalibrationPass(precision_of(policy), state, peaks, seconds)


def calibrate(model_fn: Callable, loss_fn: Callable, sample_fn: Callable[[int], Any], cluster: ClusterSpec | str,
              zero_stage: int, *, optimizer_fn: Callable, bucket_size_mb: float = 25.0, wrap_policy: Any = None,
              memory_scale: float | str = "auto", time_scale: float | str = "auto",
              target_min_mbs: int = TARGET_MIN_MBS, min_step_s: float = MIN_STEP_S, max_batch: int = 4096,
              cores: int | None = None, mixed_precision: Any = None) -> Calibration:
    """Pick the scales for emulating ``cluster`` with this model (see the module doc). Under a
    low-precision policy the memory scale comes from an fp32 pass and the time scale covers
    both precisions, so fp32 and bf16/fp16 runs of one model emulate the same GPUs."""
    spec = ClusterSpec.resolve(cluster)
    policy = resolve_precision(mixed_precision)
    check_cluster_precision(spec, policy)
    presets = [get_preset(t) for t in dict.fromkeys(spec.rank_types())]
    options = {"bucket_size_mb": bucket_size_mb, "wrap_policy": wrap_policy}
    passes = [_measure(model_fn, loss_fn, sample_fn, spec.world_size, zero_stage, optimizer_fn, None, **options)]
    if policy is not None:
        passes.append(_measure(model_fn, loss_fn, sample_fn, spec.world_size, zero_stage, optimizer_fn, policy,
                               **options))
    reference, run = passes[0], passes[-1]
    if memory_scale == "auto":
        smallest = min(presets, key=lambda p: p.memory_gb)
        capacity = reference.peaks[1] + (target_min_mbs - 1 + 0.5) * reference.bytes_per_sample
        memory_scale = capacity / (smallest.memory_gb * GIB)
    memory_scale = float(memory_scale)
    if time_scale == "auto":
        share = max(1.0, spec.world_size / (cores or os.cpu_count() or 1))  # ranks sharing a core
        time_scale = max(c.time_scale_needed(presets, {p.name: c.mbs(p, memory_scale, max_batch) for p in presets},
                                             share, min_step_s) for c in passes)
    return Calibration(memory_scale, float(time_scale), run.state_bytes, run.peaks[1], run.bytes_per_sample,
                       run.real_s_per_step, {p.name: run.mbs(p, memory_scale, max_batch) for p in presets},
                       str(run.precision))


def check_cluster_precision(spec: ClusterSpec, policy: Any) -> None:
    """ProfileError naming the devices of ``spec`` that lack ``policy``'s precision."""
    try:
        spec.check_precision(policy)
    except ClusterError as e:
        raise ProfileError(str(e)) from None


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
    mixed_precision: MixedPrecision | None = None  # the run's precision policy (None: fp32)


@dataclass
class EmulatedCluster:
    """A cluster emulated on CPU: its description, the scales of its presets, and the
    calibration that picked them (None when both were given), and the precision its devices
    compute in."""

    spec: ClusterSpec
    memory_scale: float
    time_scale: float
    calibration: Calibration | None = None
    precision: Precision = Precision.FP32

    def device(self, rank: int) -> VirtualDevice:
        """The virtual device of ``rank``: its preset's memory and speed curve (at the cluster's
        precision), scaled."""
        device = VirtualDevice.from_preset(self.spec.rank_types()[rank], self.memory_scale, self.time_scale,
                                           precision=self.precision)
        device.cluster = self.spec
        return device

    def devices(self) -> list[VirtualDevice]:
        return [self.device(rank) for rank in range(self.spec.world_size)]

    def meta(self) -> dict[str, Any]:
        """What a profile of this cluster records in its meta."""
        return {"cluster": self.spec.to_dict(), "memory_scale": self.memory_scale, "time_scale": self.time_scale,
                "calibration": self.calibration.to_dict() if self.calibration else None,
                "precision": str(self.precision)}


def emulate_cluster(cluster: ClusterSpec | str, inputs: CalibrationInputs, memory_scale: float | str = "auto",
                    time_scale: float | str = "auto") -> EmulatedCluster:
    """``cluster`` (a ClusterSpec, built-in name or file) emulated with this model: the scales
    given, or calibrated where "auto" (see the module doc). In one process. A device that lacks
    the inputs' precision (bf16 on a V100 or T4) is a ProfileError naming it."""
    spec = ClusterSpec.resolve(cluster)
    check_cluster_precision(spec, inputs.mixed_precision)
    precision = precision_of(inputs.mixed_precision)
    if memory_scale != "auto" and time_scale != "auto":
        return EmulatedCluster(spec, float(memory_scale), float(time_scale), precision=precision)
    cal = calibrate(inputs.model_fn, inputs.loss_fn, inputs.sample_fn, spec, inputs.zero_stage,
                    optimizer_fn=inputs.optimizer_fn, bucket_size_mb=inputs.bucket_size_mb,
                    wrap_policy=inputs.wrap_policy, memory_scale=memory_scale, time_scale=time_scale,
                    max_batch=inputs.max_batch, mixed_precision=inputs.mixed_precision)
    return EmulatedCluster(spec, cal.memory_scale, cal.time_scale, cal, precision)


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
        else:
            spec.check_precision(inputs.mixed_precision)
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


def cluster_devices(cluster: ClusterSpec | str, memory_scale: float, time_scale: float,
                    precision: Any = None) -> list[VirtualDevice]:
    """One virtual device per rank of ``cluster`` (a ClusterSpec, built-in name or file),
    emulating ``precision`` (a name, ``Precision`` or policy; default fp32)."""
    spec = ClusterSpec.resolve(cluster)
    check_cluster_precision(spec, precision)
    return EmulatedCluster(spec, memory_scale, time_scale, precision=precision_of(precision)).devices()


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
