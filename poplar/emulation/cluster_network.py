"""A cluster's declared links at the emulation's scales: the ``NetworkSpec`` its ranks are paced by
(docs/design.md §4.7).

A virtual device stands for its GPU training the presets' reference workload
(``synthetic.REFERENCE_MODEL``, 125M parameters): a micro-step of the CPU-sized model lasts the
reference workload's time on that GPU, times the calibrated ``time_scale``. The network is
scaled the same way: the model's parameter bytes stand for the reference model's on the wire, so
a collective of ``B`` bytes here lasts what the declared link takes for
``B x reference bytes / model bytes`` there, times ``time_scale``:

    latency   = declared latency x time_scale
    bandwidth = declared bandwidth x (model bytes / reference bytes) / time_scale

so an emulated cluster spends the same share of a step on each link as the real one training
the reference model: between two A100 nodes of 4, the flat reduce-scatter of its 500 MB takes
35 ms over 100 Gbps InfiniBand, a quarter of an A100-80G's micro-step of 8 samples (0.14 s),
and 350 ms over 10 Gbps Ethernet, 2.5 micro-steps.

The machine sets a floor, as it does for compute: the real gloo collectives must fit inside
their emulated time, or they run late and the cluster is slower than the one declared. The
floor is the link ``link_calibration.measure_link`` fits to the machine (every rank, the model's
size); an emulated link faster than it is slowed to it (latency raised, bandwidth lowered), and
``clamped`` names the links that were. NVLink's microseconds of latency are always below a CPU
collective's: every link's latency is the machine's at least.

A cluster that declares no nodes keeps today's rule: its one link is the machine's floor itself
(``LinkSpec`` from ``measure_link``), whatever its declared speed.

Inside a running job (``join_network``: a ``ClusterDevice`` when profiling starts, so ``poplar
demo``, ``poplar train`` and auto mode on an emulated cluster that spans nodes) every rank
measures the floor together on the job's own process group (``measure_link_together``), rank 0
makes the network and every rank maps its board; rank 0 then removes the board's file, which
lives on while the ranks map it, so a job that dies leaves nothing behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.presets import LinkPreset
from poplar.emulation.synthetic import REFERENCE_MODEL
from poplar.emulation.virtual_network import NetworkSpec, VirtualNetwork
from poplar.types.profiles import LinkSpeed


@dataclass(frozen=True)
class NetworkScales:
    """How declared links become emulated ones (module doc): the devices' ``time_scale``, the
    emulated bytes per real byte (``byte_scale``), and the machine's floor (None: no floor)."""

    time_scale: float
    byte_scale: float
    floor: LinkSpeed | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0 or not self.byte_scale > 0:
            raise ValueError(f"network scales must be > 0, got time {self.time_scale} and bytes {self.byte_scale}")

    @classmethod
    def for_model(cls, time_scale: float, model_param_bytes: int, floor: LinkSpeed | None = None) -> "NetworkScales":
        """Scales for a model of ``model_param_bytes`` parameter bytes standing for the reference model."""
        return cls(time_scale, model_param_bytes / REFERENCE_MODEL.param_bytes, floor)

    def scaled(self, link: LinkPreset) -> LinkSpeed:
        """``link`` at these scales, before the floor."""
        return LinkSpeed(bandwidth_bytes_per_s=link.bandwidth_gbps * 1e9 * self.byte_scale / self.time_scale,
                         latency_s=link.latency_us * 1e-6 * self.time_scale)

    def emulate(self, link: LinkPreset) -> LinkSpeed:
        """``link`` at these scales, no faster than the floor."""
        speed = self.scaled(link)
        if self.floor is None:
            return speed
        return LinkSpeed(bandwidth_bytes_per_s=min(speed.bandwidth_bytes_per_s, self.floor.bandwidth_bytes_per_s),
                         latency_s=max(speed.latency_s, self.floor.latency_s))

    def clamped(self, spec: ClusterSpec) -> list[str]:
        """The cluster's links whose bandwidth the floor lowered (their ratios to the others are lost)."""
        if self.floor is None:
            return []
        links = list(spec.node_links()) + ([spec.network] if spec.network is not None else [])
        return sorted({link.name for link in links
                       if self.scaled(link).bandwidth_bytes_per_s > self.floor.bandwidth_bytes_per_s})


def emulated_network(spec: ClusterSpec, scales: NetworkScales, directory: str | None = None) -> NetworkSpec:
    """The network that paces an emulated run of ``spec`` (a fresh board: ``remove`` it after).
    A cluster without nodes has one link: the floor itself (module doc)."""
    topology = spec.topology()
    if spec.nodes is None:
        if scales.floor is None:
            raise ValueError(f"cluster {spec.name!r} declares no nodes: its one link is the machine's floor "
                             "(link_calibration.measure_link); give NetworkScales a floor")
        return NetworkSpec.create(topology, (scales.floor,), None, directory)
    cross = scales.emulate(spec.network) if spec.network is not None else None
    return NetworkSpec.create(topology, tuple(scales.emulate(link) for link in spec.node_links()), cross, directory)


def machine_floor(world: int, model_bytes: int, **options: float) -> LinkSpeed:
    """The slowest link this machine's real collectives of ``world`` ranks still fit
    (``link_calibration.measure_link``, spawning ``world`` processes; ``options``: its own)."""
    from poplar.emulation.link_calibration import measure_link

    fit = measure_link(world, model_bytes, **options)
    return LinkSpeed(bandwidth_bytes_per_s=fit["bandwidth_bytes_per_s"], latency_s=fit["latency_s"])


# Each kind of collective is timed this many times at two sizes to find the floor inside a job:
# fewer than a bench's ``link_calibration.REPS`` (30), since every emulated run of a cluster that
# spans nodes pays it when profiling starts; the 0.9 quantile of 12 still leaves room for the load.
JOB_FLOOR_REPS = 12


def join_network(comm: Any, spec: ClusterSpec, time_scale: float, model_param_bytes: int, *,
                 what: str = "emulated network", error_type: type[Exception] = RuntimeError) -> VirtualNetwork:
    """This rank's end of ``spec``'s network at ``time_scale`` for a model of
    ``model_param_bytes``, every rank of ``comm`` together (module doc): the floor measured on the
    job's ranks, the network made by rank 0, its board mapped by every rank and its file removed.
    Any failure is ``error_type`` on every rank."""
    from poplar.emulation.link_calibration import measure_link_together

    fit = measure_link_together(comm, model_param_bytes, reps=JOB_FLOOR_REPS, what=f"{what}: machine floor",
                                error_type=error_type)
    floor = LinkSpeed(bandwidth_bytes_per_s=fit["bandwidth_bytes_per_s"], latency_s=fit["latency_s"])
    network, error = None, None
    if comm.rank == 0:
        try:
            network = emulated_network(spec, NetworkScales.for_model(time_scale, model_param_bytes, floor))
        except (ValueError, OSError) as e:
            error = f"the network of cluster {spec.name!r} could not be made: {e}"
    network = comm.agree(error, f"{what}: links", network, error_type=error_type)[0]
    end, error = VirtualNetwork(network, comm.rank), None
    try:
        end.board()  # mapped before the file goes: the mapping keeps it
    except OSError as e:
        error = f"mapping the network's board {network.board_path} failed: {e}"
    try:
        comm.agree(error, f"{what}: board", error_type=error_type)
    finally:
        if comm.rank == 0:
            network.remove()
    return end
