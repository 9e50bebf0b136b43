"""ZeRO-1/2/3 on hierarchical collectives (``Plan.hierarchical``; at ZeRO-3 with secondary shards):
4 gloo ranks declared as two nodes (2 + 2 and 3 + 1), shard weights 2:1:1:2 and an uneven batch
plan equal single-process full-batch training (SGD with momentum, AdamW with clipping); the
ledger tags every collective with its link, and with secondary shards no backward all-gather
crosses a node; across nodes once per iteration, the bytes each node sends across at ZeRO-0 are
what the planner prices it to send; the memory the secondary shards cost is in ``memory_report()``;
once per iteration held for half the parameters is exact too, its bytes across nodes between the
two ways. The same parity on NCCL where there is a GPU (skipped otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from poplar.checkpoint import load_checkpoint, save_checkpoint
from poplar.process.launch import spawn
from poplar.emulation.gpu_ranks import rank_gpu
from poplar.engine import PoplarEngine
from poplar.planner.link_pricing import LinkPricing
from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import Links, LinkSpeed
from poplar.types.route import Collectives
from poplar.types.topology import Link, Topology
from poplar.zero.config import ZeroConfig
from tests.toy import (assert_runs_match_reference, global_batch, loss_fn, make_model, make_optimizer, max_rel_err,
                       plan_of, rank_slice, reference_run, with_shards)

ITERATIONS = 3
GBS = 14
CONFIGS = [("sgd", None), ("adamw", 0.5)]  # SGD-momentum catches a wrong scale; AdamW with clipping
TOPOLOGIES = {"2+2": Topology.of_sizes([2, 2]), "3+1": Topology.of_sizes([3, 1])}
WEIGHTS = (2, 1, 1, 2)
# n_i = 5, 2, 3, 4 in 3, 2, 1 and 2 micro-steps
BATCHES = plan_of((2, 2, 1), (1, 2, 0), (3, 1, 0), (2, 1, 2))


def hierarchical_plan(stage: int, way: Collectives | None = None) -> Plan:
    """The per-micro-step way of ``stage`` (secondary shards at ZeRO-3), or ``way``."""
    plan = with_shards(BATCHES, WEIGHTS)
    plan.collectives = way or (Collectives.SECONDARY_SHARDS if stage == 3 else Collectives.HIERARCHICAL)
    plan.validate()
    return plan


def zero_config(stage: int, topology: Topology) -> ZeroConfig:
    if stage == 3:  # Linear blocks hold a weight and a bias of two optimizer groups: two units a block
        return ZeroConfig(3, wrap_policy={nn.Linear, nn.LayerNorm}, topology=topology)
    return ZeroConfig(stage, bucket_size_mb=0.001, topology=topology)  # buckets of 262 elements


def parity_worker(rank: int, world: int, topology: Topology, gpu: bool = False, way: Collectives | None = None) -> dict:
    """Every stage and config on this rank (``gpu``: on its GPU, over NCCL; ``way``: the
    collectives, else each stage's per-micro-step way); states on the CPU."""
    torch.set_num_threads(1)
    device = rank_gpu(rank, world) if gpu else torch.device("cpu")
    out: dict = {}
    for stage in stages(way):
        plan = hierarchical_plan(stage, way)
        for kind, max_norm in CONFIGS:
            model = make_model(seed=0).to(device)
            engine = PoplarEngine(model, make_optimizer(model, kind), zero_stage=zero_config(stage, topology),
                                  plan=plan, max_grad_norm=max_norm)
            losses = [engine.train_step(rank_slice(global_batch(it, GBS), plan, rank).to(device), loss_fn)
                      for it in range(ITERATIONS)]
            out[(stage, kind, max_norm)] = (losses, {k: v.cpu() for k, v in engine.full_state_dict().items()})
            records = [(r.op, r.phase, r.link, r.bytes) for r in engine.comm_ledger.of(iteration=ITERATIONS - 1)]
            out[("ledger", stage, kind)] = records
            out[("memory", stage, kind)] = engine.memory_report()
    return out


def stages(way: Collectives | None) -> tuple[int, ...]:
    """The stages a way runs its own collectives at: once per iteration from ZeRO-0 (its all-reduce)."""
    return (0, 1, 2, 3) if way is Collectives.ONCE_PER_ITERATION else (1, 2, 3)


WAYS = [None, Collectives.ONCE_PER_ITERATION]  # each stage's per-micro-step way; across nodes once per iteration


@pytest.mark.parametrize("way", WAYS, ids=lambda w: w.value if w else "per_micro_step")
@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.multiprocess
def test_hierarchical_zero_matches_single_process(name: str, way: Collectives | None) -> None:
    _check_parity(name, spawn(parity_worker, 4, (TOPOLOGIES[name], False, way), timeout_s=240), stages(way))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("way", WAYS, ids=lambda w: w.value if w else "per_micro_step")
@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.multiprocess
def test_hierarchical_zero_on_nccl_matches_single_process(name: str, way: Collectives | None) -> None:
    """The same on GPUs over NCCL (ranks share a GPU where there are fewer than four:
    ``poplar.emulation.gpu_ranks``): NCCL's methods (list collectives, tensor collectives on
    even parts) in the hierarchy, which gloo does not run."""
    _check_parity(name, spawn(parity_worker, 4, (TOPOLOGIES[name], True, way), backend="nccl", timeout_s=300),
                  stages(way))


def _check_parity(name: str, results: list[dict], stages: tuple[int, ...]) -> None:
    topology = TOPOLOGIES[name]
    for stage in stages:
        staged = [{(kind, norm, 0): res[(stage, kind, norm)] for kind, norm in CONFIGS} for res in results]
        assert_runs_match_reference(staged, CONFIGS, 1, GBS, ITERATIONS)
        if stage == 0:  # once per iteration: the gradients' all-reduce crosses nodes once, each element each way
            crossed = [sum(b for rank in node for op, _, link, b in results[rank][("ledger", 0, "sgd")]
                           if op == "all_reduce" and link is Link.CROSS) for node in topology.nodes]
            grads = sum(p.numel() for p in make_model().parameters()) * 4
            assert grads <= sum(crossed) / (2 * (topology.node_count - 1)) <= grads * 1.01, (crossed, grads)
            # what the planner prices each node to send (``LinkPricing.gradient_all_reduce_s``), whatever the weights
            link = LinkSpeed(1e9)
            pricing = LinkPricing.of(Links.tiered(topology, (link,) * topology.node_count, link), 4, WEIGHTS).even()
            priced = [out + back for out, back in pricing.exchange_bytes(grads)]
            assert crossed == pytest.approx(priced, rel=0.01), (crossed, priced)
            continue
        for rank, res in enumerate(results):
            records = res[("ledger", stage, "sgd")]
            sharded = [(op, phase, link) for op, phase, link, _ in records if op in ("all_gather", "reduce_scatter")]
            assert sharded and {link for *_, link in sharded} == {Link.INTRA, Link.CROSS} or \
                (TOPOLOGIES[name].sizes[TOPOLOGIES[name].node_of(rank)] == 1 and
                 {link for *_, link in sharded} == {Link.CROSS}), (stage, rank, sharded)
            memory = res[("memory", stage, "sgd")]
            if stage == 3:
                backward = [link for op, phase, link in sharded if op == "all_gather" and phase == "backward"]
                assert Link.CROSS not in backward, (rank, backward)  # the secondary shards keep it in the node
                forward = [link for op, phase, link in sharded if op == "all_gather" and phase == "forward"]
                assert Link.CROSS in forward  # the forward's gathers do cross
                assert memory["secondary_params"] > 0
                node = TOPOLOGIES[name].nodes[TOPOLOGIES[name].node_of(rank)]
                # about (1 - the node's share) / (its ranks) of the parameters (fp32 here)
                share = sum(WEIGHTS[r] for r in node) / sum(WEIGHTS)
                params = sum(p.numel() for p in make_model().parameters()) * 4
                assert memory["secondary_params"] == pytest.approx(params * (1 - share) / len(node), rel=0.25)


def test_secondary_shards_need_hierarchical_collectives_and_zero3() -> None:
    plan = with_shards(BATCHES, WEIGHTS)
    before_routes = {k: v for k, v in plan.to_dict().items() if k != "collectives"}
    with pytest.raises(PlanError, match="hierarchical=True too"):  # a plan file written before routes
        Plan.from_dict({**before_routes, "hierarchical": False, "secondary_shards": True})
    plan.collectives, plan.zero_stage = Collectives.SECONDARY_SHARDS, 2
    with pytest.raises(PlanError, match="use zero_stage=3"):
        plan.validate()
    plan.zero_stage = 3
    plan.validate()
    again = Plan.from_dict(plan.to_dict())
    assert again.collectives is Collectives.SECONDARY_SHARDS and again.route.collectives is again.collectives
    assert "hierarchical collectives with secondary shards" in again.table()
    assert Plan.from_dict(before_routes).collectives is Collectives.FLAT  # older files: neither key
    assert Plan.from_dict({**before_routes, "zero_stage": 3, "hierarchical": True, "secondary_shards": True}) == again


NAN_AT = 1  # the iteration whose loss is NaN on rank 2


def _train(rank: int, plan: Plan, config: ZeroConfig, kind: str = "sgd", iterations: int = ITERATIONS,
           poison: bool = False, **kwargs: object) -> tuple[list[float], PoplarEngine]:
    model = make_model(seed=0)
    engine = PoplarEngine(model, make_optimizer(model, kind), zero_stage=config, plan=plan, **kwargs)
    losses = []
    for it in range(iterations):
        def poisoned(m: nn.Module, x: torch.Tensor, it: int = it) -> torch.Tensor:
            loss = loss_fn(m, x)
            return loss * float("nan") if poison and it == NAN_AT and rank == 2 else loss
        losses.append(engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), poisoned))
    return losses, engine


