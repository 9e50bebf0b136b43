"""Auto mode's lossy door on a job that spans nodes (2 gloo ranks as two nodes, a reused profile
whose link between the nodes is slow): with ``allow_lossy`` the engine's plan quantizes across the
nodes and records the options and the saving on every rank; without it the same profile's plan
is exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar.auto import AutoOptions
from poplar.comm.launch import spawn
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
                                           allow_lossy=allow_lossy))
    plan = engine.plan
    engine.close()
    return {"compression": plan.compression, "record": plan.choice.compression_choice, "table": plan.table()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("allow_lossy", [True, False])
def test_allow_lossy_reaches_the_engines_plan_on_every_rank(allow_lossy: bool) -> None:
    out = spawn(auto_rank, 2, (allow_lossy,), timeout_s=120, collective_timeout_s=60)
    assert out[0]["compression"] == out[1]["compression"]
    if allow_lossy:
        record = out[0]["record"]
        assert out[0]["compression"].lossy and record.chosen == out[0]["compression"] and record.saving > record.tie
        assert "chosen (allow_lossy): predicted" in out[1]["table"]
    else:
        assert not out[0]["compression"].lossy and out[0]["record"] is None
