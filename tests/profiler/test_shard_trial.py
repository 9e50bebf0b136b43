"""The trial step that confirms a plan's shard weights: every rank runs its row's largest
micro-batch at the plan's weights on a local runtime and the ranks agree on where it did not
fit; the local runtime's shards follow the weights."""

from __future__ import annotations

import pytest
import torch

from poplar.comm import Communicator
from poplar.process.launch import spawn
from poplar.emulation import VirtualDevice
from poplar.profiler.local_comm import local_engine
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, confirm_plan_memory
from poplar.types.plans import Plan, RankPlan
from poplar.zero.config import ZeroConfig
from tests.toy import SEQ, VOCAB, loss_fn, make_model

WEIGHTS = (3.0, 1.0)
PLAN = Plan([RankPlan(6, 2, shard_weight=WEIGHTS[0]), RankPlan(2, 1, 1, shard_weight=WEIGHTS[1])], zero_stage=3)


def _job() -> ProfileJob:
    return ProfileJob(make_model, loss_fn, lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)),
                      options=ProfileOptions(zero_stage=3))


def trial_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    comm = Communicator()
    out = {}
    for name, capacity in (("roomy", 10**9), ("short", 2_000)):
        device = VirtualDevice("dev", capacity if rank == 1 else 10**9)
        device.pad = False
        out[name] = confirm_plan_memory(_job(), device, comm, PLAN)
    return out


@pytest.mark.multiprocess
def test_the_trial_names_the_ranks_where_the_plan_does_not_fit() -> None:
    results = spawn(trial_worker, 2, timeout_s=120)
    for res in results:
        assert res["roomy"] == [] and res["short"] == [1], res


def test_local_runtime_shards_follow_the_weights() -> None:
    sharded = []
    for rank in range(2):
        model = make_model()
        runtime = local_engine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), world_size=2,
                               rank=rank, zero_stage=ZeroConfig(3), device=torch.device("cpu"), shard_weights=WEIGHTS)
        sharded.append(sum(b.shard_numel for b in runtime.stage.blocks))
    assert sharded[0] == pytest.approx(3 * sharded[1], rel=0.1)