def features_worker(rank: int, world: int, directory: str, way: Collectives) -> dict:
    """ZeRO-3 on 2 + 2 nodes, collectives ``way`` (secondary shards, or once per iteration): bf16,
    a non-finite skip (each beside the same run on flat collectives), activation checkpointing,
    offload and shards re-cut between iterations (beside the reference), and a checkpoint resumed
    by a flat engine with even shards."""
    torch.set_num_threads(1)
    topology, out = TOPOLOGIES["2+2"], {}
    hier = hierarchical_plan(3, way)
    flat = with_shards(BATCHES, WEIGHTS)
    config = zero_config(3, topology)
    for name, plan in (("hier", hier), ("flat", flat)):
        losses, engine = _train(rank, plan, config, "adamw", max_grad_norm=0.5, mixed_precision="bf16")
        out[("bf16", name)] = (losses, engine.full_state_dict())
        losses, engine = _train(rank, plan, config, poison=True)
        out[("nan", name)] = (losses, engine.full_state_dict(), engine.skipped_steps)
    losses, engine = _train(rank, hier, config, activation_checkpointing=True)
    out["checkpointing"] = (losses, engine.full_state_dict())
    offloaded = Plan.from_dict({**hier.to_dict(), "ranks": [
        {**row, "offload": "optimizer" if r in (1, 3) else "none"} for r, row in enumerate(hier.to_dict()["ranks"])]})
    losses, engine = _train(rank, offloaded, config)
    out["offload"] = (losses, engine.full_state_dict())
    # the shards re-cut between iterations (2:1:1:2, even, 0:1:2:1): the secondary shards follow
    model = make_model(seed=0)
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=config, plan=hier)
    losses = []
    for it, weights in enumerate((WEIGHTS, (1, 1, 1, 1), (0, 1, 2, 1))):
        plan = with_shards(BATCHES, weights)
        plan.collectives = way
        engine.set_plan(plan)
        losses.append(engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), loss_fn))
    out["resharded"] = (losses, engine.full_state_dict())
    # a checkpoint of the hierarchical run with secondary shards, resumed flat with even shards
    _, engine = _train(rank, hier, config, iterations=2)
    save_checkpoint(engine, directory)
    model = make_model(seed=1)  # other initial weights: everything must come from the checkpoint
    resumed = PoplarEngine(model, make_optimizer(model, "sgd"), plan=BATCHES,
                           zero_stage=ZeroConfig(3, wrap_policy={nn.Linear, nn.LayerNorm}))
    saved = load_checkpoint(resumed, directory).plan
    loss = resumed.train_step(rank_slice(global_batch(2, GBS), BATCHES, rank), loss_fn)
    out["resumed"] = (loss, resumed.full_state_dict(), resumed.comm.routes.route.collectives)
    out["saved plan"] = (saved.collectives, saved.shard_weights)
    return out


