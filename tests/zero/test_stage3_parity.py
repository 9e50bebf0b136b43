"""ZeRO-3 on 2 and 3 gloo ranks under uneven plans equals single-process full-batch training:
tied weights, parameter sizes that divide by neither world size, blocks spanning two optimizer
groups, nested blocks, SGD-momentum (with and without clipping) and AdamW, ranks with fewer
micro-steps or none, on 3 ranks also across nodes once per iteration (nodes 2 + 1); plus
evaluation under no_grad and the engine.backward()/step() loop."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from poplar.engine import PoplarEngine
from poplar.types.plans import Plan
from poplar.types.route import Collectives
from poplar.types.topology import Topology
from tests.zero.test_stage3_common import Block, one_thread, part_results, reference, tiny_lm
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, plan_of, rank_slice
from poplar.zero.config import ZeroConfig

ITERATIONS = 3
GBS = 14
# plain SGD-momentum without clipping catches a wrong gradient scale; clipping and Adam hide one
CONFIGS = [("sgd", None), ("sgd", 0.5), ("adamw", 0.5)]
PLANS = {
    2: [plan_of((4, 2, 1), (5, 1, 0)), plan_of((1, 3, 0), (5, 2, 1))],
    # micro-step counts 3/1/3, 1/3/4 and 4/0/2 (a rank with no samples)
    3: [plan_of((3, 2, 1), (2, 1, 0), (2, 2, 1)), plan_of((4, 1, 0), (4, 1, 2), (1, 4, 0)),
        plan_of((3, 3, 1), (0, 0, 0), (2, 2, 0))],
}
# (model, wrap policy, configs): TiedNet's blocks are its Linears and LayerNorm (embed/head tied ->
# root unit); TinyLM by the default policy (its ModuleList), and nested (Blocks with inner Linear blocks)
MODELS = {
    "toy-classes": (make_model, {nn.Linear, nn.LayerNorm}, CONFIGS),
    "lm-default": (tiny_lm, None, CONFIGS),
    "lm-nested": (tiny_lm, {Block, "Linear"}, CONFIGS[:1]),
}
PROBE = global_batch(99, 4)[:, :-1]
# the collectives each model runs under, by world: flat; at 3 ranks, TinyLM also across nodes once
# per iteration over nodes 2 + 1 (secondary shards kept the whole iteration, node accumulators)
ONCE = (Collectives.ONCE_PER_ITERATION, Topology.of_sizes([2, 1]))


def ways(world: int, mname: str) -> list[tuple[Collectives, Topology | None]]:
    return [(Collectives.FLAT, None)] + ([ONCE] if world == 3 and mname == "lm-default" else [])


def worker(rank: int, world: int) -> dict:
    out = {}
    for mname, (make, policy, configs) in MODELS.items():
        for (way, topology), (kind, max_norm) in itertools.product(ways(world, mname), configs):
            for pi, rows in enumerate(PLANS[world]):
                model, plan = make(), Plan(rows.ranks, collectives=way)
                engine = PoplarEngine(model, make_optimizer(model, kind), plan=plan, max_grad_norm=max_norm,
                                      zero_stage=ZeroConfig(3, wrap_policy=policy, topology=topology))
                losses = [engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), loss_fn)
                          for it in range(ITERATIONS)]
                with torch.no_grad():
                    probe = engine.module(PROBE)
                out[(mname, kind, max_norm, pi, way)] = (losses, engine.full_state_dict(), probe)
    # the engine.backward()/step() loop of one's own, on the plan with an idle rank / fewer micro-steps
    plan = PLANS[world][-1]
    model = tiny_lm()
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=3, plan=plan)
    for it in range(ITERATIONS):
        batch, start = rank_slice(global_batch(it, GBS), plan, rank), 0
        for m in plan.ranks[rank].micro_batch_sizes():
            engine.backward(loss_fn(engine.module, batch[start:start + m]), m)
            start += m
        engine.step()
    out["loop"] = engine.full_state_dict()
    # a complete state loads into the shards without a collective (checkpoints use this)
    target = tiny_lm(seed=1).state_dict()
    engine.stage.load_full_state_dict(target)
    out["loaded"] = (engine.full_state_dict(), target)
    try:
        engine.stage.load_full_state_dict({**target, "norm.weight": torch.zeros(3)})
    except ValueError as e:
        out["load_error"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.multiprocess
def test_stage3_uneven_plans_match_single_process(world: int) -> None:
    results = part_results(world, "parity")
    for mname, (make, _, configs) in MODELS.items():
        for kind, max_norm in configs:
            with one_thread():
                ref_losses, ref_state, ref_model = reference(make, kind, GBS, ITERATIONS, max_norm)
                with torch.no_grad():
                    ref_probe = ref_model(PROBE)
            for (way, _), pi in itertools.product(ways(world, mname), range(len(PLANS[world]))):
                for rank, res in enumerate(results):
                    losses, state, probe = res[(mname, kind, max_norm, pi, way)]
                    where = (mname, kind, max_norm, pi, way, rank)
                    assert max_rel_err(state, ref_state) <= 1e-5, where
                    assert losses == pytest.approx(ref_losses, rel=1e-5), where
                    assert float((probe - ref_probe).norm() / ref_probe.norm()) <= 1e-5, where
                    assert torch.equal(state["embed.weight"], state["head.weight"]), where  # still tied
    with one_thread():
        ref_state = reference(tiny_lm, "sgd", GBS, ITERATIONS, None)[1]
    for res in results:
        assert max_rel_err(res["loop"], ref_state) <= 1e-5
        loaded, target = res["loaded"]
        assert loaded.keys() == target.keys() and all(torch.equal(loaded[k], target[k]) for k in target)
        assert "norm.weight: (3,) vs (13,)" in res["load_error"]


def test_stage3_single_process_matches_reference() -> None:
    """A world of one (no process group): the same engine, every collective a local copy."""
    with one_thread():
        model = tiny_lm()
        engine = PoplarEngine(model, make_optimizer(model, "adamw"), zero_stage=3, plan=plan_of((4, 3, 2)),
                              max_grad_norm=0.5)
        losses = [engine.train_step(global_batch(it, GBS), loss_fn) for it in range(ITERATIONS)]
        ref_losses, ref_state, _ = reference(tiny_lm, "adamw", GBS, ITERATIONS, 0.5)
        assert max_rel_err(engine.full_state_dict(), ref_state) <= 1e-5
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert engine.stage.gathered_bytes == 0 and all(p.numel() == 0 for p in model.parameters())


def test_stage3_reference_moves() -> None:
    """Guard against a vacuous comparison: the reference changes the parameters."""
    with one_thread():
        _, state, _ = reference(tiny_lm, "sgd", GBS, ITERATIONS, None)
    assert max_rel_err(state, tiny_lm().state_dict()) > 1e-2
