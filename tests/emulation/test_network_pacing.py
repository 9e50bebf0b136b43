"""The virtual network on real gloo ranks: 4 ranks as two nodes of 2, node groups made with
``dist.new_group``. Both nodes' intra-node collectives run at once, each as long as its own
link; the cross-node exchange starts when the slower node's is done; a flat ring over all
ranks waits for it; the ranks leave every collective when the network says. A rank that runs a
collective outside the network is a ``LinkError`` on the others, not a hang."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from poplar.comm import Communicator
from poplar.process.launch import RankFailure, spawn
from poplar.profiler.links import measure_links
from poplar.emulation.virtual_network import NetworkSpec, VirtualNetwork, link_seconds
from poplar.planner.cost_model import bus_bytes
from poplar.types.profiles import Links, LinkSpeed
from poplar.types.topology import Link, Topology, Wire
from tests.timing_reference import sleep_lateness

pytestmark = pytest.mark.timing

# latency-bound: the link sets the time
NODE0 = LinkSpeed(bandwidth_bytes_per_s=1e12, latency_s=0.10)
NODE1 = LinkSpeed(bandwidth_bytes_per_s=1e12, latency_s=0.25)
CROSS = LinkSpeed(bandwidth_bytes_per_s=1e6, latency_s=0.05)
EXCHANGE_BYTES = 200_000  # every node's sends summed: 100 KB a port, 0.1 s at 1 MB/s
FLAT_BYTES = 40_000
SLACK = 0.05  # a busy machine may only delay a paced collective, by this much (plus a bare sleep's lateness)


def paced_rank(rank: int, world: int, spec: NetworkSpec, skip_exchange: bool) -> dict:
    torch.set_num_threads(1)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    node = rank // 2
    net = VirtualNetwork(spec, rank)
    dist.all_reduce(torch.zeros(1))  # start together, unpaced
    t = torch.ones(1000)
    out = {"issue": [], "leave": []}

    def paced(op: str, nbytes: int, wire: Wire, run) -> None:
        out["issue"].append(time.perf_counter())
        ticket = net.issued(op, nbytes, wire)
        run()
        net.done(ticket)
        out["leave"].append(time.perf_counter())

    intra = Wire(Link.INTRA, (2 * node, 2 * node + 1))
    paced("all_reduce", 4000, intra, lambda: dist.all_reduce(t, group=groups[node]))
    exchange = lambda: dist.all_reduce(t)  # noqa: E731 - the real bytes move on the world group
    if skip_exchange and rank == 3:
        exchange()  # outside the network: the others wait for its issue, then raise
    else:
        paced("exchange", EXCHANGE_BYTES, Wire(Link.CROSS, (0, 1, 2, 3)), exchange)
    paced("all_reduce", FLAT_BYTES, Wire.world(4), lambda: dist.all_reduce(t))
    out["late"], out["paced"] = net.late_collectives, net.paced_collectives
    out["lateness"] = sleep_lateness(0.05)
    return out


@pytest.fixture
def network() -> NetworkSpec:
    spec = NetworkSpec.create(Topology.of_sizes([2, 2]), (NODE0, NODE1), CROSS)
    yield spec
    spec.remove()


@pytest.mark.multiprocess
def test_two_nodes_pace_their_own_collectives_at_once_and_share_the_cross_link(network: NetworkSpec) -> None:
    ranks = spawn(paced_rank, 4, (network, False), timeout_s=90)
    late = max(r["lateness"] for r in ranks)
    # node k's collective: from its last rank's issue, its own link's time; both nodes at once
    ready = [max(ranks[r]["issue"][0] for r in (2 * k, 2 * k + 1)) for k in (0, 1)]
    intra_end = [ready[0] + NODE0.latency_s, ready[1] + NODE1.latency_s]
    exchange = link_seconds(CROSS, EXCHANGE_BYTES / 2)
    # the ring over both nodes: paced by its slowest link, node 1's (its latency is the longest)
    flat = max(link_seconds(link, bus_bytes("all_reduce", FLAT_BYTES, 4)) for link in (NODE0, NODE1, CROSS))
    exchange_end = max(intra_end[1], max(r["issue"][1] for r in ranks)) + exchange
    flat_end = max(exchange_end, max(r["issue"][2] for r in ranks)) + flat
    for rank, r in enumerate(ranks):
        expected = [intra_end[rank // 2], exchange_end, flat_end]
        for i, end in enumerate(expected):
            # never before the network's end; after it by the slack at most
            assert end - 0.001 < r["leave"][i] < end + SLACK + late, (rank, i, r["leave"][i] - end)
        assert r["paced"] == 3
    # the nodes overlapped: node 1 did not queue behind node 0 (it would have left a whole node-1
    # link time after node 0)
    node0, node1 = (max(ranks[r]["leave"][0] for r in (2 * k, 2 * k + 1)) for k in (0, 1))
    assert node1 - node0 < NODE1.latency_s - SLACK, (node0, node1)


@pytest.mark.multiprocess
def test_a_rank_outside_the_network_is_a_link_error_not_a_hang(network: NetworkSpec) -> None:
    t0 = time.perf_counter()
    with pytest.raises(RankFailure, match=r"not issued on ranks \[3\]"):
        spawn(paced_rank, 4, (dataclasses.replace(network, issue_wait_s=1.0), True), timeout_s=90)
    assert time.perf_counter() - t0 < 60


def empty_part_gather(rank: int, world: int, spec: NetworkSpec) -> tuple[float, float]:
    """Rank 1's part is empty: rank 0 sends alone, so its real all-gather is done before rank 1,
    asleep for 0.1 s, has issued the collective (through the communicator: a flat wire)."""
    from poplar.comm import Communicator

    comm = Communicator()
    comm.all_reduce(torch.zeros(1))  # start together (outside the network)
    with comm.observed(VirtualNetwork(spec, rank)):
        if rank == 1:
            time.sleep(0.1)
        issue = time.perf_counter()
        comm.all_gather(torch.zeros(1000), torch.ones(1000 if rank == 0 else 0), sizes=[1000, 0])
        return issue, time.perf_counter()


@pytest.mark.multiprocess
def test_a_rank_done_before_an_empty_part_was_issued_waits_for_its_issue() -> None:
    spec = NetworkSpec.create(Topology.of_sizes([1, 1]), (NODE0, NODE0), CROSS)
    try:
        (issue0, end0), (issue1, end1) = spawn(empty_part_gather, 2, (spec,), timeout_s=60)
    finally:
        spec.remove()
    # both leave at rank 1's issue + the cross link's time, not at rank 0's real end (long before)
    assert end0 > issue1 + CROSS.latency_s - 0.001 and abs(end0 - end1) < 0.005 + SLACK, (issue0, end0, issue1, end1)


# the profiler's link probes on an emulated network whose links are far slower than this
# machine's gloo: the probes time the network, not gloo (the profiler's part, each probe on its
# own group's link, is checked on scripted links in tests/profiler/test_links.py)
PROBE_NODE0 = LinkSpeed(bandwidth_bytes_per_s=4e6, latency_s=5e-3)
PROBE_NODE1 = LinkSpeed(bandwidth_bytes_per_s=2e6, latency_s=5e-3)
PROBE_CROSS = LinkSpeed(bandwidth_bytes_per_s=1e6, latency_s=10e-3)
PROBE_SIZES = (2 ** 14, 2 ** 16)


def observed_links_worker(rank: int, world: int, spec: NetworkSpec) -> Links:
    comm = Communicator()
    with comm.observed(VirtualNetwork(spec, rank)):
        return measure_links(comm, spec.topology, PROBE_SIZES, reps=2, timeout_s=60)


@pytest.mark.multiprocess
def test_the_profilers_link_probes_time_the_emulated_links() -> None:
    spec = NetworkSpec.create(Topology.of_sizes([2, 2]), (PROBE_NODE0, PROBE_NODE1), PROBE_CROSS)
    try:
        results = spawn(observed_links_worker, 4, (spec,), timeout_s=180)
    finally:
        spec.remove()
    links = results[0]
    assert all(r == links for r in results[1:])
    # each probe is heard on its own group's global ranks and link: each node its own speed,
    # the pair of first ranks the cross-node one, the flat ring the cross-node link that paces it
    for measured, declared in ((links.intra[0], PROBE_NODE0), (links.intra[1], PROBE_NODE1),
                               (links.cross, PROBE_CROSS), (links.flat, PROBE_CROSS)):
        assert measured.bandwidth_bytes_per_s == pytest.approx(declared.bandwidth_bytes_per_s, rel=0.25)