@pytest.mark.parametrize("way", [Collectives.SECONDARY_SHARDS, Collectives.ONCE_PER_ITERATION], ids=str)
@pytest.mark.multiprocess
def test_hierarchical_zero3_precision_skips_checkpointing_offload_and_resume(tmp_path: Path, way: Collectives) -> None:
    results = spawn(features_worker, 4, (str(tmp_path / "ckpt"), way), timeout_s=240)
    ref_losses, ref_state = reference_run("sgd", GBS, ITERATIONS, None)
    for rank, res in enumerate(results):
        (hl, hs), (fl, fs) = res[("bf16", "hier")], res[("bf16", "flat")]
        assert max_rel_err(hs, fs) <= 1e-3 and hl == pytest.approx(fl, rel=1e-3), rank
        (hl, hs, hk), (fl, fs, fk) = res[("nan", "hier")], res[("nan", "flat")]
        assert hk == fk == 1 and max_rel_err(hs, fs) <= 1e-6, rank
        assert all(a == pytest.approx(b, rel=1e-6) for a, b in zip(hl, fl) if a == a), (hl, fl)
        for key in ("checkpointing", "offload", "resharded"):
            losses, state = res[key]
            assert max_rel_err(state, ref_state) <= 1e-5, (key, rank)
            assert losses == pytest.approx(ref_losses, rel=1e-5), (key, rank)
        loss, state, resumed_way = res["resumed"]
        assert resumed_way is Collectives.FLAT
        assert res["saved plan"] == (way, tuple(map(float, WEIGHTS)))  # the checkpoint keeps it
        assert max_rel_err(state, ref_state) <= 1e-5 and loss == pytest.approx(ref_losses[2], rel=1e-5), rank


