"""Auto mode with a model that fits batch 1 on the short card at no ZeRO stage and at no shard
weights (the roomy card cannot take the short card's share): with ``AutoOptions(offload="auto")``
the profile is measured with the short card's optimizer offloaded to host memory, the plan keeps
it there, and the engine trains exactly (parameters equal single-process training on the whole
global batch, SGD with momentum); with offload not allowed, the error names offload as the fix."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from poplar.auto import AutoOptions
from poplar.process.launch import RankFailure, spawn
from poplar.emulation import VirtualDevice
from poplar.engine import PoplarEngine
from tests.toy import SEQ, VOCAB, global_batch, loss_fn, make_model, max_rel_err, rank_slice, train_reference

# the toy model at ZeRO-3 on 2 ranks: a batch-1 step holds about 7.6 kB besides its even shard of
# about 7.8 kB (parameters, gradients and momentum; the momentum, 2.6 kB, is what offload moves).
# The short card fits batch 1 only with its momentum offloaded; the roomy card's room beyond its
# own even shard is too small to take enough of the short card's, so no shard weights fit either
CAPACITY = (16_500, 14_000)
GBS, ITERATIONS = 6, 2


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)


def offload_fit_rank(rank: int, world: int, offload: str, stage: int | str = "auto", choose: str = "fastest") -> dict:
    torch.set_num_threads(1)
    device = VirtualDevice(("roomy", "short")[rank], CAPACITY[rank])
    device.pad = False
    model = make_model()
    engine = PoplarEngine(model, _sgd(model), zero_stage=stage, global_batch_size=GBS, loss_fn=loss_fn,
                          activation_checkpointing=False,
                          auto=AutoOptions(profile_data=lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)),
                                           device=device, repeats=1, max_batch=16, progress=False, offload=offload,
                                           store=None, choose=choose))
    losses = [engine.train_step(rank_slice(global_batch(it, GBS), engine.plan, rank)) for it in range(ITERATIONS)]
    profile = engine.profile
    escalated = [asdict(e) for e in profile.auto_choice.offload_escalations] if profile.auto_choice is not None else \
        [asdict(e) for e in profile.measurement.escalations]
    out = {"plan": engine.plan.to_dict(), "stage": engine.zero_stage, "measured": engine.profile.offloads,
           "mbs": [r.mbs for r in engine.profile.ranks], "escalated": escalated,
           "losses": losses, "state": engine.full_state_dict()}
    engine.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage,choose", [("auto", "fastest"), (3, "first_fit")])
def test_a_model_that_fits_only_with_offload_trains(stage: int | str, choose: str) -> None:
    # "fastest": the configuration choice searches again (profiler.candidate_run: offload escalation); "first_fit"
    # at a given stage: the profiler's own escalation (profiler.escalation)
    r0, r1 = spawn(offload_fit_rank, 2, ("auto", stage, choose), timeout_s=300, collective_timeout_s=120)
    assert r0["plan"] == r1["plan"] and r0["stage"] == 3
    assert r0["measured"] == ["none", "optimizer"], r0["measured"]
    (record,) = r0["escalated"]
    assert record["ranks"] == [1] and record["offload"] == ["none", "optimizer"]
    assert r0["plan"]["ranks"][1]["offload"] == "optimizer"  # it fits no sample otherwise
    assert all(m >= 1 for m in r0["mbs"])
    model = make_model()
    losses, state = train_reference(model, _sgd(model), lambda it: loss_fn(model, global_batch(it, GBS)),
                                    ITERATIONS, None)
    assert r0["losses"] == pytest.approx(losses, rel=1e-5) and r1["losses"] == r0["losses"]
    assert max_rel_err(r0["state"], state) < 1e-5


@pytest.mark.multiprocess
def test_without_offload_the_error_names_offload() -> None:
    with pytest.raises(RankFailure) as failure:
        spawn(offload_fit_rank, 2, ("none",), timeout_s=300, collective_timeout_s=120)
    message = str(failure.value)
    assert "batch 1 does not fit" in message and 'offload="auto"' in message, message
