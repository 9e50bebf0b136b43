"""Bad input gives the same clear error on every rank, never a hang, and loses nothing."""

from __future__ import annotations

import pytest
import torch

from poplar.engine import PoplarEngine
from poplar.process.launch import spawn
from poplar.types.plans import Plan
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, plan_of, rank_slice

PLAN = plan_of((3, 2, 1), (2, 1, 0))  # n_i = 7, 2


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank saw
        return f"{type(e).__name__}: {e}"
    return "no error"


def setup_errors(rank: int, world: int, case: str) -> str:
    model = make_model()
    opt = make_optimizer(model, "sgd")
    kwargs = {"zero_stage": 1, "plan": PLAN}
    if case == "plan_length":
        kwargs["plan"] = plan_of((3, 2, 1), (2, 1, 0), (1, 1, 0))
    elif case == "stage":
        kwargs["zero_stage"] = 4
    elif case == "foreign_optimizer":
        opt = torch.optim.SGD(list(model.parameters()) + [torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    elif case == "plans_differ" and rank == 1:
        kwargs["plan"] = plan_of((3, 2, 0), (2, 2, 0))
    elif case == "stage_on_one_rank" and rank == 0:
        kwargs["zero_stage"] = -1
    elif case == "shapes_differ" and rank == 1:
        from tests.toy import TiedNet
        model = TiedNet(hidden=30)
        opt = make_optimizer(model, "sgd")
    return _error_of(lambda: PoplarEngine(model, opt, **kwargs))


@pytest.mark.parametrize("case, needle", [
    ("plan_length", "plan has 3 rows but the world has 2 ranks"),
    ("stage", "zero_stage must be 0, 1, 2 or 3, got 4"),
    ("foreign_optimizer", "not a parameter of the model"),
    ("plans_differ", "rank 1 was given a different plan than rank 0"),
    ("shapes_differ", "rank 1's parameter 'up.weight' has shape [30, 13] (torch.float32) but rank 0's has [29, 13]"),
    ("stage_on_one_rank", "rank 0: zero_stage must be 0, 1, 2 or 3, got -1"),
])
@pytest.mark.multiprocess
def test_setup_errors_on_every_rank(case: str, needle: str) -> None:
    errors = spawn(setup_errors, 2, (case,), timeout_s=60, collective_timeout_s=20)
    for rank, err in enumerate(errors):
        assert err.startswith("DistributedError") and needle in err, (rank, err)


def bad_batch(rank: int, world: int, stage: int) -> tuple[str, str, float, float]:
    model = make_model()
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=stage, plan=PLAN)
    before = engine.full_state_dict()
    batch = rank_slice(global_batch(0, 9), PLAN, rank)
    wrong = batch[:-1] if rank == 1 else batch  # only rank 1 is wrong
    size_err = _error_of(lambda: engine.train_step(wrong, loss_fn))

    def raising_loss(module, mb):
        if rank == 0:
            raise RuntimeError("user loss exploded")
        return loss_fn(module, mb)

    loss_err = _error_of(lambda: engine.train_step(batch, raising_loss))
    unchanged = max_rel_err(engine.full_state_dict(), before)
    engine.train_step(batch, loss_fn)  # the engine is still usable afterwards
    moved = max_rel_err(engine.full_state_dict(), before)
    return size_err, loss_err, unchanged, moved


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.multiprocess
def test_bad_batch_on_one_rank(stage: int) -> None:
    for rank, (size_err, loss_err, unchanged, moved) in enumerate(
            spawn(bad_batch, 2, (stage,), timeout_s=90, collective_timeout_s=30)):
        assert "rank 1: batch has 1 samples but this rank's plan row" in size_err, size_err
        assert "no optimizer step was taken" in size_err
        assert "rank 0: micro-step 0: RuntimeError: user loss exploded" in loss_err, loss_err
        assert unchanged == 0.0 and moved > 0.0


def test_batch_structure_errors() -> None:
    from poplar.zero.batches import batch_size_of, slice_batch
    assert batch_size_of({"x": torch.zeros(4, 2), "y": (torch.zeros(4), "meta")}) == 4
    with pytest.raises(ValueError, match="disagree"):
        batch_size_of((torch.zeros(4), torch.zeros(3)))
    with pytest.raises(ValueError, match="no tensor"):
        batch_size_of([1, 2])
    sliced = slice_batch({"x": torch.arange(6), "n": 3}, 2, 3)
    assert sliced["x"].tolist() == [2, 3, 4] and sliced["n"] == 3


def test_single_process_engine_matches_plain_training() -> None:
    """Without torch.distributed the engine is a world of one."""
    from tests.toy import reference_run
    model = make_model()
    plan = Plan.even(1, 14, 4)
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=2, plan=plan)
    losses = [engine.train_step(global_batch(it, 14), loss_fn) for it in range(3)]
    ref_losses, ref_state = reference_run("sgd", 14, 3, None)
    assert max_rel_err(engine.full_state_dict(), ref_state) <= 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def dies_mid_training(rank: int, world: int, stage: int) -> None:
    import os
    model = make_model()
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=stage, plan=PLAN)
    for it in range(4):
        if rank == 1 and it == 2:
            os._exit(7)
        engine.train_step(rank_slice(global_batch(it, 9), PLAN, rank), loss_fn)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.multiprocess
def test_dead_rank_makes_the_others_fail_clearly(stage: int) -> None:
    import time
    from poplar.process.launch import RankFailure
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(dies_mid_training, 2, (stage,), timeout_s=60, collective_timeout_s=20, grace_s=30)
    assert "exit code 7" in info.value.failures[1]
    assert "DistributedError" in info.value.failures[0] and "another rank probably died" in info.value.failures[0]
    assert time.monotonic() - t0 < 45
