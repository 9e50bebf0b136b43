"""Emulated clusters on one CPU machine: one process per rank, each with a ``VirtualDevice`` made
from its preset in the cluster description.

``emulate_cluster`` resolves the cluster and picks the scales (below) in one process: the
``EmulatedCluster`` it returns makes every rank's device. ``poplar.profile`` calls it, then
spawns the ranks (``poplar.comm.launch.spawn``, entry point ``emulated_rank``); inside a running
job (auto mode) every rank calls ``emulate_cluster_together``, where rank 0 runs the
single-process part of the calibration, every rank times trial steps together (the run's
concurrency), and all ranks share rank 0's result.

Scales (``poplar.profiler.calibration``): presets describe real GPUs and a real model; a
CPU-sized model needs both memory and time scaled down. ``memory_scale`` multiplies every
preset's memory, ``time_scale`` every preset's step time; ``"auto"`` picks them so the smallest
device fits a batch of about 8 and the real compute, measured with every rank computing at
once, stays within ``margin`` (0.6) of every device's curve. Each device leaves its backward
that much room before the real backward (``VirtualDevice.backward_room``), so a rank that
computes while the others do still ends on time.

Precision. Under a mixed-precision policy (``CalibrationInputs.mixed_precision``) the devices
emulate their presets at that precision (fp16 / bf16 curves are faster by the presets' dtype
factors; memory is counted at the real dtypes). The scales do not depend on the precision: the
memory scale is picked from an fp32 pass (a GPU's memory does not shrink with the dtype, so
fp16 shows as a larger mbs), and the time scale satisfies both an fp32 pass and the policy's,
so an fp32 and a bf16 run of the same model emulate the same GPUs. A cluster with a device that
lacks the precision (bf16 on V100 / T4) is refused before anything runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from poplar.comm import Communicator
from poplar.profiler.faults import FaultSchedule
from poplar.profiler.calibration import (MARGIN, MIN_STEP_S, Calibration, CalibrationPass, Prepared,
                                         batches_to_time, calibrate, check_cluster_precision, TimingJob, combine,
                                         finish, measure_pass, prepare, time_scale_needed, time_trials)
from poplar.profiler.speed_padding import LATE_BUDGET
from poplar.profiler.virtual_device import VirtualDevice
from poplar.profiler.virtual_link import LinkSpec, VirtualLink
from poplar.types.cluster import ClusterSpec
from poplar.types.precision import MixedPrecision, Precision
from poplar.types.presets import precision_of
from poplar.types.profiles import ProfileError

__all__ = ["Calibration", "CalibrationPass", "CalibrationInputs", "EmulatedCluster", "calibrate", "cluster_devices",
           "emulate_cluster", "emulate_cluster_together", "emulated_rank"]


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
    # the heaviest configuration the job may train, (ZeRO stage, activation checkpointing), when
    # it differs from zero_stage without checkpointing (auto mode trying higher stages and
    # checkpointing): its micro-steps, at the larger batches it fits, are timed too
    heaviest: tuple[int, Any] | None = None


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
    backward_room: float = MARGIN  # each device's room for its real backward (speed_padding)
    faults: dict[int, FaultSchedule] = field(default_factory=dict)  # rank -> injected drift (tests, benches)

    def device(self, rank: int) -> VirtualDevice:
        """The virtual device of ``rank``: its preset's memory and speed curve (at the cluster's
        precision), scaled, with the rank's injected faults if any."""
        device = VirtualDevice.from_preset(self.spec.rank_types()[rank], self.memory_scale, self.time_scale,
                                           precision=self.precision, backward_room=self.backward_room)
        device.cluster, device.faults = self.spec, self.faults.get(rank)
        return device

    def devices(self) -> list[VirtualDevice]:
        return [self.device(rank) for rank in range(self.spec.world_size)]

    def meta(self) -> dict[str, Any]:
        """What a profile of this cluster records in its meta."""
        return {"cluster": self.spec.to_dict(), "memory_scale": self.memory_scale, "time_scale": self.time_scale,
                "calibration": self.calibration.to_dict() if self.calibration else None,
                "precision": str(self.precision)}


