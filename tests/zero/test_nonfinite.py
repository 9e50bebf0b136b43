"""Non-finite losses and gradients: one agreed verdict in the status reduction skips the step on
every rank (state bitwise unchanged) or raises on every rank; fp16 loss scaling backs off on an
overflow and grows after a clean window (docs/design.md §3.4, §3.7)."""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

import pytest
import torch

from poplar.comm import DistributedError
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.types.precision import LossScaleConfig, MixedPrecision
from poplar.zero.loss_scaler import LossScaler
from poplar.zero.nonfinite import NonFiniteGuard, NonFinitePolicy, Verdict
from poplar.types.plans import Plan
from poplar.types.route import Collectives
from poplar.types.topology import Topology
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, plan_of, rank_slice, with_shards
from tests.zero.test_stage3_common import tiny_lm
from poplar.zero.config import ZeroConfig

PLAN = with_shards(plan_of((2, 2, 1), (3, 1, 0)), (3, 1))  # n_i = 5, 3; shards 3:1


class Injected:
    """``loss_fn`` times ``factor`` on rank ``rank`` at the iterations in ``at``."""

    def __init__(self, engine: PoplarEngine, rank: int, at: set[int], factor: float) -> None:
        self.engine, self.rank, self.at, self.factor = engine, rank, at, factor

    def __call__(self, module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(module, batch)
        if self.engine.rank == self.rank and self.engine.iteration in self.at:
            loss = loss * self.factor
        return loss


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def snapshot(engine: PoplarEngine) -> tuple[dict, dict, list]:
    """The whole master, this rank's optimizer state and its compute copy (stages 0-2)."""
    params = [p.detach().clone() for p in engine.module.parameters()] if engine.zero_stage < 3 else []
    return engine.full_state_dict(), copy.deepcopy(engine.optimizer.state_dict()), params


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def engine_for(stage: int, nonfinite: str = "skip", way: Collectives = Collectives.FLAT, **kwargs: Any) -> PoplarEngine:
    """``way``: the plan's collectives; other than flat, over the two ranks as two nodes of one."""
    model = make_model() if stage < 3 else tiny_lm()
    topology = None if way is Collectives.FLAT else Topology.of_sizes([1, 1])
    return PoplarEngine(model, make_optimizer(model, "sgd"), plan=Plan(PLAN.ranks, collectives=way),
                        zero_stage=ZeroConfig(stage, bucket_size_mb=0.001, nonfinite=nonfinite, topology=topology),
                        **kwargs)


def train(engine: PoplarEngine, rank: int, iterations: int, loss: Any) -> tuple[list[float], list[bool]]:
    """Losses, and for each iteration whether the state stayed bitwise what it was before it."""
    losses, unchanged = [], []
    for it in range(iterations):
        before = snapshot(engine)
        losses.append(engine.train_step(rank_slice(global_batch(it, PLAN.global_batch_size), PLAN, rank), loss))
        unchanged.append(same(before, snapshot(engine)))
    return losses, unchanged


def skip_runs(rank: int, world: int) -> dict:
    log = logging.getLogger("poplar")
    out: dict = {}
    for stage in (0, 3):
        for name, factor in (("inf", float("inf")), ("nan", float("nan"))):
            handler = Warnings()
            log.addHandler(handler)
            engine = engine_for(stage)
            losses, unchanged = train(engine, rank, 5, Injected(engine, 1, {2}, factor))
            log.removeHandler(handler)
            out[(stage, name)] = (losses, unchanged, engine.skipped_steps, handler.messages)
        engine = engine_for(stage)
        errors, losses = [], []
        for it in range(7):
            try:
                losses.append(engine.train_step(rank_slice(global_batch(it, 8), PLAN, rank),
                                                Injected(engine, 1, set(range(10)), float("inf"))))
            except DistributedError as e:
                errors.append((it, str(e)))
        out[(stage, "consecutive")] = (losses, errors, engine.skipped_steps)
        engine = engine_for(stage, nonfinite="raise")
        before = snapshot(engine)
        try:
            engine.train_step(rank_slice(global_batch(0, 8), PLAN, rank), Injected(engine, 1, {0}, float("nan")))
            error = "no error"
        except DistributedError as e:
            error = str(e)
        out[(stage, "raise")] = (error, same(before, snapshot(engine)))
    return out


FP16_RUNS = [0, 1, 2, 3, (2, Collectives.ONCE_PER_ITERATION), (3, Collectives.ONCE_PER_ITERATION)]


def fp16_runs(rank: int, world: int) -> dict:
    out = {}
    for run in FP16_RUNS:
        stage, way = run if isinstance(run, tuple) else (run, Collectives.FLAT)
        config = LossScaleConfig(initial_scale=2.0 ** 10, growth_interval=3, hysteresis=1)
        engine = engine_for(stage, way=way,
                            mixed_precision=MixedPrecision(param_dtype=torch.float16, loss_scale=config))
        scales = []
        injected = Injected(engine, 1, {2}, float("inf"))
        losses, unchanged = [], []
        for it in range(8):
            before = snapshot(engine)
            losses.append(engine.train_step(rank_slice(global_batch(it, 8), PLAN, rank), injected))
            unchanged.append(same(before, snapshot(engine)))
            scales.append(engine.loss_scale)
        out[run] = (losses, unchanged, scales, engine.skipped_steps, engine.loss_scaler.state_dict(),
                    engine.full_state_dict())
    for stage in (1, 3):  # gradients reduced in fp16: too large a scale overflows the reduction
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float16,
                                loss_scale=LossScaleConfig(initial_scale=2.0 ** 20, hysteresis=1))
        engine = engine_for(stage, mixed_precision=policy)
        losses = [engine.train_step(rank_slice(global_batch(it, 8), PLAN, rank), loss_fn) for it in range(8)]
        sizes = [u.padded_numel for u in engine.stage.units] if stage < 3 else [b.full_numel for b in engine.stage.blocks]
        wire = ({r.bytes for r in engine.comm_ledger.records if r.op == "reduce_scatter"}, {2 * n for n in sizes})
        out[("fp16-reduce", stage)] = (losses, engine.skipped_steps, engine.loss_scale, wire)
    return out


