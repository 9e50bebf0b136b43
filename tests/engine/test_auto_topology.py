"""Auto mode on a cluster that spans machines: 4 emulated ranks as two nodes of 2 joined by a
slow network. The profile measures each link on the emulated network, the planner chooses
hierarchical collectives, the engine runs them, and the ledger has cross-node records only for
the exchange step of the sharded collectives."""

from __future__ import annotations

import math

import pytest
import torch

import poplar
from poplar.auto import AutoOptions
from poplar.process.launch import spawn
from poplar.emulation import cluster_devices
from poplar.emulation.virtual_network import NetworkSpec
from poplar.engine import PoplarEngine
from poplar.train import ReportOptions
from poplar.types.profiles import LinkSpeed
from poplar.types.topology import Link, Topology
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks
from poplar.zero.config import ZeroConfig

TOPOLOGY = Topology.of_sizes([2, 2])
FAST = LinkSpeed(bandwidth_bytes_per_s=2e8, latency_s=1e-3)
SLOW = LinkSpeed(bandwidth_bytes_per_s=1e7, latency_s=2e-3)  # the model's gradients: ~0.03 s flat
GBS = 16


def auto_rank(rank: int, world: int, network: NetworkSpec) -> dict:
    torch.manual_seed(0)
    device = cluster_devices("A", 1e-3, 1.0, link=network)[rank]
    data = TextBlocks(seq_len=16)
    model = create_model("llama-tiny", seed=0, max_seq_len=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    engine = PoplarEngine(model, optimizer, zero_stage=ZeroConfig(2, topology=TOPOLOGY), global_batch_size=GBS,
                          loss_fn=llama_loss_fn,
                          auto=AutoOptions(profile_data=data, device=device, repeats=1, exposure_precision=0,
                                           max_batch=8, store=None, progress=False,
                                           # every GPU in the step: over this link the planner may
                                           # rather leave a node out (tests/planner/test_participation.py)
                                           require_all_ranks=True))
    fit = poplar.fit(engine, data, 2, report=ReportOptions(log_every=0, progress=False))
    records = [(r.op, r.phase, r.link) for r in engine.comm_ledger.of(iteration=engine.iteration - 1)]
    out = {"plan": engine.plan, "links": engine.profile.comm.links, "losses": fit.losses, "records": records}
    engine.close()
    return out


@pytest.mark.multiprocess
def test_auto_mode_measures_each_link_and_runs_hierarchical_collectives_over_a_slow_network() -> None:
    network = NetworkSpec.create(TOPOLOGY, (FAST, FAST), SLOW)
    try:
        results = spawn(auto_rank, 4, (network,), timeout_s=400, collective_timeout_s=200)
    finally:
        network.remove()
    links = results[0]["links"]
    assert links.topology == TOPOLOGY and links.cross is not None and len(links.intra) == 2
    # measured on the emulated links (20x apart): the cross-node link is the slow one, each node's
    # the fast one (how close each probe comes to its link: tests/emulation/test_network_pacing.py)
    assert links.cross.bandwidth_bytes_per_s < 0.5 * min(x.bandwidth_bytes_per_s for x in links.intra)
    for res in results:
        assert res["plan"].hierarchical and res["plan"].predicted_iteration_s > 0
        assert all(math.isfinite(x) for x in res["losses"])
        sharded = [(op, link) for op, _, link in res["records"] if op in ("reduce_scatter", "all_gather")]
        assert {link for _, link in sharded} == {Link.INTRA, Link.CROSS}, sharded
        # cross-node records only where a hierarchical collective crosses: its exchange step
        assert all(op in ("reduce_scatter", "all_gather") for op, _, link in res["records"] if link is Link.CROSS)
        assert all(link is Link.FLAT for op, _, link in res["records"] if op == "all_reduce")


def test_an_unknown_way_of_collectives_is_named() -> None:
    model = create_model("llama-tiny", seed=0, max_seq_len=16)
    with pytest.raises(ValueError, match="AutoOptions.collectives must be one of .*'hierarchical'.*got 'ring'"):
        PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), global_batch_size=4, loss_fn=llama_loss_fn,
                     auto=AutoOptions(profile_data=TextBlocks(seq_len=16), collectives="ring", store=None))
