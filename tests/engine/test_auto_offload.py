"""Auto mode with ``AutoOptions(offload="auto")`` where nothing needs offload: the profile says what
offload would cost every rank (measured: the host link, the host step of the user's SGD with
momentum, 4 bytes of state per element), the planner prices it and keeps every optimizer on its
device, and the engine trains exactly (parameters equal single-process training). Rows given
(``AutoOptions(offload=(Offload.NONE, Offload.OPTIMIZER))``, what a config's ``poplar.offload``
hands auto mode) come back in auto mode's plan, and the engine trains exactly with them."""

from __future__ import annotations

import pytest
import torch

from poplar.auto import AutoOptions
from poplar.process.launch import spawn
from poplar.emulation import VirtualDevice
from poplar.engine import PoplarEngine
from poplar.types.plans import Offload
from tests.toy import SEQ, VOCAB, global_batch, loss_fn, make_model, max_rel_err, rank_slice, train_reference

GBS, ITERATIONS = 6, 2


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)


def auto_offload_rank(rank: int, world: int, offload: str | tuple[Offload, ...] = "auto") -> dict:
    torch.set_num_threads(1)
    device = VirtualDevice(("big", "small")[rank], (400_000, 200_000)[rank])
    device.pad = False
    model = make_model()
    engine = PoplarEngine(model, _sgd(model), zero_stage=2, global_batch_size=GBS, loss_fn=loss_fn,
                          activation_checkpointing=False,
                          auto=AutoOptions(profile_data=lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)),
                                           device=device, repeats=1, max_batch=8, progress=False, offload=offload,
                                           shards="even", store=None))
    losses = [engine.train_step(rank_slice(global_batch(it, GBS), engine.plan, rank)) for it in range(ITERATIONS)]
    out = {"plan": engine.plan.to_dict(), "costs": [r.offload_cost for r in engine.profile.ranks],
           "candidates": engine.plan.choice.placement_candidates, "losses": losses,
           "state": engine.full_state_dict(), "offloads": [o.value for o in engine.auto_result.offloads]}
    engine.close()
    return out


@pytest.mark.multiprocess
def test_auto_offload_keeps_the_device_where_nothing_needs_it() -> None:
    r0, r1 = spawn(auto_offload_rank, 2, timeout_s=240, collective_timeout_s=120)
    assert r0["plan"] == r1["plan"]
    assert [row["offload"] for row in r0["plan"]["ranks"]] == ["none", "none"]
    assert r0["candidates"] and len(r0["candidates"]) > 1  # priced, and lost
    for cost in r0["costs"]:
        assert cost is not None and cost.state_bytes_per_element == 4.0 and cost.d2h_bytes_per_s > 0
    model = make_model()
    losses, state = train_reference(model, _sgd(model), lambda it: loss_fn(model, global_batch(it, GBS)),
                                    ITERATIONS, None)
    assert r0["losses"] == pytest.approx(losses, rel=1e-5) and r1["losses"] == r0["losses"]
    assert max_rel_err(r0["state"], state) < 1e-5


@pytest.mark.multiprocess
def test_auto_mode_plans_with_the_offload_rows_given() -> None:
    given = (Offload.NONE, Offload.OPTIMIZER)
    r0, r1 = spawn(auto_offload_rank, 2, (given,), timeout_s=240, collective_timeout_s=120)
    assert r0["plan"] == r1["plan"]
    assert [row["offload"] for row in r0["plan"]["ranks"]] == ["none", "optimizer"] == r0["offloads"]
    model = make_model()
    losses, state = train_reference(model, _sgd(model), lambda it: loss_fn(model, global_batch(it, GBS)),
                                    ITERATIONS, None)
    assert r0["losses"] == pytest.approx(losses, rel=1e-5) and r1["losses"] == r0["losses"]
    assert max_rel_err(r0["state"], state) < 1e-5
