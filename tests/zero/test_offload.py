"""Per-rank CPU offload of the optimizer (``RankPlan.offload``): ZeRO-1/2/3 on 3 gloo ranks where
ranks 1 and 2 step their optimizer shard on host copies equal single-process full-batch training
under uneven batch plans, with uneven shard weights, clipping, SGD-momentum and AdamW; mixed
precision and a non-finite skip give what the same run without offload gives; set_plan moves
the optimizer between device and host; checkpoints saved with offload resume without it and the
other way round; plan rows carry the placement; ZeRO-0 refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from poplar.checkpoint import load_checkpoint, save_checkpoint
from poplar.comm import DistributedError
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.profiler.local_comm import LocalCommunicator
from poplar.types.plans import Offload, Plan, PlanError, RankPlan
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import ZeroRuntime
from poplar.types.precision import resolve_precision
from tests.toy import (assert_runs_match_reference, global_batch, loss_fn, make_model, make_optimizer, max_rel_err,
                       rank_slice, reference_run)

ITERATIONS = 3
GBS = 14
CONFIGS = [("sgd", None), ("sgd", 0.5), ("adamw", 0.5)]
OFFLOADED = (Offload.NONE, Offload.OPTIMIZER, Offload.OPTIMIZER)  # ranks 1 and 2 offload


def rows(*rows: tuple[int, int, int], weights: tuple[float, ...] = (1, 1, 1),
         offload: tuple[Offload, ...] = OFFLOADED) -> Plan:
    return Plan([RankPlan(*r, shard_weight=w, offload=o) for r, w, o in zip(rows, weights, offload)])


# n_i = 7, 2, 5 and 10, 0, 4 (an offloading rank with no samples), even shards; then shards 5:1:2 and
# 2:0:1 (offloading rank 1 holds none of the state: empty host copies)
PLANS = [rows((3, 2, 1), (2, 1, 0), (2, 2, 1)),
         rows((3, 3, 1), (0, 0, 0), (2, 2, 0)),
         rows((3, 2, 1), (2, 1, 0), (2, 2, 1), weights=(5, 1, 2)),
         rows((4, 1, 0), (4, 1, 2), (1, 4, 0), weights=(2, 0, 1))]


def _config(stage: int) -> ZeroConfig:
    if stage == 3:  # Linear blocks hold a weight and a bias of two optimizer groups: two units a block
        return ZeroConfig(3, wrap_policy={nn.Linear, nn.LayerNorm})
    return ZeroConfig(stage, bucket_size_mb=0.001)  # buckets of 262 elements: parameters cut across ranks


def _train(rank: int, stage: int, kind: str, plan: Plan, iterations: int = ITERATIONS, **kwargs: object
           ) -> tuple[list[float], PoplarEngine]:
    model = make_model(seed=0)
    engine = PoplarEngine(model, make_optimizer(model, kind), zero_stage=_config(stage), plan=plan, **kwargs)
    losses = [engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), loss_fn) for it in range(iterations)]
    return losses, engine


def parity_worker(rank: int, world: int, stage: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for kind, max_norm in CONFIGS:
        for pi, plan in enumerate(PLANS):
            losses, engine = _train(rank, stage, kind, plan, max_grad_norm=max_norm)
            out[(kind, max_norm, pi)] = (losses, engine.full_state_dict())
            if kind == "adamw" and pi == 0:  # even shards
                out["memory"] = engine.memory_report()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.multiprocess
def test_offloaded_ranks_match_single_process(stage: int) -> None:
    results = spawn(parity_worker, 3, (stage,), timeout_s=240)
    assert_runs_match_reference(results, CONFIGS, len(PLANS), GBS, ITERATIONS)
    kept, offloaded = results[0]["memory"], results[1]["memory"]  # even shards: the same state, elsewhere
    assert kept["optimizer"] > 0 and not any(k.startswith("host_") for k in kept)
    assert offloaded["optimizer"] == 0
    assert offloaded["host_optimizer"] == pytest.approx(kept["optimizer"], rel=0.10)
    assert offloaded["host_master_params"] > 0 and offloaded["host_grads"] == offloaded["host_master_params"]


NAN_AT = 1  # the iteration whose loss is NaN on rank 2


def variants_worker(rank: int, world: int, stage: int) -> dict:
    """Runs whose reference is the same run without offload: mixed precision (bf16, and fp16
    with its loss scaling), a non-finite skip, and the placement switched by set_plan."""
    torch.set_num_threads(1)
    out = {}
    none = (Offload.NONE,) * 3
    for offload in (none, OFFLOADED):
        plan = rows((3, 2, 1), (2, 1, 0), (2, 2, 1), weights=(5, 1, 2), offload=offload)
        for precision in ("bf16", "fp16"):
            losses, engine = _train(rank, stage, "adamw", plan, max_grad_norm=0.5, mixed_precision=precision)
            out[(precision, offload)] = (losses, engine.full_state_dict(), engine.skipped_steps)
        model = make_model(seed=0)
        engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=_config(stage), plan=plan)
        losses = []
        for it in range(ITERATIONS):
            def poisoned(m: nn.Module, x: torch.Tensor, it: int = it) -> torch.Tensor:
                loss = loss_fn(m, x)
                return loss * float("nan") if it == NAN_AT and rank == 2 else loss
            losses.append(engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), poisoned))
        out[("nan", offload)] = (losses, engine.full_state_dict(), engine.skipped_steps)
    # the placement moves between iterations: none, ranks 1 and 2, rank 0 only; and so do the
    # shard weights, re-cut while ranks 1 and 2 are offloaded (before iteration 2). Under mixed
    # precision the reference is the same shard weights without offload
    for precision in (None, "bf16", "fp16"):
        for placements in (SWITCHES, (none,) * 3) if precision else (SWITCHES,):
            out[("switched", precision, placements)] = _switched(rank, stage, placements, precision)
    return out


SWITCHES = ((Offload.NONE,) * 3, OFFLOADED, (Offload.OPTIMIZER, Offload.NONE, Offload.NONE))


def _switched(rank: int, stage: int, placements: tuple[tuple[Offload, ...], ...], precision: str | None
              ) -> tuple[list[float], dict]:
    model = make_model(seed=0)
    plans = [rows((3, 2, 1), (2, 1, 0), (2, 2, 1), offload=o, weights=w)
             for o, w in zip(placements, ((1, 1, 1), (5, 1, 2), (1, 2, 2)))]
    engine = PoplarEngine(model, make_optimizer(model, "adamw"), zero_stage=_config(stage), plan=plans[0],
                          max_grad_norm=0.5, mixed_precision=precision)
    losses = []
    for it, plan in enumerate(plans):
        engine.set_plan(plan)
        losses.append(engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), loss_fn))
    return losses, engine.full_state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.multiprocess
def test_offload_under_mixed_precision_skips_and_switches(stage: int) -> None:
    results = spawn(variants_worker, 3, (stage,), timeout_s=240)
    none = (Offload.NONE,) * 3
    for rank, res in enumerate(results):
        for what in ("bf16", "fp16", "nan"):
            losses, state, skipped = res[(what, OFFLOADED)]
            kept_losses, kept_state, kept_skipped = res[(what, none)]
            assert max_rel_err(state, kept_state) <= 1e-6, (what, rank)
            assert losses == pytest.approx(kept_losses, rel=1e-6, nan_ok=True), (what, rank)
            assert skipped == kept_skipped, (what, rank)
        assert res[("nan", OFFLOADED)][2] == 1
        ref_losses, ref_state = reference_run("adamw", GBS, ITERATIONS, 0.5)
        losses, state = res[("switched", None, SWITCHES)]
        assert max_rel_err(state, ref_state) <= 1e-5, rank
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for precision in ("bf16", "fp16"):
            losses, state = res[("switched", precision, SWITCHES)]
            kept_losses, kept_state = res[("switched", precision, (none,) * 3)]
            assert max_rel_err(state, kept_state) <= 1e-6, (precision, rank)
            assert losses == pytest.approx(kept_losses, rel=1e-6), (precision, rank)


def checkpoint_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    torch.set_num_threads(1)
    none = (Offload.NONE,) * 3
    out = {}
    cases = [(kind, None) for kind in ("sgd", "adamw")] + [("adamw", precision) for precision in ("bf16", "fp16")]
    for (kind, precision), (saved, resumed) in [(c, s) for c in cases for s in ((OFFLOADED, none), (none, OFFLOADED))]:
        where = f"{directory}/{kind}-{precision}-{saved[1].value}"
        plan = rows((3, 2, 1), (2, 1, 0), (2, 2, 1), weights=(5, 1, 2), offload=saved)
        _, engine = _train(rank, stage, kind, plan, iterations=2, max_grad_norm=0.5, mixed_precision=precision)
        save_checkpoint(engine, where)
        plan = rows((3, 2, 1), (2, 1, 0), (2, 2, 1), offload=resumed)  # even shards too
        if precision is not None and saved is none:  # the reference: the run goes on, uninterrupted
            engine.set_plan(rows((3, 2, 1), (2, 1, 0), (2, 2, 1), offload=none))
            loss = engine.train_step(rank_slice(global_batch(2, GBS), plan, rank), loss_fn)
            out[(kind, precision, "uninterrupted")] = (loss, engine.full_state_dict())
        model = make_model(seed=1)  # other initial weights: everything must come from the checkpoint
        engine = PoplarEngine(model, make_optimizer(model, kind), zero_stage=_config(stage), plan=plan,
                              max_grad_norm=0.5, mixed_precision=precision)
        load_checkpoint(engine, where)
        loss = engine.train_step(rank_slice(global_batch(2, GBS), plan, rank), loss_fn)
        out[(kind, precision, saved[1])] = (loss, engine.full_state_dict())
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.multiprocess
def test_checkpoint_resumes_across_offload(stage: int, tmp_path: Path) -> None:
    """Saved with ranks 1 and 2 offloading (shards 5:1:2), resumed without offload (even
    shards), and saved without, resumed with: the third iteration is the uninterrupted one's
    (fp32: single-process training; bf16 and fp16: the same run without offload)."""
    results = spawn(checkpoint_worker, 3, (stage, str(tmp_path)), timeout_s=240)
    for kind in ("sgd", "adamw"):
        ref_losses, ref_state = reference_run(kind, GBS, ITERATIONS, 0.5)
        for rank, res in enumerate(results):
            for saved in (Offload.NONE, Offload.OPTIMIZER):
                loss, state = res[(kind, None, saved)]
                assert max_rel_err(state, ref_state) <= 1e-5, (kind, saved, rank)
                assert loss == pytest.approx(ref_losses[2], rel=1e-5), (kind, saved, rank)
    for precision in ("bf16", "fp16"):  # the master comes from the host copy, and goes back into it
        for rank, res in enumerate(results):
            ref_loss, ref_state = res[("adamw", precision, "uninterrupted")]
            for saved in (Offload.NONE, Offload.OPTIMIZER):
                loss, state = res[("adamw", precision, saved)]
                assert max_rel_err(state, ref_state) <= 1e-6, (precision, saved, rank)
                assert loss == pytest.approx(ref_loss, rel=1e-6), (precision, saved, rank)


# ---------------------------------------------------------------- one process
def test_plan_rows_carry_their_offload() -> None:
    plan = rows((2, 1, 0), (1, 1, 0), (1, 1, 0))
    again = Plan.from_dict(plan.to_dict())
    assert again.offloads == OFFLOADED
    assert '"offload": "optimizer"' in plan.to_json()
    table = plan.table()
    assert "offload" in table and table.count("optimizer") == 2
    even = Plan.even(3, 6, 2).table()  # every table has the column: "none" where nothing offloads
    assert even.splitlines()[0].endswith("offload") and "optimizer" not in even and even.count("none") == 3
    legacy = {"ranks": [{"micro_batch_size": 2, "accum_steps": 1, "shard_weight": 1.0}]}  # before the field
    assert Plan.from_dict(legacy).offloads == (Offload.NONE,)
    for bad in ("gpu", True, None):
        with pytest.raises(PlanError, match="offload"):
            Plan([RankPlan(1, 1, offload=bad)])  # type: ignore[arg-type]


def test_zero0_refuses_offload_naming_the_fix() -> None:
    model = make_model()
    plan = Plan([RankPlan(2, 1, offload=Offload.OPTIMIZER)])
    with pytest.raises(DistributedError, match="ZeRO-0 .*zero_stage=1, 2 or 3"):
        ZeroRuntime(model, make_optimizer(model, "sgd"), plan=plan, zero_stage=ZeroConfig(0), communicator=LocalCommunicator(1, 0))
    runtime = ZeroRuntime(model, make_optimizer(model, "sgd"), plan=Plan([RankPlan(2, 1)]), zero_stage=ZeroConfig(0),
                          communicator=LocalCommunicator(1, 0))
    with pytest.raises(DistributedError, match="ZeRO-0"):
        runtime.set_plan(plan)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_steps_host_copies_and_brings_the_state_back(stage: int) -> None:
    """A world of one: the optimizer steps tensors apart from the stage's shards while offloaded;
    switching back re-points it at the shards with the state it had; training equals the reference."""
    torch.set_num_threads(1)
    model = make_model(seed=0)
    plan = Plan([RankPlan(4, 3, 2, offload=Offload.OPTIMIZER)])
    runtime = ZeroRuntime(model, make_optimizer(model, "sgd"), plan=plan, zero_stage=_config(stage),
                          max_grad_norm=0.5, communicator=LocalCommunicator(1, 0))
    losses = [runtime.train_step(global_batch(0, GBS), loss_fn)]
    stepped = [p for g in runtime.optimizer.param_groups for p in g["params"]]
    shards = runtime.stage.shard_params
    assert len(stepped) == len(shards)
    assert not {p.data_ptr() for p in stepped} & {s.data_ptr() for s in shards}  # separate host copies
    momentum = [runtime.optimizer.state[p]["momentum_buffer"].clone() for p in stepped]
    assert runtime.memory_report()["optimizer"] == 0
    runtime.set_plan(Plan([RankPlan(4, 3, 2)]))
    back = [p for g in runtime.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in back} == {id(s) for s in shards}
    assert all(torch.equal(runtime.optimizer.state[p]["momentum_buffer"], m) for p, m in zip(back, momentum))
    assert runtime.memory_report()["optimizer"] > 0 and "host_optimizer" not in runtime.memory_report()
    runtime.set_plan(plan)
    losses += [runtime.train_step(global_batch(it, GBS), loss_fn) for it in (1, 2)]
    ref_losses, ref_state = reference_run("sgd", GBS, ITERATIONS, 0.5)
    assert max_rel_err(runtime.full_state_dict(), ref_state) <= 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_offloaded_master_lives_on_the_host_only(stage: int, precision: str) -> None:
    """Under mixed precision an offloading rank's device keeps no fp32 master: its storage is
    freed while the optimizer steps on the host, and comes back with the host's values when the
    optimizer returns to the device; states read while offloaded, and training, equal the run
    that never offloads."""
    torch.set_num_threads(1)
    runs = {}
    for offload in (Offload.NONE, Offload.OPTIMIZER):
        model = make_model(seed=0)
        runtime = ZeroRuntime(model, make_optimizer(model, "adamw"), plan=Plan([RankPlan(4, 3, 2, offload=offload)]),
                              zero_stage=_config(stage), max_grad_norm=0.5, mixed_precision=resolve_precision(precision),
                              communicator=LocalCommunicator(1, 0))
        stage_ = runtime.stage
        masters = stage_.masters if stage < 3 else [b.shard for b in stage_.blocks]
        losses = [runtime.train_step(global_batch(it, GBS), loss_fn) for it in range(2)]
        held = [m.untyped_storage().nbytes() for m in masters]
        report, state = runtime.memory_report(), runtime.full_state_dict()
        runtime.set_plan(Plan([RankPlan(4, 3, 2)]))  # the optimizer back on the device
        back = [m.untyped_storage().nbytes() for m in masters]
        losses.append(runtime.train_step(global_batch(2, GBS), loss_fn))
        runs[offload] = (losses, state, runtime.full_state_dict(), report, held, back)
    kept, moved = runs[Offload.NONE], runs[Offload.OPTIMIZER]
    assert all(n > 0 for n in kept[4]) and all(n == 0 for n in moved[4])  # the device masters freed
    assert moved[5] == kept[4]  # and back
    assert kept[3]["master_params"] > 0 and moved[3]["master_params"] == 0
    assert moved[3]["host_master_params"] == kept[3]["master_params"]
    for got, want in ((moved[1], kept[1]), (moved[2], kept[2])):
        assert max_rel_err(got, want) <= 1e-6
    assert moved[0] == pytest.approx(kept[0], rel=1e-6)
