"""Injected drift: a fault schedule slows a virtual device from one iteration to another and
shrinks its memory from an iteration on, following the attached runtime's iteration."""

from __future__ import annotations

import pytest
import torch

from poplar.zero.config import ZeroConfig
from poplar.emulation.emulate import cluster_devices
from poplar.emulation.faults import FaultSchedule
from poplar.profiler.local_comm import local_engine
from poplar.emulation.virtual_device import VirtualDevice
from poplar.emulation.cluster import ClusterSpec
from poplar.zero.failures import FailureKind, IterationFailed
from tests.toy import loss_fn, make_model, make_optimizer

PAIR = ClusterSpec("pair", [{"type": "V100-16G", "count": 1}, {"type": "T4-16G", "count": 1}])


def test_schedule_windows() -> None:
    s = FaultSchedule(slow_factor=2.0, slow_from=3, slow_until=5, memory_factor=0.5, memory_from=4)
    assert [s.slow_at(k) for k in (None, 0, 2, 3, 4, 5, 9)] == [1.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0]
    assert [s.capacity_at(1000, k) for k in (None, 3, 4, 10)] == [1000, 1000, 500, 500]
    assert FaultSchedule.from_dict(s.to_dict()) == s
    for bad, match in [({"slow_factor": 0}, "slow_factor"), ({"memory_factor": 1.5}, "memory_factor"),
                       ({"slow_from": -1}, "slow_from"), ({"slow_from": 4, "slow_until": 4}, "slow_until")]:
        with pytest.raises(ValueError, match=match):
            FaultSchedule(**bad)


def test_virtual_device_follows_the_runtime_iteration() -> None:
    torch.manual_seed(0)
    device = cluster_devices(PAIR, 1e-5, 1e-3, faults={0: FaultSchedule(slow_factor=3.0, slow_from=1,
                                                                          memory_factor=0.5, memory_from=2)})[0]
    base_time, base_cap = device.time_s(4), device.capacity_bytes
    model = make_model()
    runtime = local_engine(model, make_optimizer(model, "sgd"), world_size=1, rank=0, zero_stage=ZeroConfig(0),
                           device=torch.device("cpu"))
    with device.attach(runtime), device.unpadded():
        assert device.time_s(4) == base_time and device.capacity_bytes == base_cap  # iteration 0
        runtime.train_step(torch.randint(0, 37, (1, 6)), loss_fn)
        assert device.time_s(4) == pytest.approx(3 * base_time) and device.capacity_bytes == base_cap
        runtime.train_step(torch.randint(0, 37, (1, 6)), loss_fn)
        assert device.capacity_bytes == base_cap // 2
    assert device.time_s(4) == base_time  # detached: no clock, no fault


def test_memory_fault_raises_out_of_memory_at_its_iteration() -> None:
    model = make_model()
    runtime = local_engine(model, make_optimizer(model, "sgd"), world_size=1, rank=0, zero_stage=ZeroConfig(0),
                           device=torch.device("cpu"))
    device = VirtualDevice("v", 40_000)
    device.faults = FaultSchedule(memory_factor=0.25, memory_from=1)
    with device.attach(runtime):
        runtime.train_step(torch.randint(0, 37, (1, 6)), loss_fn)  # fits 40 kB
        with pytest.raises(IterationFailed) as info:
            runtime.train_step(torch.randint(0, 37, (1, 6)), loss_fn)  # not 10 kB
    assert info.value.failures == {0: FailureKind.OUT_OF_MEMORY} and info.value.only_out_of_memory
    assert runtime.iteration == 1  # no step taken
