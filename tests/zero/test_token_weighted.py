"""(loss_sum, count) losses (docs/design.md §2): at stages 0-3 on 3 gloo ranks under uneven plans,
with and without clipping, through train_step and through a loop of the user's own, training
equals one process on the whole global batch with loss = Σ sums / Σ counts; bf16 and fp16 track
it; kinds mixed across or within ranks and invalid counts are errors on every rank; a global
count of 0 is a skipped (non-finite) step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poplar.comm import DistributedError
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.types.precision import LossScaleConfig, MixedPrecision
from tests.toy import VOCAB, global_batch, make_model, make_optimizer, max_rel_err, plan_of, train_reference, with_shards
from poplar.zero.config import ZeroConfig

ITERATIONS, GBS = 3, 14
PLANS = [plan_of((3, 2, 1), (0, 0, 0), (2, 3, 1)),  # n_i = 7, 0, 7
         with_shards(plan_of((4, 1, 0), (4, 1, 2), (1, 4, 0)), (5, 1, 2))]  # 4, 6, 4; shards 5:1:2
STAGES = (0, 1, 2, 3)
# the toy's fp16 gradients overflow at the default 2^16 even with mean losses: start lower
PRECISIONS = {"bf16": "bf16",
              "fp16": MixedPrecision(param_dtype=torch.float16, loss_scale=LossScaleConfig(initial_scale=2.0 ** 10))}


def token_batch(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): targets are -100 past a random length per sample (0 to all 5 counted)."""
    tokens = global_batch(iteration, GBS)
    g = torch.Generator().manual_seed(300 + iteration)
    keep = torch.randint(0, tokens.shape[1], (GBS, 1), generator=g)
    targets = tokens[:, 1:].masked_fill(torch.arange(tokens.shape[1] - 1)[None, :] >= keep, -100)
    return tokens[:, :-1], targets


def sum_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    total = F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (targets != -100).sum()


def part(batch: tuple, plan, rank: int) -> tuple:
    start, n = plan.sample_offsets()[rank], plan.ranks[rank].num_samples
    return tuple(t[start:start + n] for t in batch)


