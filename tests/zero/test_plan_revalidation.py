"""A plan is checked again whenever a runtime takes it (it may have been edited since it was
built): rows of zeros are a clear error, never a nan loss; and a checkpoint is refused while an
iteration is open (``ZeroRuntime.in_iteration``)."""

from __future__ import annotations

import pytest

from poplar.checkpoint import CheckpointError, save_checkpoint
from poplar.comm import DistributedError
from poplar.engine import PoplarEngine
from poplar.types.plans import Plan, PlanError, RankPlan
from tests.toy import global_batch, loss_fn, make_model, make_optimizer
from poplar.zero.runtime import PlanCheck


def _engine() -> PoplarEngine:
    model = make_model()
    return PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=1, plan=Plan.even(1, 4, 2), loss_fn=loss_fn)


def test_an_edited_plan_of_zero_rows_is_refused_by_both_plan_checks() -> None:
    engine = _engine()
    plan = Plan.even(1, 4, 2)
    plan.ranks[0] = RankPlan(0, 0, 0)  # edited after construction: 0 samples per iteration
    with pytest.raises(DistributedError, match="plan processes 0 samples per iteration"):
        engine.set_plan(plan)
    with pytest.raises(PlanError, match="plan processes 0 samples per iteration"):
        engine.set_plan(plan, PlanCheck.LOCAL)
    plan.ranks[0] = {"micro_batch_size": 2, "accum_steps": 2}
    with pytest.raises(PlanError, match="plan rank 0 must be a RankPlan, got dict"):
        engine.set_plan(plan, PlanCheck.LOCAL)
    plan.ranks[0] = RankPlan(2, -1, 0)
    with pytest.raises(PlanError, match="accum_steps must be >= 0"):
        engine.set_plan(plan, PlanCheck.LOCAL)
    loss = engine.train_step(global_batch(0, 4))  # the engine kept its good plan
    assert loss == loss and engine.global_batch_size == 4


def test_a_save_inside_an_iteration_is_refused(tmp_path) -> None:
    engine = _engine()
    assert not engine.in_iteration
    loss = loss_fn(engine.module, global_batch(0, 2))  # a user's loop: the forward opens the iteration
    assert engine.in_iteration
    with pytest.raises(CheckpointError, match="middle of an iteration"):
        save_checkpoint(engine, tmp_path / "c")
    engine.backward(loss, 2)
    engine.backward(loss_fn(engine.module, global_batch(0, 2)), 2)
    engine.step()
    assert not engine.in_iteration
    save_checkpoint(engine, tmp_path / "c")
