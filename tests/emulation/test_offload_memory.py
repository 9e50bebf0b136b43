"""A virtual device attached to a rank that offloads its optimizer (``RankPlan.offload``) counts
the optimizer state, as after the first step, and under mixed precision the fp32 master shard, as
host memory, not device memory; the rest of its count is unchanged but for ZeRO-3's compute-dtype
shard, which takes the master's place."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from poplar.emulation import VirtualDevice
from poplar.emulation.memory import predicted_optimizer_bytes
from poplar.profiler.local_comm import LocalCommunicator, search_plan
from poplar.profiler.profile_run import default_optimizer
from poplar.types.plans import Offload, Plan
from poplar.workloads import get_workload
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import PlanCheck, ZeroRuntime
from poplar.types.precision import resolve_precision

WORKLOAD = get_workload("token-mlp")
MB = 10 ** 6


def plan_at(batch: int, offload: Offload) -> Plan:
    """Rank 1 of 3 runs ``batch`` samples and keeps its optimizer where ``offload`` says."""
    plan = search_plan(3, 1, batch)
    plan.ranks[1] = dataclasses.replace(plan.ranks[1], offload=offload)
    return plan


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_offloaded_optimizer_is_host_memory(stage: int, precision: str | None) -> None:
    counts = {}
    for offload in (Offload.NONE, Offload.OPTIMIZER):
        torch.manual_seed(0)
        model = WORKLOAD.model_fn()
        engine = ZeroRuntime(model, default_optimizer(model), plan=plan_at(1, offload),
                             zero_stage=ZeroConfig(stage, bucket_size_mb=0.03), mixed_precision=resolve_precision(precision),
                             communicator=LocalCommunicator(3, 1))
        predicted = predicted_optimizer_bytes(engine.optimizer)
        device = VirtualDevice("d", 100 * MB)
        with device.attach(engine):
            before = (device.static_bytes(), device.host_bytes())
            engine.set_plan(plan_at(2, offload), PlanCheck.LOCAL)
            engine.train_step(WORKLOAD.sample_fn(2), WORKLOAD.loss_fn)
            after = (device.static_bytes(), device.host_bytes())
        assert before == after  # the prediction before the first step was right
        counts[offload] = (after, predicted, engine.memory_report())
    (kept, kept_host), predicted, kept_report = counts[Offload.NONE]
    (moved, host), _, report = counts[Offload.OPTIMIZER]
    assert kept_host == 0 and predicted > 0
    shard = report["host_master_params"]
    assert shard > 0 and host == predicted + 2 * shard  # state, fp32 master copy and gradient copy
    assert report["master_params"] == 0
    if precision is None:
        assert kept - moved == predicted  # the device no longer holds the optimizer state
        return
    # mixed precision: nor the fp32 master shard; at ZeRO-3 a bf16 shard (half its bytes) takes its
    # place on the device, at ZeRO-1/2 the bf16 parameters hold this rank's slice already
    assert kept_report["master_params"] == shard
    compute = shard // 2 if stage == 3 else 0
    assert kept - moved == predicted + shard - compute
    assert report["params"] == kept_report["params"] + compute