def reference(max_norm: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    return train_reference(model, make_optimizer(model, "sgd"), lambda it: sum_loss(model, token_batch(it)),
                           ITERATIONS, max_norm)


def engine_for(stage: int, plan, nonfinite: str = "skip", **kwargs) -> PoplarEngine:
    model = make_model()
    return PoplarEngine(model, make_optimizer(model, "sgd"), plan=plan, loss_fn=sum_loss,
                        zero_stage=ZeroConfig(stage, bucket_size_mb=0.001, nonfinite=nonfinite), **kwargs)


def own_loop(engine: PoplarEngine, batch: tuple, rank: int) -> float:
    """backward((sum, count), m) per micro-step of the rank's row, then step()."""
    start = 0
    for m in engine.rank_plan.micro_batch_sizes():
        micro = tuple(t[start:start + m] for t in batch)
        engine.backward(sum_loss(engine.module, micro), m)
        start += m
    return engine.step()


def error_of(fn) -> str | None:
    try:
        fn()
    except DistributedError as e:
        return str(e)
    return None


def errors(rank: int) -> dict:
    out = {}
    plan = PLANS[0]
    batch = part(token_batch(0), plan, rank)
    engine = engine_for(2, plan)
    mean_loss = lambda m, b: sum_loss(m, b)[0] / 10  # noqa: E731
    out["across"] = error_of(lambda: engine.train_step(batch, mean_loss if rank == 2 else sum_loss))
    calls = iter(range(100))
    mixed = lambda m, b: sum_loss(m, b) if next(calls) == 0 else mean_loss(m, b)  # noqa: E731
    out["within"] = error_of(lambda: engine.train_step(batch, mixed if rank == 0 else sum_loss))
    negative = lambda m, b: (sum_loss(m, b)[0], -3.0)  # noqa: E731
    out["negative"] = error_of(lambda: engine.train_step(batch, negative))
    before = engine.full_state_dict()
    empty = lambda m, b: (sum_loss(m, b)[0] * 0, 0)  # noqa: E731 - every label ignored
    out["empty"] = (engine.train_step(batch, empty), engine.skipped_steps,
                    max_rel_err(engine.full_state_dict(), before), engine.train_step(batch))
    strict = engine_for(0, plan, nonfinite="raise")
    out["empty-raise"] = error_of(lambda: strict.train_step(batch, empty))
    return out


def worker(rank: int, world: int) -> dict:
    out = {}
    for stage in STAGES:
        for max_norm in (None, 0.5):
            plan = PLANS[stage % 2]
            engine = engine_for(stage, plan, max_grad_norm=max_norm)
            losses = [engine.train_step(part(token_batch(it), plan, rank)) for it in range(ITERATIONS)]
            out["fp32", stage, max_norm] = (losses, engine.full_state_dict(), engine.last_loss_count)
        engine = engine_for(stage, PLANS[1])
        losses = [own_loop(engine, part(token_batch(it), PLANS[1], rank), rank) for it in range(ITERATIONS)]
        out["own", stage] = (losses, engine.full_state_dict())
        for precision, policy in PRECISIONS.items():
            engine = engine_for(stage, PLANS[0], mixed_precision=policy)
            losses = [engine.train_step(part(token_batch(it), PLANS[0], rank)) for it in range(ITERATIONS)]
            out[precision, stage] = (losses, engine.full_state_dict(), engine.skipped_steps, engine.loss_scale)
    out["errors"] = errors(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(worker, 3, timeout_s=300)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.multiprocess
def test_sum_count_losses_match_single_process(stage: int, results: list[dict]) -> None:
    count = int((token_batch(ITERATIONS - 1)[1] != -100).sum())
    for max_norm in (None, 0.5):
        ref_losses, ref_state = reference(max_norm)
        for rank, res in enumerate(results):
            losses, state, last_count = res["fp32", stage, max_norm]
            assert max_rel_err(state, ref_state) <= 1e-5, (stage, max_norm, rank)
            assert losses == pytest.approx(ref_losses, rel=1e-5)
            assert last_count == count
    ref_losses, ref_state = reference(None)
    for rank, res in enumerate(results):
        losses, state = res["own", stage]
        assert max_rel_err(state, ref_state) <= 1e-5, (stage, rank)
        assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.multiprocess
def test_mixed_precision_tracks_fp32(stage: int, precision: str, results: list[dict]) -> None:
    ref_losses, ref_state = reference(None)
    for rank, res in enumerate(results):
        losses, state, skipped, scale = res[precision, stage]
        assert skipped == 0 and (scale > 1 if precision == "fp16" else scale == 1)
        assert max(abs(a / b - 1) for a, b in zip(losses, ref_losses)) <= 0.01, (losses, ref_losses)
        assert max_rel_err(state, ref_state) <= 0.02, (stage, precision, rank)
        assert losses == results[0][precision, stage][0]


def test_reference_weights_by_token_not_by_sample() -> None:
    """Guard against a vacuous comparison: per-sample weighting of the same data ends elsewhere."""
    model = make_model()
    opt = make_optimizer(model, "sgd")
    for it in range(ITERATIONS):
        inputs, targets = token_batch(it)
        per_token = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100,
                                    reduction="none").reshape(targets.shape)
        counted = (targets != -100).sum(1)
        (per_token.sum(1)[counted > 0] / counted[counted > 0]).mean().backward()
        opt.step()
        opt.zero_grad()
    assert max_rel_err(model.state_dict(), reference(None)[1]) > 1e-3


@pytest.mark.multiprocess
def test_errors_are_agreed(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        e = res["errors"]
        assert "1 returned mean losses" in e["across"] and "same kind" in e["across"], e["across"]
        assert "rank 0: loss_fn returned a mean loss after a sum loss" in e["within"], e["within"]
        assert "must be finite and non-negative" in e["negative"], e["negative"]
        empty_loss, skipped, moved, next_loss = e["empty"]
        assert math.isnan(empty_loss) and skipped == 1 and moved == 0.0 and math.isfinite(next_loss)
        assert "count 0 items" in e["empty-raise"] and "nonfinite='raise'" in e["empty-raise"], e["empty-raise"]