def emulate_cluster(cluster: ClusterSpec | str, inputs: CalibrationInputs, memory_scale: float | str = "auto",
                    time_scale: float | str = "auto", margin: float = MARGIN) -> EmulatedCluster:
    """``cluster`` (a ClusterSpec, built-in name or file) emulated with this model: the scales
    given, or calibrated where "auto" (module doc; the concurrent timing spawns one process per
    rank). A device that lacks the inputs' precision (bf16 on a V100 or T4) is a ProfileError
    naming it."""
    spec = ClusterSpec.resolve(cluster)
    check_cluster_precision(spec, inputs.mixed_precision)
    precision = precision_of(inputs.mixed_precision)
    if memory_scale != "auto" and time_scale != "auto":
        return EmulatedCluster(spec, float(memory_scale), float(time_scale), precision=precision)
    cal = calibrate(inputs.model_fn, inputs.loss_fn, inputs.sample_fn, spec, inputs.zero_stage,
                    optimizer_fn=inputs.optimizer_fn, bucket_size_mb=inputs.bucket_size_mb,
                    wrap_policy=inputs.wrap_policy, memory_scale=memory_scale, time_scale=time_scale,
                    max_batch=inputs.max_batch, mixed_precision=inputs.mixed_precision, margin=margin)
    return EmulatedCluster(spec, cal.memory_scale, cal.time_scale, cal, precision, cal.margin)


def _prepare(spec: ClusterSpec, inputs: CalibrationInputs, memory_scale: float | str, time_scale: float | str) -> Any:
    return prepare(inputs.model_fn, inputs.loss_fn, inputs.sample_fn, spec, inputs.zero_stage,
                   optimizer_fn=inputs.optimizer_fn, bucket_size_mb=inputs.bucket_size_mb,
                   wrap_policy=inputs.wrap_policy, memory_scale=memory_scale, time_scale=time_scale,
                   max_batch=inputs.max_batch, mixed_precision=inputs.mixed_precision)


def emulate_cluster_together(comm: Communicator, cluster: Any, inputs: CalibrationInputs,
                             memory_scale: float | str = "auto", time_scale: float | str = "auto", *,
                             what: str = "emulated cluster") -> EmulatedCluster:
    """``emulate_cluster`` inside a running job, on every rank of ``comm``: the cluster must have
    one device per rank; rank 0 runs the single-process passes, every rank times trial steps
    together (the run's concurrency, module doc), and every rank gets rank 0's result, so all
    emulate the same cluster. Any failure is a ``ProfileError`` on every rank (``what`` names
    the caller)."""
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
    precision = precision_of(inputs.mixed_precision)
    if memory_scale != "auto" and time_scale != "auto":
        return EmulatedCluster(spec, float(memory_scale), float(time_scale), precision=precision)
    prep, error = None, None
    if comm.rank == 0:
        try:
            prep = _prepare(spec, inputs, memory_scale, time_scale)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"calibrating the emulated cluster failed: {type(e).__name__}: {e}"
    heavy_mbs = None
    if prep is not None and prep.job is not None and inputs.heaviest is not None and error is None:
        try:
            heavy_batches, heavy_mbs = _heaviest(prep, inputs)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"calibrating the emulated cluster's heaviest configuration failed: {type(e).__name__}: {e}"
    # the batches to time travel, not the job: a rank's model_fn may be a closure (auto mode)
    configs = None
    if prep is not None and prep.job is not None:
        configs = [(inputs.zero_stage, None, prep.job.batches)]
        if heavy_mbs is not None:
            configs.append((*inputs.heaviest, heavy_batches))
    error, configs = comm.all_gather_object((error, configs), tag="emulate:prepare")[0]
    if error is not None:
        raise ProfileError(f"{what}: {error}")
    timed: Any = []
    if configs is not None:
        token = torch.zeros(1)
        policies = [None] if inputs.mixed_precision is None else [None, inputs.mixed_precision]
        try:
            for stage, checkpointing, batches in configs:
                job = TimingJob(inputs.model_fn, inputs.loss_fn, inputs.sample_fn, inputs.optimizer_fn,
                                spec.world_size, stage, policies, batches,
                                options={"bucket_size_mb": inputs.bucket_size_mb, "wrap_policy": inputs.wrap_policy,
                                         "activation_checkpointing": checkpointing})
                timed.append(time_trials(job, comm.rank, lambda: comm.all_reduce(token, tag="emulate:barrier")))
        except Exception as e:  # noqa: BLE001 - agreed below (a rank that fails stops at its next barrier)
            timed = f"rank {comm.rank}: calibration timing failed: {type(e).__name__}: {e}"
    everyone = comm.all_gather_object(timed, tag="emulate:timing")
    emulated: EmulatedCluster | str | None = None
    if comm.rank == 0:
        failed = [t for t in everyone if isinstance(t, str)]
        try:
            if failed:
                raise RuntimeError("; ".join(failed))
            cal = finish(prep, combine([t[0] for t in everyone]) if configs is not None else {})
            if heavy_mbs is not None:  # the heaviest configuration's real compute within the margin too
                need = time_scale_needed(prep.presets, heavy_mbs, combine([t[1] for t in everyone]), cal.margin,
                                         MIN_STEP_S)
                cal = replace(cal, time_scale=max(cal.time_scale, need))
            emulated = EmulatedCluster(spec, cal.memory_scale, cal.time_scale, cal, precision, cal.margin)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            emulated = f"calibrating the emulated cluster failed: {type(e).__name__}: {e}"
    emulated = comm.all_gather_object(emulated, tag="emulate:calibrate")[0]
    if isinstance(emulated, str):
        raise ProfileError(f"{what}: {emulated}")
    assert emulated is not None
    return emulated


