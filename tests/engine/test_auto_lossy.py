"""Auto mode's lossy door on a job that spans nodes (2 gloo ranks as two nodes, a reused profile
whose link between the nodes is slow, every rank kept): with ``allow_lossy`` the engine's plan
quantizes across the nodes, records the options and the saving on every rank, and its first step
sends fewer bytes; without it the same profile's plan is exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar.auto import AutoOptions
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.types.profiles import CommProfile, Links, LinkSpeed, Profile, ProfilePoint, RankProfile
from poplar.types.topology import Topology
from poplar.zero.config import ZeroConfig

TOPOLOGY = Topology.of_sizes([1, 1])


def _loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (module(batch) ** 2).mean()


def two_node_profile() -> Profile:
    """10 M parameters over a 1 GB/s link between the nodes: the collectives bind."""
    links = Links.tiered(TOPOLOGY, [LinkSpeed(1e11, 1e-5)] * 2, LinkSpeed(1e9, 5e-5), "gloo")
    ranks = [RankProfile(r, "X", 16, [ProfilePoint(b, 0.002 + 0.001 * b) for b in (1, 2, 4, 8, 16)])
             for r in range(2)]
    return Profile(3, 2, 10_000_000, 40_000_000, ranks, CommProfile(links))


def auto_rank(rank: int, world: int, allow_lossy: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                          zero_stage=ZeroConfig(3, topology=TOPOLOGY), global_batch_size=64, loss_fn=_loss,
                          auto=AutoOptions(profile=two_node_profile(), progress=False, store=None,
                                           allow_lossy=allow_lossy, require_all_ranks=True))
    plan = engine.plan
    batch = torch.randn(64, 4)[plan.sample_offsets()[rank]:][:plan.ranks[rank].num_samples].clone()
    loss = engine.train_step(batch, _loss)  # the runtime runs the plan's collectives: quantized or exact
    # the parameter gathers and gradient reduce-scatters: a flat ring over the two nodes, every byte crosses
    sent = sum(r.bytes for r in engine.comm_ledger.of(iteration=0) if r.op in ("all_gather", "reduce_scatter"))
    engine.close()
    return {"compression": plan.compression, "record": plan.choice.compression_choice, "table": plan.table(),
            "loss": loss, "sent": sent}


@pytest.mark.multiprocess
def test_allow_lossy_reaches_the_engines_plan_on_every_rank_and_its_collectives() -> None:
    runs = {lossy: spawn(auto_rank, 2, (lossy,), timeout_s=120, collective_timeout_s=60) for lossy in (True, False)}
    for out in runs.values():
        assert out[0]["compression"] == out[1]["compression"] and out[0]["loss"] == out[1]["loss"]
    lossy, exact = runs[True], runs[False]
    record = lossy[0]["record"]
    assert lossy[0]["compression"].lossy and record.chosen == lossy[0]["compression"] and record.saving > record.tie
    assert "chosen (allow_lossy): predicted" in lossy[1]["table"]
    assert not exact[0]["compression"].lossy and exact[0]["record"] is None
    # the runtime quantized what crossed the nodes: fewer bytes than exact
    assert 0 < lossy[0]["sent"] < exact[0]["sent"]
    # the first forward already ran on int8-gathered weights (a step of 1/127 of a block's largest)
    assert 0 < abs(lossy[0]["loss"] - exact[0]["loss"]) <= 1e-2 * abs(exact[0]["loss"])
