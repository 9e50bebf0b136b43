"""The virtual network's arithmetic, driven by hand: every rank's end in one process on one
board, a manual clock, the wires given directly. Collectives on different nodes overlap; a flat
ring over several nodes waits for the cross-node link and is priced by it; an exchange is priced
per node port; a one-node network paces exactly as the virtual link; a missing issue is a
``LinkError`` after ``issue_wait_s``, not a hang."""

from __future__ import annotations

import pytest

from poplar.emulation.virtual_link import LinkError, LinkSpec, VirtualLink
from poplar.emulation.virtual_network import DEPTH, NetworkSpec, VirtualNetwork, link_seconds
from poplar.planner.cost_model import bus_bytes
from poplar.types.profiles import LinkSpeed
from poplar.types.topology import Link, Topology, Wire

FAST = LinkSpeed(bandwidth_bytes_per_s=1e6, latency_s=0.010)  # node 0
SLOW = LinkSpeed(bandwidth_bytes_per_s=0.5e6, latency_s=0.020)  # node 1
CROSS = LinkSpeed(bandwidth_bytes_per_s=1e5, latency_s=0.030)
NODE0, NODE1, WORLD = Wire(Link.INTRA, (0, 1)), Wire(Link.INTRA, (2, 3)), Wire.world(4)
EXCHANGE = Wire(Link.CROSS, (0, 1, 2, 3))