def _heaviest(prep: Prepared, inputs: CalibrationInputs) -> tuple[list[int], dict[str, dict[str, int]]]:
    """Rank 0: the batches to time for ``inputs.heaviest`` and its predicted mbs per precision
    and device, from single-process passes under that configuration at the chosen memory scale."""
    assert prep.job is not None and inputs.heaviest is not None
    stage, checkpointing = inputs.heaviest
    job = replace(prep.job, zero_stage=stage, batches=[],
                  options={**prep.job.options, "activation_checkpointing": checkpointing})
    passes = [measure_pass(job, p) for p in job.policies]
    mbs_at = {str(c.precision): {p.name: c.mbs(p, prep.memory_scale, inputs.max_batch) for p in prep.presets}
              for c in passes}
    return sorted({b for m in mbs_at.values() for b in batches_to_time(m)}), mbs_at


T = TypeVar("T")


def until_on_time(name: str, attempts: int, run_once: Callable[[float], tuple[T, float]],
                  margin: float = MARGIN) -> tuple[T, float, int]:
    """A bench's emulated run, repeated until its devices held their speed: ``run_once(margin)``
    calibrates at ``margin``, runs, and returns (its result, its late-step fraction). Over
    ``LATE_BUDGET`` the run does not count and is made again with 0.7 x the margin (more
    headroom), ``attempts`` times at most. Returns the last (result, late fraction, attempts
    used); a late fraction still over the budget means the result is not valid."""
    for attempt in range(attempts):
        result, late = run_once(margin)
        if late <= LATE_BUDGET:
            break
        print(f"# {name}: {100 * late:.1f}% of micro-steps late (budget {100 * LATE_BUDGET:.0f}%): "
              + ("re-calibrating with margin %.2f" % (0.7 * margin) if attempt + 1 < attempts else "kept as INVALID"),
              file=sys.stderr, flush=True)
        margin *= 0.7
    return result, late, attempt + 1


def cluster_devices(cluster: ClusterSpec | str, memory_scale: float, time_scale: float,
                    precision: Any = None, faults: dict[int, FaultSchedule] | None = None,
                    link: LinkSpec | None = None) -> list[VirtualDevice]:
    """One virtual device per rank of ``cluster`` (a ClusterSpec, built-in name or file),
    emulating ``precision`` (a name, ``Precision`` or policy; default fp32); ``faults``: injected
    drift per rank (``poplar.profiler.faults``); ``link``: the emulated interconnect that paces
    the ranks' collectives (``virtual_link``; None: the machine's own)."""
    spec = ClusterSpec.resolve(cluster)
    check_cluster_precision(spec, precision)
    devices = EmulatedCluster(spec, memory_scale, time_scale, precision=precision_of(precision),
                              faults=dict(faults or {})).devices()
    if link is not None:
        if link.world_size != spec.world_size:
            raise ValueError(f"the link joins {link.world_size} ranks but cluster {spec.name} has {spec.world_size}")
        for rank, device in enumerate(devices):
            device.link = VirtualLink(link, rank)
    return devices


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
    return {"profile": profile.to_dict(), "device": device.describe(), "late_steps": device.late_steps,
            "padded_steps": device.padded_steps}
