"""Shard weights (``RankPlan.shard_weight``): ZeRO-1/2/3 on 3 gloo ranks whose shards are cut
5:1:2 (and 0:1:2, a rank holding nothing) equal single-process full-batch training under uneven
batch plans; set_plan re-shards a running engine between iterations; each rank's sharded bytes
follow its weight; a checkpoint saved under 5:1:2 loads into an engine with even shards and goes
on as the uninterrupted run; the layouts themselves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from poplar.checkpoint import load_checkpoint, save_checkpoint
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.profiler.local_comm import LocalCommunicator
from poplar.types.plans import Plan, PlanError, RankPlan
from poplar.zero.config import ZeroConfig
from poplar.zero.flat import FlatUnit
from poplar.zero.shard_layout import ShardLayout, Shards
from tests.toy import (assert_runs_match_reference, global_batch, loss_fn, make_model, make_optimizer, max_rel_err,
                       plan_of, rank_slice, reference_run, with_shards)

ITERATIONS = 3
GBS = 14
# plain SGD-momentum without clipping catches a wrong gradient scale; clipping and Adam hide one
CONFIGS = [("sgd", None), ("sgd", 0.5), ("adamw", 0.5)]


def weighted(weights: tuple[float, ...], *rows: tuple[int, int, int]) -> Plan:
    return with_shards(plan_of(*rows), weights)


# n_i = 7, 2, 5 and 10, 0, 4 (a rank with no samples): batches and shards cut independently
PLANS = [weighted((5, 1, 2), (3, 2, 1), (2, 1, 0), (2, 2, 1)),
         weighted((5, 1, 2), (3, 3, 1), (0, 0, 0), (2, 2, 0)),
         weighted((0, 1, 2), (4, 1, 0), (4, 1, 2), (1, 4, 0))]


def _config(stage: int) -> ZeroConfig:
    if stage == 3:  # Linear blocks hold a weight and a bias of two optimizer groups: two units a block
        return ZeroConfig(3, wrap_policy={nn.Linear, nn.LayerNorm})
    return ZeroConfig(stage, bucket_size_mb=0.001)  # buckets of 262 elements: parameters cut across ranks


def parity_worker(rank: int, world: int, stage: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for kind, max_norm in CONFIGS:
        for pi, plan in enumerate(PLANS):
            model = make_model(seed=0)
            engine = PoplarEngine(model, make_optimizer(model, kind), zero_stage=_config(stage), plan=plan,
                                  max_grad_norm=max_norm)
            losses = [engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), loss_fn)
                      for it in range(ITERATIONS)]
            out[(kind, max_norm, pi)] = (losses, engine.full_state_dict())
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.multiprocess
def test_weighted_shards_match_single_process(stage: int) -> None:
    results = spawn(parity_worker, 3, (stage,), timeout_s=240)
    assert_runs_match_reference(results, CONFIGS, len(PLANS), GBS, ITERATIONS)


RESHARDS = [(1, 1, 1), (5, 1, 2), (0, 1, 2)]  # the weights of iterations 0, 1 and 2


def reshard_worker(rank: int, world: int, stage: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for kind, max_norm, precision in [("sgd", None, None), ("adamw", 0.5, None), ("sgd", None, "bf16")]:
        for live in (True, False):
            model = make_model(seed=0)
            base = PLANS[0]
            engine = PoplarEngine(model, make_optimizer(model, kind), zero_stage=_config(stage),
                                  plan=with_shards(base, RESHARDS[0]), max_grad_norm=max_norm,
                                  mixed_precision=precision)
            losses = []
            for it in range(ITERATIONS):
                if live:
                    engine.set_plan(with_shards(base, RESHARDS[it]))
                losses.append(engine.train_step(rank_slice(global_batch(it, GBS), base, rank), loss_fn))
            out[(kind, max_norm, precision, live)] = (losses, engine.full_state_dict(), engine.shard_weights)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.multiprocess
def test_set_plan_reshards_between_iterations(stage: int) -> None:
    """Weights 1:1:1, then 5:1:2, then 0:1:2 between iterations: the same training as the
    reference (fp32) and as the run that kept even shards (bf16: the fp32 masters move)."""
    results = spawn(reshard_worker, 3, (stage,), timeout_s=240)
    for kind, max_norm, precision in [("sgd", None, None), ("adamw", 0.5, None), ("sgd", None, "bf16")]:
        for rank, res in enumerate(results):
            losses, state, weights = res[(kind, max_norm, precision, True)]
            assert weights == (0.0, 1.0, 2.0)
            kept_losses, kept_state, _ = res[(kind, max_norm, precision, False)]
            assert max_rel_err(state, kept_state) <= 1e-6, (kind, precision, rank)
            assert losses == pytest.approx(kept_losses, rel=1e-6)
            if precision is None:
                ref_losses, ref_state = reference_run(kind, GBS, ITERATIONS, max_norm)
                assert max_rel_err(state, ref_state) <= 1e-5, (kind, rank)
                assert losses == pytest.approx(ref_losses, rel=1e-5)


class Wide(nn.Module):
    """Four 96x96 layers: units large enough that 16-byte cut points do not blur the shares."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(96, 96) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def wide_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def bytes_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    plan = weighted((5, 1, 2), (2, 1, 0), (2, 1, 0), (2, 1, 0))
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(3))
    out = {}
    for stage in (1, 2, 3):
        model = Wide()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        config = ZeroConfig(stage, bucket_size_mb=0.05) if stage < 3 else ZeroConfig(3)
        engine = PoplarEngine(model, opt, zero_stage=config, plan=plan)
        engine.train_step(x[2 * rank:2 * rank + 2], wide_loss)
        out[stage] = engine.memory_report()
    return out