class ManualClock:
    """Time moves only when a rank sleeps (a rank waiting for another's issue, or paced)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def network() -> NetworkSpec:
    spec = NetworkSpec.create(Topology.of_sizes([2, 2]), (FAST, SLOW), CROSS, issue_wait_s=1.0)
    yield spec
    spec.remove()


def ranks(spec: NetworkSpec, clock: ManualClock) -> list[VirtualNetwork]:
    return [VirtualNetwork(spec, r, clock=clock) for r in range(spec.world_size)]


def collective(nets: list[VirtualNetwork], op: str, nbytes: int, wire: Wire) -> list:
    """Every rank of ``wire`` issues it (in rank order, now) and is done with it; the tickets."""
    tickets = [nets[r].issued(op, nbytes, wire) for r in wire.ranks]
    for r, t in zip(wire.ranks, tickets):
        nets[r].done(t)
    return tickets


def test_intra_node_collectives_on_two_nodes_overlap(network: NetworkSpec) -> None:
    clock = ManualClock()
    nets = ranks(network, clock)
    t0 = clock.t
    a = [nets[r].issued("all_reduce", 4000, NODE0) for r in (0, 1)]
    c = [nets[r].issued("all_gather", 4000, NODE0) for r in (0, 1)]  # issued at once, behind a
    b = [nets[r].issued("all_reduce", 4000, NODE1) for r in (2, 3)]
    for r, t in zip((0, 1, 0, 1, 2, 3), a + c + b):
        nets[r].done(t)
    # a and b start at once, each on its own node's link at that link's speed: node 0 is done
    # before node 1, not after it
    assert {t.start for t in a + b} == {t0}
    assert {t.end for t in a} == {t0 + link_seconds(FAST, bus_bytes("all_reduce", 4000, 2))}
    assert {t.end for t in b} == {t0 + link_seconds(SLOW, bus_bytes("all_reduce", 4000, 2))}
    # c queued behind a on node 0's link only
    assert {t.start for t in c} == {a[0].end}
    assert {t.end for t in c} == {a[0].end + link_seconds(FAST, bus_bytes("all_gather", 4000, 2))}
    assert b[0].start < c[0].start  # node 1's collective did not queue behind node 0's


def test_a_flat_ring_over_both_nodes_waits_for_the_cross_link_and_is_priced_by_it(network: NetworkSpec) -> None:
    clock = ManualClock()
    nets = ranks(network, clock)
    issued = [nets[r].issued("exchange", 2000, EXCHANGE) for r in range(4)]  # holds the cross link
    flat = [nets[r].issued("all_reduce", 4000, WORLD) for r in range(4)]  # ready at once, behind it
    for r in range(4):
        nets[r].done(issued[r])
    for r in range(4):
        nets[r].done(flat[r])
    assert {t.start for t in flat} == {issued[0].end}
    # the ring's bus volume over the slowest link it has hops on: the cross-node link
    for t in flat:
        assert t.end - t.start == pytest.approx(link_seconds(CROSS, bus_bytes("all_reduce", 4000, 4)))
    # it held every link: an intra-node collective issued meanwhile starts after it
    (intra, _) = collective(nets, "all_reduce", 4000, NODE1)
    assert intra.start == flat[0].end


def test_a_flat_ring_is_paced_by_its_slowest_link() -> None:
    crawling = LinkSpeed(bandwidth_bytes_per_s=1e3, latency_s=0.001)  # node 1's link slower than the cross-node one
    spec = NetworkSpec.create(Topology.of_sizes([2, 2]), (FAST, crawling), CROSS)
    try:
        bus = bus_bytes("reduce_scatter", 4000, 4)
        assert spec.price("reduce_scatter", 4000, WORLD).seconds == link_seconds(crawling, bus)
        # ranks 0, 1, 2: node 1 holds one of them and has no intra hop
        three = Wire(Link.FLAT, (0, 1, 2))
        assert spec.price("reduce_scatter", 4000, three).seconds == link_seconds(CROSS, 
            bus_bytes("reduce_scatter", 4000, 3))
        assert spec.price("reduce_scatter", 4000, three).links == (0, 1, 2)
    finally:
        spec.remove()


def test_an_exchange_takes_the_busiest_ports_time(network: NetworkSpec) -> None:
    clock = ManualClock()
    nets = ranks(network, clock)
    # 2 nodes: each port sends half of the bytes crossing, at the cross link's bandwidth
    (t, *_) = collective(nets, "exchange", 2000, EXCHANGE)
    assert t.end - t.start == pytest.approx(CROSS.latency_s + 1000 / CROSS.bandwidth_bytes_per_s)
    # an exchange between the nodes' first ranks only: the same, on the same link
    assert network.price("exchange", 2000, Wire(Link.CROSS, (0, 2))) == network.price("exchange", 2000, EXCHANGE)
    # a ring over one rank per node on the cross wire is a ring: its bus volume on the cross link
    assert network.price("all_reduce", 2000, Wire(Link.CROSS, (0, 2))).seconds == link_seconds(CROSS, 
        bus_bytes("all_reduce", 2000, 2))
    three = NetworkSpec(Topology.of_sizes([1, 1, 1]), (FAST,) * 3, CROSS, network.board_path)
    assert three.price("exchange", 3000, Wire(Link.CROSS, (0, 1, 2))).seconds == pytest.approx(
        CROSS.latency_s + 1000 / CROSS.bandwidth_bytes_per_s)


def schedule(ends: list, make, clock: ManualClock) -> tuple[int, int]:
    """Four ranks on one link: a collective, one a rank issues late, two issued back to back
    (async) and waited for in order; every rank's ends appended to ``ends``."""
    links = [make(r) for r in range(4)]
    for step in range(3):
        tickets = []
        for r, link in enumerate(links):
            clock.sleep(0.004 * r if step == 1 else 0.0)  # step 1: rank r issues 4r ms late
            tickets.append(link.issued("all_gather", 10_000 + step, Wire.world(4)))
        for link, t in zip(links, tickets):
            link.done(t)
            ends.append(t.end)
    pending = [[link.issued("reduce_scatter", 8000, Wire.world(4)) for _ in range(2)] for link in links]
    clock.sleep(0.5)  # their real collectives outlast the link: late
    for link, tickets in zip(links, pending):
        for t in tickets:
            link.done(t)
            ends.append(t.end)
    return sum(x.paced_collectives for x in links), sum(x.late_collectives for x in links)