# one iteration of 4 micro-steps on the slowest rank (fewer on others) against one of 1 micro-step
MANY_STEPS = with_shards(plan_of((2, 3, 1), (1, 2, 1), (1, 0, 1), (1, 2, 1)), WEIGHTS)  # in 4, 3, 1, 3 micro-steps
ONE_STEP = with_shards(plan_of((5, 1, 0), (3, 1, 0), (2, 1, 0), (4, 1, 0)), WEIGHTS)


HALF = "half"  # across nodes once per iteration for half the parameters (``Plan.held_share``)


def cross_bytes_worker(rank: int, world: int, topology: Topology) -> dict:
    """Bytes this rank sent across nodes (the exchanges, and the flat all-reduces, which cross
    too) in the second iteration, per stage, way and plan; for once per iteration on half the
    parameters (4 micro-steps only) also the losses and the state."""
    torch.set_num_threads(1)
    out = {}
    for stage in (2, 3):
        for way in (Collectives.SECONDARY_SHARDS if stage == 3 else Collectives.HIERARCHICAL,
                    Collectives.ONCE_PER_ITERATION, HALF) + ((Collectives.HIERARCHICAL,) if stage == 3 else ()):
            alone = way == HALF or (stage == 3 and way is Collectives.HIERARCHICAL)  # beside the others' 4 micro-steps
            for name, rows in (("many", MANY_STEPS),) + ((("one", ONE_STEP),) if not alone else ()):
                plan = Plan(rows.ranks, collectives=Collectives.ONCE_PER_ITERATION, held_share=0.5) if way == HALF \
                    else Plan(rows.ranks, collectives=way)
                losses, engine = _train(rank, plan, zero_config(stage, topology), iterations=2)
                records = engine.comm_ledger.of(iteration=1)
                out[(stage, way, name)] = sum(r.bytes for r in records if r.link in (Link.CROSS, Link.FLAT))
                # the reduce-scatters in the order they completed (the ledger records each when done)
                out[(stage, way, name, "order")] = [r.link for r in records if r.op == "reduce_scatter"]
                out[(stage, way, "memory")] = engine.memory_report()
                if way == HALF:
                    out[(stage, way, name, "run")] = (losses, engine.full_state_dict())
    return out


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.multiprocess
def test_once_per_iteration_crosses_nodes_once(name: str) -> None:
    """Across nodes once per iteration: the bytes a rank sends across nodes in an iteration of 4
    micro-steps are those of an iteration of 1 (ZeRO-2 and ZeRO-3), where the per-micro-step ways
    send more with every micro-step; the node accumulator shows in ``memory_report()``; the
    exchanges start in the last lock-step micro-step (an exchange completes before that
    micro-step's last in-node reduce-scatter: ``reduce_queue.NodeExchanges``)."""
    results = spawn(cross_bytes_worker, 4, (TOPOLOGIES[name],), timeout_s=240)
    topology = TOPOLOGIES[name]
    for rank, res in enumerate(results):
        for stage in (2, 3):
            old = Collectives.SECONDARY_SHARDS if stage == 3 else Collectives.HIERARCHICAL
            once = Collectives.ONCE_PER_ITERATION
            ratio = res[(stage, once, "many")] / res[(stage, once, "one")]
            old_ratio = res[(stage, old, "many")] / res[(stage, old, "one")]
            print(f"{name} rank {rank} ZeRO-{stage}: cross-node bytes 4 micro-steps / 1: once per iteration "
                  f"{ratio:.3f}, {old.value} {old_ratio:.3f}")
            assert ratio <= 1.05 and old_ratio > 1.5, (stage, rank, ratio, old_ratio)
            order = res[(stage, once, "many", "order")]
            if len(topology.nodes[topology.node_of(rank)]) > 1:  # a rank alone in its node has no in-node step
                last_intra = max(i for i, link in enumerate(order) if link is Link.INTRA)
                assert order.index(Link.CROSS) < last_intra, (stage, rank, order)
            memory = res[(stage, once, "memory")]
            node = topology.nodes[topology.node_of(rank)]
            params = sum(p.numel() for p in make_model().parameters()) * 4
            # fp32 node partials of its part and its pieces: about 1 / (ranks in the node) of the model
            assert memory["node_accumulator"] == pytest.approx(params / len(node), rel=0.5), (stage, rank, memory)
            assert res[(stage, old, "memory")]["node_accumulator"] == 0
            if stage == 3:
                assert memory["secondary_params"] > 0
            _check_half(res, stage, rank)


def _check_half(res: dict, stage: int, rank: int) -> None:
    """Once per iteration on half the parameters (``Plan.held_share``, Note: a share held, in
    ``poplar.types.route``), an iteration of 4 micro-steps: exact, at most about half the memory
    held, and cross-node bytes between once per iteration on every parameter and hierarchical
    collectives (the pieces outside the share run as those do: at ZeRO-3 without secondary shards)."""
    once = Collectives.ONCE_PER_ITERATION
    ref_losses, ref_state = reference_run("sgd", GBS, 2, None)
    losses, state = res[(stage, HALF, "many", "run")]
    assert max_rel_err(state, ref_state) <= 1e-5 and losses == pytest.approx(ref_losses, rel=1e-5), (stage, rank)
    half, full = res[(stage, HALF, "memory")], res[(stage, once, "memory")]
    for key in ("node_accumulator",) + (("secondary_params",) if stage == 3 else ()):
        assert 0 < half[key] < full[key] and half[key] <= 0.6 * full[key], (stage, rank, key, half, full)
    per_step = res[(stage, Collectives.HIERARCHICAL, "many")]
    assert res[(stage, once, "many")] < res[(stage, HALF, "many")] < per_step, (stage, rank)
