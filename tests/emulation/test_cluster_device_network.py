"""An emulated cluster that spans nodes is wired as declared on the path the command line uses
(``ClusterDevice``): when profiling starts every rank joins the cluster's virtual network, each
node's link and the cross-node one at the emulation's scales, no faster than the machine; its
collectives then pay their link, and the board's file is gone while the ranks still map it. The
command line's doors give the engine the cluster's nodes (``poplar demo``'s ZeRO config, ``poplar
train``'s config), and refuse a declared topology that is not the cluster's."""

from __future__ import annotations

import os
import time

import pytest
import torch

from poplar.comm import Communicator
from poplar.process.launch import spawn
from poplar.emulation.calibration import Scales
from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.cluster_device import cluster_device
from poplar.emulation.cluster_network import NetworkScales
from poplar.emulation.presets import LINKS, SLOW_NETWORK
from poplar.emulation.virtual_network import VirtualNetwork
from poplar.planner.cost_model import bus_bytes
from poplar.profiler.job import model_size
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer
from poplar.types.topology import Link, Topology, Wire
from tests.toy import loss_fn, make_model

CLUSTER = ClusterSpec.builtin("A").with_network(SLOW_NETWORK)  # 2 + 2: NVLink, PCIe 4, Ethernet between
SCALES = Scales(1e-3, 1.0)  # given: no calibration run


def _sample(batch: int) -> torch.Tensor:
    return torch.zeros(batch, 5, dtype=torch.long)


def device_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    device = cluster_device(CLUSTER, rank, scales=SCALES)
    comm = Communicator()
    job = ProfileJob(make_model, loss_fn, _sample, default_optimizer, ProfileOptions())
    device.prepare_profiling(comm, job, None)  # what profiling (auto mode, poplar profile) does first
    link = device.link
    assert isinstance(link, VirtualNetwork)
    comm.all_reduce(torch.zeros(1))  # every rank has joined: the board's file is gone by now
    board_left = os.path.exists(link.spec.board_path)
    numel = model_size(make_model())[1] // 4 // world * world
    paced = link.paced_collectives
    t0 = time.perf_counter()
    with device.pacing(comm):  # one flat all-reduce of the model's bytes over both nodes
        comm.all_reduce(torch.ones(numel))
    elapsed = time.perf_counter() - t0
    return {"network": link.spec, "board_left": board_left, "elapsed": elapsed, "numel": numel,
            "paced": link.paced_collectives - paced}


@pytest.mark.multiprocess
def test_a_cluster_device_joins_its_clusters_network_and_its_collectives_pay_the_link() -> None:
    results = spawn(device_rank, 4, timeout_s=120, collective_timeout_s=60)
    network = results[0]["network"]
    assert all(r["network"] == network for r in results)  # one network, every rank on it
    assert network.topology == Topology.of_sizes([2, 2]) and not any(r["board_left"] for r in results)
    # NVLink is faster than any CPU collective: node 0's link is the machine's floor itself; the
    # others are the declared links at the emulation's scales, no faster than that floor
    floor = network.intra[0]
    scales = NetworkScales.for_model(SCALES.time, model_size(make_model())[1], floor)
    assert network.intra[1] == scales.emulate(LINKS["pcie4"])
    assert network.cross == scales.emulate(LINKS[SLOW_NETWORK])
    assert network.cross.bandwidth_bytes_per_s < network.intra[1].bandwidth_bytes_per_s
    # the flat ring crosses the slow link: paced, it ends no sooner than that link carries it (the
    # emulator sleeps until then; load can only make it later)
    nbytes = 4 * results[0]["numel"]
    priced = network.price("all_reduce", nbytes, Wire(Link.FLAT, (0, 1, 2, 3))).seconds
    assert priced >= bus_bytes("all_reduce", nbytes, 4) / network.cross.bandwidth_bytes_per_s
    for r in results:
        assert r["paced"] == 1 and r["elapsed"] >= priced


def test_the_command_lines_doors_give_the_engine_the_clusters_nodes() -> None:
    from poplar.cli.demo import zero_config
    from poplar.cli.train import with_cluster_nodes
    from poplar.train.config import ConfigError, TrainConfig

    assert zero_config(ClusterSpec.builtin("A"), 3).topology == Topology.of_sizes([2, 2])
    assert zero_config(ClusterSpec.builtin("B"), 2).topology is None  # one machine: as before
    cfg = with_cluster_nodes(TrainConfig.from_dict({"poplar": {"cluster": "C-4+4"}}))
    assert cfg.topology == Topology.of_sizes([4, 4])
    same = with_cluster_nodes(TrainConfig.from_dict({"poplar": {"cluster": "A", "topology": [[0, 1], [2, 3]]}}))
    assert same.topology == Topology.of_sizes([2, 2])
    assert with_cluster_nodes(TrainConfig.from_dict({"poplar": {"cluster": "B"}})).topology is None
    with pytest.raises(ConfigError, match=r"is not the nodes of the emulated cluster 'A'.*remove \"poplar.topology\""):
        with_cluster_nodes(TrainConfig.from_dict({"poplar": {"cluster": "A", "topology": [[0, 1, 2], [3]]}}))
    with pytest.raises(ConfigError, match="is not the nodes of the emulated cluster 'B'"):
        with_cluster_nodes(TrainConfig.from_dict({"poplar": {"cluster": "B", "topology": [[0, 1], [2, 3]]}}))