@pytest.mark.multiprocess
def test_sharded_bytes_follow_the_weights() -> None:
    reports = spawn(bytes_worker, 3, timeout_s=120)
    shares = [5 / 8, 1 / 8, 2 / 8]
    sharded = {1: ["optimizer"], 2: ["optimizer", "grads"], 3: ["optimizer", "grads", "params"]}
    for stage, keys in sharded.items():
        for key in keys:
            per_rank = [reports[r][stage][key] for r in range(3)]
            total = sum(per_rank)
            assert total > 0, (stage, key)
            for r in range(3):
                assert per_rank[r] / total == pytest.approx(shares[r], rel=0.10), (stage, key, per_rank)


def checkpoint_worker(rank: int, world: int, directory: str) -> dict:
    torch.set_num_threads(1)
    weighted_plan, even_plan = PLANS[0], Plan([RankPlan(3, 2, 1), RankPlan(2, 1, 0), RankPlan(2, 2, 1)])
    model = make_model(seed=0)
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=_config(3), plan=weighted_plan)
    for it in range(2):
        engine.train_step(rank_slice(global_batch(it, GBS), weighted_plan, rank), loss_fn)
    save_checkpoint(engine, directory)
    model = make_model(seed=1)  # other initial weights: everything must come from the checkpoint
    resumed = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=_config(3), plan=even_plan)
    load_checkpoint(resumed, directory)
    loss = resumed.train_step(rank_slice(global_batch(2, GBS), even_plan, rank), loss_fn)
    return {"loss": loss, "state": resumed.full_state_dict()}


@pytest.mark.multiprocess
def test_weighted_checkpoint_resumes_with_even_shards(tmp_path: Path) -> None:
    results = spawn(checkpoint_worker, 3, (str(tmp_path / "ckpt"),), timeout_s=120)
    ref_losses, ref_state = reference_run("sgd", GBS, ITERATIONS, None)
    for res in results:
        assert max_rel_err(res["state"], ref_state) <= 1e-5
        assert res["loss"] == pytest.approx(ref_losses[2], rel=1e-5)


