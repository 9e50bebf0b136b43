"""The profiler measures each link: the fit of latency and bandwidth on synthetic timings, and on
4 gloo ranks declared as nodes of 2 + 2 (and 3 + 1) one link per node and the cross-node link,
the same on every rank; with one node, the flat link alone, as always. On scripted links
(``tests.scripted_device.ScriptedLink``) each probe gives back its own link's line."""

from __future__ import annotations

import numpy as np
import pytest

from poplar.comm import Communicator
from poplar.process.launch import spawn
from poplar.profiler.links import DEFAULT_COMM_SIZES, NO_LINK, fit_link, measure_links, probe_sizes
from poplar.types.profiles import CommProfile, Links, LinkSpeed, Profile, ProfilePoint, RankProfile
from poplar.types.topology import Link, Topology
from tests.scripted_device import LinkScript, ScriptedClock, ScriptedLink

SIZES = (2 ** 12, 2 ** 16)


def test_the_fit_recovers_latency_and_bandwidth_from_timings() -> None:
    rng = np.random.default_rng(0)
    bus = [float(x) for x in np.geomspace(1e4, 1e8, 12)]
    seconds = [30e-6 + x / 5e9 for x in bus]
    exact = fit_link(bus, seconds)
    assert exact.bandwidth_bytes_per_s == pytest.approx(5e9, rel=1e-6) and exact.latency_s == pytest.approx(30e-6)
    noisy = fit_link(bus, [s * (1 + 0.01 * rng.standard_normal()) for s in seconds])
    assert noisy.bandwidth_bytes_per_s == pytest.approx(5e9, rel=0.05)
    # latency-bound everywhere (falling times): the best throughput seen, no latency
    flat = fit_link([1e3, 1e4], [2e-3, 1e-3])
    assert flat == LinkSpeed(1e7, 0.0)


def links_worker(rank: int, world: int) -> list[Links]:
    comm = Communicator()
    return [measure_links(comm, topology, SIZES, reps=2, timeout_s=60)
            for topology in (None, Topology.single(4), Topology.of_sizes([2, 2]), Topology.of_sizes([3, 1]))]


def test_the_probes_time_no_buffer_larger_than_the_model() -> None:
    assert probe_sizes(100 * 2 ** 20) == probe_sizes(2 ** 22 + 1) == DEFAULT_COMM_SIZES
    assert probe_sizes(2 ** 22) == (2 ** 14, 2 ** 17, 2 ** 20, 2 ** 22)
    assert probe_sizes(383_000) == (2 ** 14, 2 ** 17, 383_000)  # llama-tiny: the model's bytes last
    assert probe_sizes(20_000) == (2 ** 14, 20_000)
    assert probe_sizes(1000) == (2 ** 14, 2 ** 17)  # two sizes at least: a line needs two points


@pytest.mark.multiprocess
def test_nodes_of_2_and_2_measure_two_intra_links_and_a_cross_link() -> None:
    results = spawn(links_worker, 4, timeout_s=120)
    for r in results[1:]:
        assert [x.intra for x in r] == [x.intra for x in results[0]]
        assert [x.cross for x in r] == [x.cross for x in results[0]]
    one, single, two, uneven = results[0]
    for links in (one, single):
        assert links.topology is None and links.intra == () and links.cross is None
        assert links.bandwidth_bytes_per_s > 0 and links.backend == "gloo"
    assert two.topology == Topology.of_sizes([2, 2]) and two.spans_nodes
    assert len(two.intra) == 2 and two.cross is not None
    for x in (*two.intra, two.cross):
        assert x.bandwidth_bytes_per_s > 0 and x.latency_s >= 0 and x != NO_LINK
    assert uneven.intra[1] == NO_LINK and uneven.intra[0] != NO_LINK and uneven.cross != NO_LINK
    # what the profiler measured is what a profile keeps, on disk too
    ranks = [RankProfile(i, "cpu", 1, [ProfilePoint(1, 0.01)]) for i in range(4)]
    prof = Profile(1, 4, 10, 40, ranks, CommProfile(two))
    assert Profile.from_dict(prof.to_dict()).comm.links == two


def test_the_links_are_described_per_tier() -> None:
    assert Links(2e9, 25e-6, "gloo").describe() == ["collectives (gloo): bus bandwidth 2.000 GB/s, latency 25 us"]
    tiers = Links.tiered(Topology.of_sizes([2, 1]), (LinkSpeed(8e9, 5e-6), NO_LINK), LinkSpeed(1e9, 40e-6), "nccl")
    assert tiers.describe() == ["collectives (nccl): bus bandwidth 1.000 GB/s, latency 40 us",
                                "  node 0 (ranks 0-1): bus bandwidth 8.000 GB/s, latency 5 us",
                                "  node 1 (rank 2): no link inside",
                                "  between nodes: bus bandwidth 1.000 GB/s, latency 40 us"]


# scripted links far slower than this machine's gloo (seconds a probe): the probes time them
NODE0 = LinkScript(bandwidth_bytes_per_s=4e5, latency_s=0.5)
NODE1 = LinkScript(bandwidth_bytes_per_s=2e5, latency_s=0.5)
CROSS = LinkScript(bandwidth_bytes_per_s=1e5, latency_s=1.0)
FLAT = LinkScript(bandwidth_bytes_per_s=5e4, latency_s=2.0)
PROBE_SIZES = (2 ** 14, 2 ** 16)


def scripted_links_worker(rank: int, world: int) -> Links:
    clock = ScriptedClock()
    link = ScriptedLink(clock, {(Link.INTRA, (0, 1)): NODE0, (Link.INTRA, (2, 3)): NODE1, Link.CROSS: CROSS,
                                Link.FLAT: FLAT})
    comm = Communicator()
    with clock.installed(), comm.observed(link):
        return measure_links(comm, Topology.of_sizes([2, 2]), PROBE_SIZES, reps=2, timeout_s=60)


@pytest.mark.multiprocess
def test_every_link_probe_times_its_own_link() -> None:
    """Each probe is heard on its own group's link: each node's, the first ranks' cross-node one,
    and the flat ring; the fit gives back each scripted line (the real gloo time is a
    thousandth of a scripted probe)."""
    results = spawn(scripted_links_worker, 4, timeout_s=180)
    links = results[0]
    assert all(r == links for r in results[1:])
    for measured, script in ((links.intra[0], NODE0), (links.intra[1], NODE1), (links.cross, CROSS),
                             (links.flat, FLAT)):
        assert measured.bandwidth_bytes_per_s == pytest.approx(script.bandwidth_bytes_per_s, rel=0.03), measured
        assert measured.latency_s == pytest.approx(script.latency_s, abs=0.05), measured