def everything(rank: int, world: int) -> dict:
    return {"skip": skip_runs(rank, world), "fp16": fp16_runs(rank, world)}


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return spawn(everything, 2, (), timeout_s=300)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.multiprocess
def test_fp32_nonfinite_loss_skips_the_step_on_every_rank(stage: int, kind: str) -> None:
    for rank, res in enumerate(results()):
        losses, unchanged, skipped, warnings = res["skip"][(stage, kind)]
        assert skipped == 1
        assert unchanged == [False, False, True, False, False], (rank, unchanged)  # only iteration 2 kept the state
        assert not torch.isfinite(torch.tensor(losses[2])) and torch.isfinite(torch.tensor(losses[:2] + losses[3:])).all()
        assert losses[4] < losses[0]  # training went on
        if rank == 0:  # one line per skip, on rank 0 only
            # at stage 3 both ranks' shards hold rank 1's inf or NaN (the reduce-scatter spread it), yet
            # the line names where it arose: rank 1's own loss
            assert len(warnings) == 1 and "iteration 2: non-finite loss on rank 1 (1 of 2 ranks)" in warnings[0], \
                warnings
        else:
            assert not warnings


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.multiprocess
def test_too_many_consecutive_skips_raise_on_every_rank(stage: int) -> None:
    for res in results():
        losses, errors, skipped = res["skip"][(stage, "consecutive")]
        assert len(losses) == 5 and all(not torch.isfinite(torch.tensor(x)) for x in losses)
        assert errors and errors[0][0] == 5 and skipped >= 6
        assert "6 consecutive steps had non-finite loss or gradients" in errors[0][1]
        assert "max_consecutive_skips=5" in errors[0][1] and "rank 1: loss sum inf" in errors[0][1]


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.multiprocess
def test_raise_policy_raises_at_once(stage: int) -> None:
    for res in results():
        error, unchanged = res["skip"][(stage, "raise")]
        assert "iteration 0: non-finite loss or gradients (nonfinite='raise')" in error
        assert "rank 1: loss sum nan" in error  # (at stage 3 rank 0's reduced shards hold NaN too)
        assert unchanged