def test_a_one_node_network_paces_exactly_as_the_virtual_link() -> None:
    link = LinkSpec.create(0.003, 2e6, 4)
    single = NetworkSpec.single(link)
    try:
        on_link, on_network, link_clock, network_clock = [], [], ManualClock(), ManualClock()
        counts_link = schedule(on_link, lambda r: VirtualLink(link, r, clock=link_clock), link_clock)
        counts_network = schedule(on_network, lambda r: VirtualNetwork(single, r, clock=network_clock),
                                  network_clock)
    finally:
        link.remove()
        single.remove()
    assert on_network == on_link  # bit for bit
    assert counts_network == counts_link == (20, 8)
    assert link_clock.t == network_clock.t


def test_a_collective_a_rank_never_issues_is_a_link_error_not_a_hang(network: NetworkSpec) -> None:
    clock = ManualClock()
    nets = ranks(network, clock)
    waiting = nets[2].issued("all_reduce", 100, NODE1)
    with pytest.raises(LinkError, match=r"not issued on ranks \[3\]"):
        nets[2].done(waiting)
    assert clock.t >= 100.0 + network.issue_wait_s


def test_wires_the_topology_cannot_carry_are_clear_errors(network: NetworkSpec) -> None:
    net = VirtualNetwork(network, 0, clock=ManualClock())
    with pytest.raises(LinkError, match="intra-node collective on ranks \\[0, 2\\] spans nodes"):
        net.issued("all_reduce", 100, Wire(Link.INTRA, (0, 2)))
    with pytest.raises(LinkError, match="cross-node collective on ranks \\[0, 1\\] of one node"):
        net.issued("exchange", 100, Wire(Link.CROSS, (0, 1)))
    with pytest.raises(LinkError, match="not one of"):
        net.issued("all_reduce", 100, NODE1)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        NetworkSpec(Topology.of_sizes([2, 2]), (FAST, LinkSpeed(0.0, 0.001)), CROSS, network.board_path)
    with pytest.raises(ValueError, match="cross-node link"):
        NetworkSpec(Topology.of_sizes([2, 2]), (FAST, SLOW), None, network.board_path)


def test_a_different_collective_at_the_same_place_is_a_clear_error(network: NetworkSpec) -> None:
    nets = ranks(network, ManualClock())
    nets[0].issued("all_reduce", 100, NODE0)
    with pytest.raises(LinkError, match="is a all_gather here but a all_reduce"):
        nets[1].issued("all_gather", 100, NODE0)


def test_a_subset_of_a_nodes_ranks_and_a_lone_rank(network: NetworkSpec) -> None:
    clock = ManualClock()
    nets = ranks(network, clock)
    # rank 3 left out: ranks 0-2 run a flat ring without it, and nobody waits for rank 3
    (t, *_) = collective(nets, "all_reduce", 3000, Wire(Link.FLAT, (0, 1, 2)))
    assert t.end - t.start == pytest.approx(link_seconds(CROSS, bus_bytes("all_reduce", 3000, 3)))
    # a wire of one rank carries nothing
    lone = nets[3].issued("all_reduce", 3000, Wire(Link.INTRA, (3,)))
    before = clock.t
    nets[3].done(lone)
    assert clock.t == before and nets[3].paced_collectives == 0


def test_rows_are_reused_past_the_boards_depth(network: NetworkSpec) -> None:
    nets = ranks(network, ManualClock())
    for _ in range(DEPTH + 5):
        collective(nets, "all_reduce", 10, NODE0)
    assert nets[0].paced_collectives == DEPTH + 5


def test_a_ranks_end_made_anew_carries_on_from_the_last_one(network: NetworkSpec) -> None:
    """A job that builds a second runtime on the same network (calibration's second precision)
    makes new ends; their collectives are new rows, not the old, finished ones again."""
    clock = ManualClock()
    collective(ranks(network, clock), "all_reduce", 4000, NODE0)
    nets = ranks(network, clock)
    waiting = nets[0].issued("all_reduce", 4000, NODE0)
    # rank 1 has not issued the new collective: it is not done (the old row would say it was)
    with pytest.raises(LinkError, match=r"not issued on ranks \[1\]"):
        nets[0].done(waiting)
