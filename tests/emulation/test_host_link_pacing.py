"""An emulated GPU's host link: an offloading rank's copies of its optimizer shard (the runtime's
``host_copy`` point) take as long as the preset's nominal PCIe link at the emulation's scales."""

from __future__ import annotations

import time

import pytest
import torch

from poplar.zero.config import ZeroConfig
from poplar.comm import Communicator
from poplar.emulation import VirtualDevice
from poplar.profiler.local_comm import local_engine
from poplar.types.plans import Offload, Plan, RankPlan
from poplar.zero.observers import CopyDirection, StepObserver
from tests.toy import SEQ, VOCAB, loss_fn, make_model

# bounds real wall time: make test runs these files alone, after the parallel pass
pytestmark = pytest.mark.timing


class Copies(StepObserver):
    def __init__(self) -> None:
        self.seen: list[tuple[CopyDirection, int]] = []

    def host_copy(self, direction: CopyDirection, nbytes: int) -> None:
        self.seen.append((direction, nbytes))


def _runtime(offload: Offload):
    torch.manual_seed(0)
    model = make_model()
    runtime = local_engine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), world_size=2, rank=0,
                           zero_stage=ZeroConfig(2), device=torch.device("cpu"))
    runtime.set_plan(Plan([RankPlan(2, 1, 0, offload=offload), RankPlan(0, 0, 0)]))  # the others: none
    return runtime


def test_an_offloading_rank_tells_its_copies_and_a_preset_device_takes_the_link_s_time() -> None:
    torch.set_num_threads(1)
    runtime, copies = _runtime(Offload.OPTIMIZER), Copies()
    runtime.add_observer(copies)
    batch = torch.randint(0, VOCAB, (2, SEQ + 1))
    runtime.train_step(batch, loss_fn)
    shard = sum(p.numel() for p in make_model().parameters()) // 2 * 4  # fp32, half the parameters (about)
    assert [d for d, _ in copies.seen] == [CopyDirection.TO_HOST, CopyDirection.TO_DEVICE]
    assert all(n == pytest.approx(shard, rel=0.05) for _, n in copies.seen)
    quiet = _runtime(Offload.NONE)
    quiet.add_observer(copies := Copies())
    quiet.train_step(batch, loss_fn)
    assert copies.seen == []
    # a T4 (PCIe 3.0, 12 GB/s) at memory scale 1e-6 and time scale 1: a byte here is a MB there
    t4 = VirtualDevice.from_preset("T4-16G", 1e-6, 1.0)
    start = time.perf_counter()
    t4.host_copy(CopyDirection.TO_HOST, 60_000)  # 60 GB on the real card: 5 s there, 5 ms here
    assert time.perf_counter() - start == pytest.approx(60_000 / (12e9 * 1e-6), rel=0.5)