@pytest.mark.parametrize("stage", FP16_RUNS, ids=str)
@pytest.mark.multiprocess
def test_fp16_overflow_skips_and_backs_off(stage: int | tuple[int, Collectives]) -> None:
    """Also across nodes once per iteration (two nodes of one rank): the same skip, and the same
    training as on flat collectives (the sums in another order)."""
    first = results()[0]["fp16"][stage]
    for rank, res in enumerate(results()):
        losses, unchanged, scales, skipped, state, weights = res["fp16"][stage]
        if isinstance(stage, tuple):
            flat = res["fp16"][stage[0]]
            assert losses == pytest.approx(flat[0], rel=1e-5, nan_ok=True) and max_rel_err(weights, flat[5]) <= 1e-5
        assert skipped == 1 and unchanged == [False, False, True] + [False] * 5, (rank, unchanged)
        # 2 good steps, overflow: halve; 3 good steps: grow; 2 more good steps
        assert scales == [1024, 1024, 512, 512, 512, 1024, 1024, 1024], scales
        assert state == {"scale": 1024.0, "good_steps": 2, "hysteresis_left": 1}
        assert losses == first[0]  # the same on every rank
        assert all(torch.isfinite(torch.tensor(x)) for i, x in enumerate(losses) if i != 2)
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.multiprocess
def test_fp16_reduction_overflow_is_caught(stage: int) -> None:
    """At stage 1 the local gradients are checked before the reduction: each must leave room for
    the sum over ranks in fp16; at stage 3 the reduced shards show the overflow."""
    first = results()[0]["fp16"][("fp16-reduce", stage)]
    for res in results():
        losses, skipped, scale, wire = res["fp16"][("fp16-reduce", stage)]
        assert (losses, skipped, scale) == first[:3]
        assert 1 <= skipped < 8 and scale < 2.0 ** 20
        assert all(torch.isfinite(torch.tensor(x)) for x in losses[skipped:]) and losses[-1] < max(losses)
        sent, fp16_sizes = wire
        assert sent == fp16_sizes  # the wire carries 2-byte elements


def test_loss_scaler_rules() -> None:
    scaler = LossScaler(LossScaleConfig(initial_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0))
    scaler.on_overflow()  # tolerated by hysteresis
    assert scaler.scale == 8.0 and not scaler.at_minimum
    scaler.on_overflow()
    assert scaler.scale == 4.0
    scaler.on_overflow()  # hysteresis is spent until a good step
    assert scaler.scale == 2.0 and scaler.at_minimum
    scaler.on_overflow()
    assert scaler.scale == 2.0
    scaler.on_good_step()
    scaler.on_good_step()
    assert scaler.scale == 4.0 and scaler.state_dict() == {"scale": 4.0, "good_steps": 0, "hysteresis_left": 2}
    other = LossScaler(LossScaleConfig())
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()
    static = LossScaler(LossScaleConfig(static_scale=128.0))
    static.on_overflow()
    static.on_good_step()
    assert static.scale == 128.0 and static.at_minimum


def test_guard_counts_only_what_the_scaler_cannot_answer() -> None:
    guard = NonFiniteGuard(NonFinitePolicy("skip"), max_consecutive_skips=1)
    assert guard.on_nonfinite(counted=False) is Verdict.SKIP  # fp16 backing off: normal
    assert guard.on_nonfinite(counted=True) is Verdict.SKIP
    assert guard.on_nonfinite(counted=True) is Verdict.TOO_MANY
    guard.on_step()
    assert guard.on_nonfinite(counted=True) is Verdict.SKIP and guard.skipped_steps == 4
    assert NonFiniteGuard(NonFinitePolicy.RAISE, 5).on_nonfinite(counted=True) is Verdict.RAISE


def test_fp16_matmul_runs_on_cpu() -> None:
    """torch on CPU computes float16 matmuls, norms and losses (the fp16 tests above rely on it)."""
    model = make_model().to(torch.float16)
    loss = loss_fn(model, global_batch(0, 4))
    loss.backward()
    assert loss.dtype == torch.float16 and model.embed.weight.grad.dtype == torch.float16


def test_the_skip_line_says_where_the_inf_or_nan_arose_and_no_more() -> None:
    from poplar.zero.nonfinite import where_nonfinite

    # a loss is local: the ranks are named, however many shards the reduce-scatter spread it to
    assert where_nonfinite((1,), 4, 4, reduced=True) == "non-finite loss on rank 1 (1 of 4 ranks)"
    assert where_nonfinite((0, 2), 2, 4, reduced=False) == "non-finite loss on ranks 0, 2 (2 of 4 ranks)"
    # local gradients (stages 0/1): the count is where it arose; reduced shards: only where it ended up
    assert where_nonfinite((), 1, 4, reduced=False) == "non-finite gradients on 1 of 4 ranks"
    assert where_nonfinite((), 4, 4, reduced=True).startswith(
        "non-finite gradients in the reduced gradient shards of 4 of 4 ranks")
