"""Emulated clusters on one CPU machine: one process per rank, each with a ``VirtualDevice`` made
from its preset in the cluster description.

``emulate_cluster`` resolves the cluster and picks the scales (below) in one process: the
``EmulatedCluster`` it returns makes every rank's device. ``profile_cluster.profile_cluster``
calls it, then spawns the ranks; inside a running job every rank's ``ClusterDevice`` calls
``emulate_cluster_together`` when profiling starts, where rank 0 runs the single-process part of
the calibration, every rank times trial steps together (the run's concurrency), and all ranks
share rank 0's result.

Scales (``poplar.emulation.calibration``): presets describe real GPUs and a real model; a
CPU-sized model needs both memory and time scaled down. ``memory_scale`` multiplies every
preset's memory, ``time_scale`` every preset's step time; ``"auto"`` picks them so the smallest
device fits a batch of about 8 and the real compute, measured with every rank computing at
once, stays within ``margin`` (0.6) of every device's curve. Each device leaves its backward
that much room before the real backward (``VirtualDevice.backward_room``), so a rank that
computes while the others do still ends on time.

Precision. Under a mixed-precision policy (the job's ``options.mixed_precision``) the devices
emulate their presets at that precision (fp16 / bf16 curves are faster by the presets' dtype
factors; memory is counted at the real dtypes). The scales do not depend on the precision: the
memory scale is picked from an fp32 pass (a GPU's memory does not shrink with the dtype, so
fp16 shows as a larger mbs), and the time scale satisfies both an fp32 pass and the policy's,
so an fp32 and a bf16 run of the same model emulate the same GPUs. A cluster with a device that
lacks the precision (bf16 on V100 / T4) is refused before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from poplar.comm import Communicator
from poplar.emulation.calibration import (MARGIN, MIN_STEP_S, Calibration, Prepared, Scales, TimingJob,
                                          batches_to_time, calibrate, check_cluster_precision, combine, finish,
                                          measure_pass, prepare, time_scale_needed, time_trials)
from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.faults import FaultSchedule
from poplar.emulation.virtual_device import VirtualDevice
from poplar.emulation.virtual_link import LinkSpec
from poplar.emulation.cluster_network import NetworkScales, emulated_network
from poplar.emulation.virtual_network import NetworkSpec, paced_link
from poplar.types.profiles import LinkSpeed
from poplar.types.topology import Topology
from poplar.profiler.profile_run import ProfileJob
from poplar.types.configuration import Configuration
from poplar.types.precision import Precision, precision_of
from poplar.types.profiles import Emulated, ProfileError

__all__ = ["EmulatedCluster", "cluster_devices", "emulate_cluster", "emulate_cluster_together"]


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

    @property
    def topology(self) -> Topology:
        """The job's ranks grouped into the cluster's machines (``ZeroConfig(topology=...)``)."""
        return self.spec.topology()

    def network(self, model_param_bytes: int, floor: LinkSpeed | None) -> NetworkSpec:
        """The cluster's declared links at this emulation's time scale, the model's parameter
        bytes standing for the reference model's, no faster than ``floor`` (the machine's link,
        ``cluster_network.machine_floor``): a fresh board the caller removes when done."""
        return emulated_network(self.spec, NetworkScales.for_model(self.time_scale, model_param_bytes, floor))

    def emulated(self) -> Emulated:
        """What a profile of this cluster records in its ``Provenance``."""
        return Emulated(memory_scale=self.memory_scale, time_scale=self.time_scale, cluster=self.spec.name,
                        calibration=self.calibration.to_dict() if self.calibration else None)


def emulate_cluster(cluster: ClusterSpec | str, job: ProfileJob, scales: Scales = Scales(),
                    margin: float = MARGIN) -> EmulatedCluster:
    """``cluster`` (a ClusterSpec, built-in name or file) emulated with ``job``'s model: the
    scales given, or calibrated where "auto" (module doc; the concurrent timing spawns one
    process per rank). A device that lacks the job's precision (bf16 on a V100 or T4) is a
    ProfileError naming it."""
    spec = ClusterSpec.resolve(cluster)
    policy = job.options.mixed_precision
    check_cluster_precision(spec, policy)
    precision = precision_of(policy)
    if scales.fixed:
        return EmulatedCluster(spec, float(scales.memory), float(scales.time), precision=precision)
    cal = calibrate(job, spec, scales=scales, margin=margin)
    return EmulatedCluster(spec, cal.memory_scale, cal.time_scale, cal, precision, cal.margin)


def emulate_cluster_together(comm: Communicator, cluster: Any, job: ProfileJob, scales: Scales = Scales(), *,
                             what: str = "emulated cluster") -> EmulatedCluster:
    """``emulate_cluster`` inside a running job, on every rank of ``comm``: the cluster must have
    one device per rank; rank 0 runs the single-process passes, every rank times trial steps
    together (the run's concurrency, module doc), and every rank gets rank 0's result, so all
    emulate the same cluster. The heaviest configuration the job may time (``job.heaviest``) is
    timed too. Any failure is a ``ProfileError`` on every rank (``what`` names the caller)."""
    options = job.options
    error, spec = None, None
    try:
        spec = ClusterSpec.resolve(cluster)
        if spec.world_size != comm.world_size:
            error = (f"cluster {spec.name!r} has {spec.world_size} devices ({spec.describe()}) but the job has "
                     f"{comm.world_size} ranks; launch one rank per device")
        else:
            spec.check_precision(options.mixed_precision)
    except (ValueError, OSError) as e:
        error = str(e)
    comm.agree(error, f"{what}: cluster", error_type=ProfileError)
    assert spec is not None
    precision = precision_of(options.mixed_precision)
    if scales.fixed:
        return EmulatedCluster(spec, float(scales.memory), float(scales.time), precision=precision)
    heaviest = job.heaviest if job.heaviest != Configuration(options.zero_stage) else None
    prep, error = None, None
    if comm.rank == 0:
        try:
            prep = prepare(job, spec, scales=scales)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"calibrating the emulated cluster failed: {type(e).__name__}: {e}"
    heavy_mbs, heavy_batches = None, []
    if prep is not None and prep.job is not None and heaviest is not None and error is None:
        try:
            heavy_batches, heavy_mbs = _heaviest(prep, heaviest, options.max_batch)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"calibrating the emulated cluster's heaviest configuration failed: {type(e).__name__}: {e}"
    # the batches to time travel, not the job: a rank's model_fn may be a closure (auto mode)
    configs = None
    if prep is not None and prep.job is not None:
        configs = [(options.zero_stage, None, prep.job.batches)]
        if heavy_mbs is not None:
            configs.append((heaviest.stage, heaviest.checkpointing, heavy_batches))
    configs = comm.agree(error, f"{what}: calibration", configs, error_type=ProfileError)[0]
    timed: list[dict[str, dict[int, list[float]]]] = []
    error = None
    if configs is not None:
        token = torch.zeros(1)
        policies = [None] if options.mixed_precision is None else [None, options.mixed_precision]
        try:
            for stage, checkpointing, batches in configs:
                trials = TimingJob(job.model_fn, job.loss_fn, job.sample_fn, job.optimizer_fn, spec.world_size,
                                   stage, policies, batches,
                                   options={"bucket_size_mb": options.bucket_size_mb,
                                            "wrap_policy": options.wrap_policy,
                                            "activation_checkpointing": checkpointing})
                timed.append(time_trials(trials, comm.rank, lambda: comm.all_reduce(token, tag="emulate:barrier")))
        except Exception as e:  # noqa: BLE001 - agreed below (a rank that fails stops at its next barrier)
            error = f"calibration timing failed: {type(e).__name__}: {e}"
    everyone = comm.agree(error, f"{what}: calibration timing", timed, error_type=ProfileError)
    emulated, error = None, None
    if comm.rank == 0:
        try:
            cal = finish(prep, combine([t[0] for t in everyone]) if configs is not None else {})
            if heavy_mbs is not None:  # the heaviest configuration's real compute within the margin too
                need = time_scale_needed(prep.presets, heavy_mbs, combine([t[1] for t in everyone]), cal.margin,
                                         MIN_STEP_S)
                cal = replace(cal, time_scale=max(cal.time_scale, need))
            emulated = EmulatedCluster(spec, cal.memory_scale, cal.time_scale, cal, precision, cal.margin)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"calibrating the emulated cluster failed: {type(e).__name__}: {e}"
    emulated = comm.agree(error, f"{what}: calibration", emulated, error_type=ProfileError)[0]
    assert emulated is not None
    return emulated


def _heaviest(prep: Prepared, heaviest: Configuration, max_batch: int) -> tuple[list[int], dict[str, dict[str, int]]]:
    """Rank 0: the batches to time for ``heaviest`` and its predicted mbs per precision and
    device, from single-process passes under that configuration at the chosen memory scale."""
    assert prep.job is not None
    job = replace(prep.job, zero_stage=heaviest.stage, batches=[],
                  options={**prep.job.options, "activation_checkpointing": heaviest.checkpointing})
    passes = [measure_pass(job, p) for p in job.policies]
    mbs_at = {str(c.precision): {p.name: c.mbs(p, prep.memory_scale, max_batch) for p in prep.presets}
              for c in passes}
    return sorted({b for m in mbs_at.values() for b in batches_to_time(m)}), mbs_at


def cluster_devices(cluster: ClusterSpec | str, memory_scale: float, time_scale: float,
                    precision: Any = None, faults: dict[int, FaultSchedule] | None = None,
                    link: LinkSpec | NetworkSpec | None = None) -> list[VirtualDevice]:
    """One virtual device per rank of ``cluster`` (a ClusterSpec, built-in name or file),
    emulating ``precision`` (a name, ``Precision`` or policy; default fp32); ``faults``: injected
    drift per rank (``poplar.emulation.faults``); ``link``: the emulated interconnect that paces
    the ranks' collectives (``virtual_link``, or ``virtual_network`` for a cluster of several
    nodes; None: the machine's own)."""
    spec = ClusterSpec.resolve(cluster)
    check_cluster_precision(spec, precision)
    devices = EmulatedCluster(spec, memory_scale, time_scale, precision=precision_of(precision),
                              faults=dict(faults or {})).devices()
    if link is not None:
        if link.world_size != spec.world_size:
            raise ValueError(f"the link joins {link.world_size} ranks but cluster {spec.name} has {spec.world_size}")
        for rank, device in enumerate(devices):
            device.link = paced_link(link, rank)
    return devices