# ---------------------------------------------------------------- layouts and plans (no processes)
def test_equal_weights_give_the_even_layout() -> None:
    for numel, n in [(1, 3), (10, 3), (481, 2), (1000, 4)]:
        layout = ShardLayout.of(numel, [2.0] * n)
        size = max(1, -(-numel // n))
        assert layout.bounds == tuple(r * size for r in range(n + 1)) and layout.even


def test_weighted_layout_cuts_by_share_on_aligned_bounds() -> None:
    layout = ShardLayout.of(8000, [5, 1, 2])
    assert layout.sizes == (5000, 1000, 2000) and not layout.even
    odd = ShardLayout.of(1001, [5, 1, 2], element_size=4)
    assert odd.padded_numel == 1004 and all(b % 4 == 0 for b in odd.bounds)
    assert sum(odd.sizes) == odd.padded_numel
    empty = ShardLayout.of(100, [0, 1, 3])
    assert empty.size(0) == 0 and empty.sizes == (0, 24, 76)


@pytest.mark.parametrize("weights", [[], [0, 0], [1, -1], [1, float("nan")], [float("inf"), 1]])
def test_bad_weights_are_refused(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="shard weights"):
        ShardLayout.of(10, weights)


def test_shards_cut_every_buffer_by_their_shares() -> None:
    shards = Shards((5.0, 1.0, 2.0))
    assert shards.world_size == 3 and shards.layout(8000).sizes == (5000, 1000, 2000)
    assert shards.layout(1001).bounds == ShardLayout.of(1001, [5, 1, 2]).bounds
    assert Shards((2.0, 2.0)).cuts_like(Shards.even(2)) and not shards.cuts_like(Shards.even(3))
    assert Shards.even(4).layout(10).even
    for bad in [(), (0.0, 0.0), (1.0, -1.0)]:
        with pytest.raises(ValueError, match="shard weights"):
            Shards(bad)
    with pytest.raises(TypeError, match="tuple"):
        Shards([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 3"):
        FlatUnit([nn.Parameter(torch.ones(4))], ["a"], 0, shards, 3, 0)


def test_plan_rows_carry_their_shard_weight() -> None:
    plan = weighted((5, 1, 2), (2, 1, 0), (1, 1, 0), (1, 1, 0))
    again = Plan.from_dict(plan.to_dict())
    assert again.shard_weights == (5.0, 1.0, 2.0) and not again.even_shards
    assert "shard" in plan.table() and "62.5%" in plan.table()
    assert "shard" not in Plan.even(3, 6, 2).table()
    legacy = {"ranks": [{"micro_batch_size": 2, "accum_steps": 1}]}  # a plan.json of before the field
    assert Plan.from_dict(legacy).shard_weights == (1.0,)
    for bad in (-1.0, float("nan"), True, "2"):
        with pytest.raises(PlanError, match="shard_weight"):
            Plan([RankPlan(1, 1, shard_weight=bad)])
    with pytest.raises(PlanError, match="all 0"):
        Plan([RankPlan(1, 1, shard_weight=0.0), RankPlan(1, 1, shard_weight=0.0)])


def test_unit_shard_ranges_and_local_collectives() -> None:
    params = [nn.Parameter(torch.arange(30, dtype=torch.float32)), nn.Parameter(torch.ones(11))]
    units = [FlatUnit(params, ["a", "b"], 0, Shards((5.0, 1.0, 2.0)), r, 0) for r in range(3)]
    assert [u.shard_range for u in units] == [(0, 28), (28, 32), (32, 44)]
    flat = units[0].new_flat()
    units[0].copy_params_into(flat)
    assert torch.equal(units[1].shard_of(flat), flat[28:32])
    comm = LocalCommunicator(3, 2)
    out = torch.empty(12)
    comm.reduce_scatter(out, flat, sizes=units[2].layout.sizes)
    assert torch.equal(out, flat[32:44])
    gathered = torch.empty(44)
    comm.all_gather(gathered, out, sizes=units[2].layout.sizes)
    assert torch.equal(gathered[32:44], out) and torch.isfinite(gathered).all()
