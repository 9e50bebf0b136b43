"""Auto mode with a model that fits no even shards: the short card cannot hold batch 1 with
1/N of the ZeRO-3 state, the roomy card can hold more. The capacity searches are run again at
shard weights by memory, the profile records them, the plan keeps them, and the engine trains
exactly (parameters equal single-process training on the whole global batch)."""

from __future__ import annotations

import pytest
import torch

from poplar.auto import AutoOptions
from poplar.process.launch import spawn
from poplar.emulation import VirtualDevice
from poplar.engine import PoplarEngine
from tests.toy import SEQ, VOCAB, global_batch, loss_fn, make_model, max_rel_err, rank_slice, train_reference

# the toy model at ZeRO-3 on 2 ranks: a batch-1 step holds about 7.6 kB besides the shard, and
# the even shard is about 7.8 kB (parameters, gradients and momentum); the short card has room for
# about 0.45 of an even shard, the roomy one for about two
CAPACITY = (24_000, 11_500)
GBS, ITERATIONS = 6, 2


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)


def uneven_fit_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    device = VirtualDevice(("roomy", "short")[rank], CAPACITY[rank])
    device.pad = False
    model = make_model()
    engine = PoplarEngine(model, _sgd(model), zero_stage=3, global_batch_size=GBS, loss_fn=loss_fn,
                          activation_checkpointing=False,
                          auto=AutoOptions(profile_data=lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)),
                                           device=device, repeats=1, max_batch=16, progress=False))
    losses = [engine.train_step(rank_slice(global_batch(it, GBS), engine.plan, rank)) for it in range(ITERATIONS)]
    out = {"plan": engine.plan.to_dict(), "weights": engine.plan.shard_weights, "stage": engine.zero_stage,
           "measured": engine.profile.shard_weights, "losses": losses, "state": engine.full_state_dict()}
    engine.close()
    return out


@pytest.mark.multiprocess
def test_a_model_that_fits_only_uneven_shards_trains() -> None:
    r0, r1 = spawn(uneven_fit_rank, 2, timeout_s=240, collective_timeout_s=120)
    assert r0["plan"] == r1["plan"] and r0["stage"] == 3
    weights = r0["weights"]
    assert r0["measured"] is not None and weights[0] > 2 * weights[1] > 0, (weights, r0["measured"])
    model = make_model()
    losses, state = train_reference(model, _sgd(model), lambda it: loss_fn(model, global_batch(it, GBS)),
                                    ITERATIONS, None)
    assert r0["losses"] == pytest.approx(losses, rel=1e-5) and r1["losses"] == r0["losses"]
    assert max_rel_err(r0["state"], state) < 1e-5
