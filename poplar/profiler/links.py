"""Measuring the links: latency and bandwidth of the collectives, fitted per link.

A link is fitted from all-reduces, reduce-scatters and all-gathers of a few sizes, timed in
lock-step on a group of ranks: seconds = latency + bus bytes / bandwidth, where bus bytes are the
ring's of the planner's cost model (2 (N-1)/N V for an all-reduce, (N-1)/N V for the others, V
the full buffer), so the fit and the planner speak of the same bandwidth (``fit_link``).

A job on one node has one link, the ring over every rank (``measure_links`` with no topology, or
one of one node: the measurement it always had). A job whose topology spans nodes measures, after
that flat ring (what a flat collective runs at):
- inside each node, on a group of the node's ranks; every node at once, as a hierarchical
  collective's first step runs, and each node its own link (nodes may differ in size and kind);
- across nodes, on a group of one rank per node (the first of each): the step between nodes.
The node groups and the cross-node group are created once, by every rank in the same order
(``torch.distributed.new_group`` is collective over the world), and destroyed afterwards. Each
node's first rank writes its node's fit, and the first node's the cross-node one, into one
all-reduced tensor, so every rank returns the same ``Links``. The probes on the node and
cross-node groups are heard by the observer of the job's communicator, with their global ranks
and their link (``Communicator(link=...)``), as the flat ring's are: on an emulated cluster they
time the emulated links, not the machine's own collectives.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from poplar.comm import Communicator
from poplar.process.timeouts import COLLECTIVE_TIMEOUT_S
from poplar.planner.cost_model import bus_bytes
from poplar.types.profiles import Links, LinkSpeed
from poplar.types.topology import Link, Topology

DEFAULT_COMM_SIZES = (2 ** 14, 2 ** 17, 2 ** 20, 2 ** 22)  # bytes of the full (unsharded) buffer
NO_LINK = LinkSpeed(1e15, 0.0)  # a group of one rank: nothing crosses a link


def probe_sizes(param_bytes: int) -> tuple[int, ...]:
    """The buffer sizes the link probes time for a model of ``param_bytes``: ``DEFAULT_COMM_SIZES``
    up to the model's bytes, and the model's bytes. No collective of the job moves more than one
    copy of the parameters (a bucket or a gather holds at most all of them), so a larger probe
    times bytes no plan prices, and the fit is wanted where the job's collectives lie. A model of
    4 MB or more probes every default size; one below 16 KB the two smallest."""
    below = tuple(s for s in DEFAULT_COMM_SIZES if s < param_bytes)
    if len(below) == len(DEFAULT_COMM_SIZES):
        return DEFAULT_COMM_SIZES
    return below + (param_bytes,) if below else DEFAULT_COMM_SIZES[:2]


def _pair(link: LinkSpeed) -> torch.Tensor:
    return torch.tensor([link.bandwidth_bytes_per_s, link.latency_s], dtype=torch.float64)


def fit_link(bus: list[float], seconds: list[float]) -> LinkSpeed:
    """The line seconds = latency + bus / bandwidth through timed collectives (least squares);
    latency-bound everywhere (no positive slope): the best throughput seen and no latency."""
    slope, intercept = np.polyfit(np.array(bus), np.array(seconds), 1)
    if slope <= 0:
        return LinkSpeed(float(max(x / y for x, y in zip(bus, seconds))), 0.0)
    return LinkSpeed(float(1.0 / slope), max(float(intercept), 0.0))


def time_collectives(comm: Communicator, sizes: tuple[int, ...], reps: int) -> tuple[list[float], list[float]]:
    """Bus bytes and seconds (the median of ``reps`` after a warm-up call, averaged over the
    group's ranks so every rank fits the same link) of each collective and size on ``comm``."""
    n, dev = comm.world_size, comm.device
    xs: list[float] = []
    ys: list[float] = []
    barrier = torch.zeros(1, device=dev)
    for size in sizes:
        numel = max(n, (size // 4 + n - 1) // n * n)
        full = torch.zeros(numel, device=dev)
        shard = torch.zeros(numel // n, device=dev)
        nbytes = numel * 4
        ops = {"all_reduce": lambda: comm.all_reduce(full),
               "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
               "all_gather": lambda: comm.all_gather(full, shard)}
        for op, call in ops.items():
            times = []
            for rep in range(reps + 1):
                comm.all_reduce(barrier)
                t0 = time.perf_counter()
                call()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if rep > 0:  # the first call of each shape warms up
                    times.append(time.perf_counter() - t0)
            xs.append(bus_bytes(op, nbytes, n))
            ys.append(statistics.median(times))
    t = torch.tensor(ys, dtype=torch.float64, device=dev)
    comm.all_reduce(t)
    return xs, (t / n).tolist()


def measure_link(comm: Communicator, sizes: tuple[int, ...] = DEFAULT_COMM_SIZES, reps: int = 3) -> LinkSpeed:
    """The fitted link of the ring over ``comm``'s ranks (one rank: ``NO_LINK``)."""
    if comm.world_size <= 1:
        return NO_LINK
    return fit_link(*time_collectives(comm, sizes, reps))


@dataclass
class TierGroups:
    """This rank's process groups on a topology: its node's, and the cross-node one (None where
    this rank is not its node's first). ``created``: every group made, for ``destroy``."""

    node: Any
    cross: Any
    created: list[Any]

    @classmethod
    def create(cls, topology: Topology, rank: int, timeout_s: float) -> "TierGroups":
        """Every node's group, then the cross-node group: every rank creates each, in this order."""
        timeout = timedelta(seconds=timeout_s)
        created = [dist.new_group(list(node), timeout=timeout) for node in topology.nodes]
        created.append(dist.new_group([node[0] for node in topology.nodes], timeout=timeout))
        mine = topology.node_of(rank)
        return cls(created[mine], created[-1] if rank == topology.nodes[mine][0] else None, created)

    def destroy(self) -> None:
        for group in (self.node, self.cross):
            if group is not None:
                dist.destroy_process_group(group)


def measure_links(comm: Communicator, topology: Topology | None = None, sizes: tuple[int, ...] = DEFAULT_COMM_SIZES,
                  reps: int = 3, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Links:
    """The job's links: the flat ring over every rank and, on a topology that spans nodes, each
    node's link and the cross-node link. Every rank of ``comm`` (the world) calls it, with the
    same topology; every rank returns the same ``Links``."""
    flat = measure_link(comm, sizes, reps)
    if topology is None or not topology.spans_nodes:
        return Links(flat.bandwidth_bytes_per_s, flat.latency_s, comm.backend)
    problem = topology.problem(comm.world_size)
    if problem is not None:
        raise ValueError(f"cannot measure the links: {problem}")
    groups = TierGroups.create(topology, comm.rank, timeout_s)
    try:
        # observed like the flat ring: on an emulated cluster the probes ride the emulated links
        node_comm = Communicator(groups.node, comm.device, link=Link.INTRA)
        with node_comm.observed(comm.observer):
            intra = measure_link(node_comm, sizes, reps)
        cross = None
        if groups.cross is not None:
            cross_comm = Communicator(groups.cross, comm.device, link=Link.CROSS)
            with cross_comm.observed(comm.observer):
                cross = measure_link(cross_comm, sizes, reps)
    finally:
        groups.destroy()
    k = topology.node_count
    shared = torch.zeros(2 * k + 2, dtype=torch.float64, device=comm.device)
    node = topology.node_of(comm.rank)
    if cross is not None:  # this rank is its node's first: it writes its node's link
        shared[2 * node:2 * node + 2] = _pair(intra)
        if node == 0:
            shared[2 * k:] = _pair(cross)
    comm.all_reduce(shared)
    values = shared.tolist()
    links = [LinkSpeed(values[2 * i], values[2 * i + 1]) for i in range(k + 1)]
    return Links.tiered(topology, links[:k], links[k], comm.backend, flat)
