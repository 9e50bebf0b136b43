"""One rank of an emulated cluster, as the device a job's engine profiles and trains on.

``cluster_device("B")`` in rank r of a job returns the r-th GPU of cluster B as a virtual device.
Its memory and speed are its preset's, scaled to the CPU-sized model: the scales are given, or
calibrated for the workload when profiling starts (``prepare_profiling``, a ``ProfileObserver``
point), every rank together (``emulate.emulate_cluster_together``), so every rank emulates the
same cluster. A profile reused instead of measured brings the scales it was measured at.

    device = poplar.emulation.cluster_device("B")
    engine = PoplarEngine(model, optimizer, global_batch_size=32, loss_fn=loss_fn,
                          auto=AutoOptions(profile_data=data, device=device))

The engine keeps its device attached while it trains, so the rank then trains at that GPU's
speed within its memory.

A cluster that spans nodes (its ``nodes`` and ``network``) is wired as declared: when profiling
starts, once the scales are known, every rank joins the cluster's virtual network together
(``cluster_network.join_network``: each node's link, the cross-node link, at the emulation's
scales and no faster than this machine), and the device's collectives ride it from then on, the
profiler's and the engine's alike. The job's engine should know the nodes too
(``ZeroConfig(topology=device.spec.topology())``; the command line passes them), so that the
profiler measures each link and the planner may choose hierarchical collectives; without them
every collective is one flat ring, paced across the slow link as a real one would be.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist

from poplar.comm import Communicator
from poplar.emulation.calibration import MARGIN, Scales
from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.cluster_network import join_network
from poplar.emulation.emulate import EmulatedCluster, emulate_cluster_together
from poplar.emulation.faults import FaultSchedule
from poplar.emulation.presets import get_preset
from poplar.emulation.speed_curves import PresetCurve
from poplar.emulation.virtual_device import VirtualDevice
from poplar.logs import log
from poplar.profiler.job import model_size
from poplar.types.precision import Precision, precision_of
from poplar.types.profiles import Profile, ProfileError


class ClusterDevice(VirtualDevice):
    """Rank ``rank``'s device of ``cluster`` (a ``ClusterSpec``, built-in name or cluster file),
    with its preset's memory and curve times ``scales`` (calibrated where "auto")."""

    def __init__(self, cluster: ClusterSpec | str, rank: int, *, scales: Scales = Scales(),
                 faults: FaultSchedule | None = None) -> None:
        self.spec = ClusterSpec.resolve(cluster)
        self.rank, self.scales = rank, scales
        # a rank the cluster lacks is reported when profiling starts, on every rank together (the
        # cluster's size is agreed there); until then the device stands as the cluster's first
        self.problem = None if 0 <= rank < self.spec.world_size else (
            f"rank {rank} is not a rank of cluster {self.spec.name!r} ({self.spec.describe()}): it has "
            f"{self.spec.world_size} devices; launch one rank per device")
        preset = get_preset(self.spec.rank_types()[rank if self.problem is None else 0])
        # until the scales are known the device holds its preset's unscaled memory and curve
        super().__init__(preset.name, preset.capacity_bytes(1.0), time_fn=PresetCurve(preset.name, 1.0),
                         device_type=preset.name, nominal_tflops=preset.nominal_tflops, backward_room=MARGIN)
        self.cluster, self.faults = self.spec, faults
        self.emulated: EmulatedCluster | None = None
        if scales.fixed and self.problem is None:
            self._use(EmulatedCluster(self.spec, float(scales.memory), float(scales.time)), None)

    @property
    def calibrated(self) -> bool:
        return self.emulated is not None

    def identity(self) -> str:
        """The preset's name and unscaled memory: the same before and after the scales are known
        (a stored profile brings the scales it was measured at)."""
        return f"{self.device_type} (emulated), {get_preset(self.device_type).capacity_bytes(1.0)} bytes"

    def _use(self, emulated: EmulatedCluster, precision: Precision | None) -> None:
        """Take the cluster's scales (and, profiling, its precision)."""
        preset = get_preset(self.device_type)
        self.emulated = emulated
        self._capacity = preset.capacity_bytes(emulated.memory_scale)
        self.memory_scale, self.time_scale = emulated.memory_scale, emulated.time_scale
        self.backward_room = emulated.backward_room
        self.fixed_precision = precision
        self.time_fn = PresetCurve(preset.name, emulated.time_scale)
        self._use_precision(precision or Precision.FP32)

    def prepare_profiling(self, comm: Communicator, job: Any, reused: Profile | None) -> None:
        """Every rank together: the scales the reused profile was measured at, the given ones, or
        calibrated for ``job`` (its model, stage, precision and heaviest configuration)."""
        spec = self.spec
        error = self.problem or (
            f"cluster {spec.name!r} has {spec.world_size} devices ({spec.describe()}) but the job has "
            f"{comm.world_size} ranks; launch one rank per device" if spec.world_size != comm.world_size else
            None if comm.rank == self.rank else
            f"this process is rank {comm.rank} but its device emulates rank {self.rank} of cluster {spec.name!r}: "
            "build it with cluster_device(cluster) in each rank")
        comm.agree(error, "emulated cluster", error_type=ProfileError)
        emulated = self.emulated  # scales given, or calibrated for an earlier profile of this job
        if emulated is None:
            scales = self.scales
            stored = reused.provenance.emulated if reused is not None else None
            if stored is not None and stored.time_scale is not None:  # emulate the devices it measured
                scales = Scales(stored.memory_scale, stored.time_scale)
            if comm.rank == 0 and not scales.fixed:  # a timing run of its own: say so before it
                log.info(f"emulated cluster {spec.name}: calibrating its memory and time scales for the model ...")
            emulated = emulate_cluster_together(comm, spec, job, scales, what="emulated cluster")
        self._use(emulated, precision_of(job.options.mixed_precision))
        if self.link is None and spec.topology().spans_nodes:
            self.link = self._join_network(comm, job)

    def _join_network(self, comm: Communicator, job: Any) -> Any:
        """Every rank together: this rank's end of the cluster's network (module doc)."""
        assert self.emulated is not None
        network = join_network(comm, self.spec, self.emulated.time_scale, model_size(job.model_fn())[1],
                               what=f"emulated cluster {self.spec.name}: network", error_type=ProfileError)
        if comm.rank == 0:
            log.info(f"emulated cluster {self.spec.name}: collectives ride its {network.spec.describe()}")
        return network

    @contextlib.contextmanager
    def _attached(self, runtime: Any) -> Iterator[None]:
        if self.problem is not None:
            raise ValueError(self.problem)
        if self.emulated is None:
            raise ProfileError(f"the emulated {self.name} (rank {self.rank} of cluster {self.spec.name!r}) has no "
                               "scales yet: profile with it first (auto mode), or give "
                               "cluster_device(..., scales=Scales(memory, time))")
        with super()._attached(runtime):
            yield


def cluster_device(cluster: ClusterSpec | str, rank: int | None = None, *, scales: Scales = Scales(),
                   faults: FaultSchedule | None = None) -> ClusterDevice:
    """This rank's device of ``cluster`` (``rank``: default this process's rank in the
    ``torch.distributed`` job). See the module doc."""
    if rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("cluster_device() needs the rank it emulates: initialise torch.distributed first, "
                             "or pass rank=")
        rank = dist.get_rank()
    return ClusterDevice(cluster, rank, scales=scales, faults=faults)
