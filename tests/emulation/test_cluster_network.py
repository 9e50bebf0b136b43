"""Clusters that span machines: nodes and links declared (and refused with the fix), the job's
topology, the inter-node link chosen, and the declared links scaled to the emulation above the
machine's floor."""

from __future__ import annotations

import pytest

from poplar.emulation.cluster import ClusterError, ClusterSpec
from poplar.emulation.cluster_network import NetworkScales, emulated_network
from poplar.emulation.emulate import cluster_devices
from poplar.emulation.presets import FAST_NETWORK, LINKS, SLOW_NETWORK
from poplar.emulation.synthetic import REFERENCE_MODEL
from poplar.emulation.virtual_network import VirtualNetwork, link_seconds
from poplar.types.profiles import LinkSpeed
from poplar.types.topology import Topology


def test_the_papers_clusters_are_two_nodes_with_their_own_links() -> None:
    a, c = ClusterSpec.builtin("A"), ClusterSpec.builtin("C")
    assert a.topology() == Topology(nodes=[[0, 1], [2, 3]])
    assert [link.name for link in a.node_links()] == ["nvlink-a100", "pcie4"]  # NVLink in the A100-80G node
    assert [link.name for link in c.node_links()] == ["pcie4", "pcie3"]
    assert a.network == LINKS[FAST_NETWORK]
    assert ClusterSpec.builtin("A-4+4").topology() == Topology.of_sizes([4, 4])
    assert ClusterSpec.builtin("B").topology() == Topology.single(4)  # one machine, as before


def test_the_inter_node_link_is_chosen_and_kept_in_json() -> None:
    slow = ClusterSpec.builtin("C").with_network(SLOW_NETWORK)
    assert slow.network == LINKS[SLOW_NETWORK]
    assert LINKS[SLOW_NETWORK].bandwidth_gbps < LINKS[FAST_NETWORK].bandwidth_gbps
    assert ClusterSpec.from_dict(slow.to_dict()) == slow
    custom = slow.with_network({"bandwidth_gbps": 3.0, "latency_us": 40.0})
    assert ClusterSpec.from_dict(custom.to_dict()).network == custom.network
    with pytest.raises(ClusterError, match="is one machine"):
        ClusterSpec.builtin("B").with_network(SLOW_NETWORK)


@pytest.mark.parametrize("change, message", [
    ({"nodes": [{"ranks": 2, "link": "pcie4"}, {"ranks": 1, "link": "pcie4"}]}, "hold 3 ranks but it lists 4"),
    ({"nodes": [{"ranks": 2, "link": "warp"}, {"ranks": 2, "link": "pcie4"}]}, "unknown link 'warp'; known"),
    ({"nodes": [{"ranks": 0, "link": "pcie4"}, {"ranks": 4, "link": "pcie4"}]}, "ranks must be an int >= 1"),
    ({"nodes": [{"ranks": 4}]}, "exactly \"ranks\" and \"link\""),
    ({"network": {"bandwidth_gbps": 0, "latency_us": 1}}, "bandwidth_gbps must be a positive number"),
])
def test_bad_nodes_and_links_are_refused_with_the_fix(change: dict, message: str) -> None:
    d = {**ClusterSpec.builtin("A").to_dict(), **change}
    with pytest.raises(ClusterError, match=message):
        ClusterSpec.from_dict(d)


def test_declared_links_scale_like_the_devices_above_the_machines_floor() -> None:
    model_bytes, time_scale = 400_000, 4.0
    scales = NetworkScales.for_model(time_scale, model_bytes)
    ib = LINKS["ib-100g"]
    speed = scales.emulate(ib)
    # a collective of the model's bytes lasts what the declared link takes for the reference
    # model's bytes, times the time scale
    assert link_seconds(speed, model_bytes) == pytest.approx(
        time_scale * (ib.latency_us * 1e-6 + REFERENCE_MODEL.param_bytes / (ib.bandwidth_gbps * 1e9)))
    floor = LinkSpeed(bandwidth_bytes_per_s=20e6, latency_s=0.002)
    floored = NetworkScales.for_model(time_scale, model_bytes, floor)
    nvlink = floored.emulate(LINKS["nvlink-a100"])
    assert nvlink == floor  # faster than the machine can carry in both: the floor
    assert floored.emulate(ib) == LinkSpeed(bandwidth_bytes_per_s=speed.bandwidth_bytes_per_s,
                                            latency_s=floor.latency_s)
    assert floored.clamped(ClusterSpec.builtin("A")) == ["nvlink-a100"]
    network = emulated_network(ClusterSpec.builtin("A").with_network(SLOW_NETWORK), floored)
    try:
        assert network.topology == Topology.of_sizes([2, 2])
        assert network.intra == (floor, floored.emulate(LINKS["pcie4"]))
        assert network.cross == floored.emulate(LINKS[SLOW_NETWORK])
        devices = cluster_devices("A", 1e-3, 1.0, link=network)
        assert [type(d.link) for d in devices] == [VirtualNetwork] * 4
        assert [d.link.rank for d in devices] == [0, 1, 2, 3]
    finally:
        network.remove()


def test_a_cluster_without_nodes_keeps_the_machines_floor_as_its_one_link() -> None:
    floor = LinkSpeed(bandwidth_bytes_per_s=20e6, latency_s=0.002)
    network = emulated_network(ClusterSpec.builtin("B"), NetworkScales.for_model(4.0, 400_000, floor))
    try:
        assert network.intra == (floor,) and network.cross is None
    finally:
        network.remove()
    with pytest.raises(ValueError, match="give NetworkScales a floor"):
        emulated_network(ClusterSpec.builtin("B"), NetworkScales.for_model(4.0, 400_000))


def test_an_emulated_cluster_gives_its_ranks_the_topology_and_its_network() -> None:
    from poplar.emulation.emulate import EmulatedCluster

    cluster = EmulatedCluster(ClusterSpec.builtin("C-4+4"), 1e-4, 3.0)
    assert cluster.topology == Topology.of_sizes([4, 4])
    floor = LinkSpeed(bandwidth_bytes_per_s=20e6, latency_s=0.002)
    network = cluster.network(400_000, floor)
    try:
        expected = NetworkScales.for_model(3.0, 400_000, floor)
        assert network.intra == (expected.emulate(LINKS["pcie4"]), expected.emulate(LINKS["pcie3"]))
        assert network.cross == expected.emulate(LINKS[FAST_NETWORK])
    finally:
        network.remove()
