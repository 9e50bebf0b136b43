"""A rank left out of the training step (a row of 0 samples and shard weight 0, docs/design.md
§3.12): on 4 gloo ranks with weights 2:1:0:1 and uneven batches, ZeRO-1/2/3 equal single-process
training on the remaining global batch, flat and on hierarchical collectives over 2 + 2 nodes (rank
2 left out: the step's own nodes are 0, 1 | 3; and a whole node left out); the rank left out issues no collective of a step; a checkpoint saved with a rank
left out loads into a plan where every rank works, and a running engine lets the rank rejoin,
each going on as the uninterrupted reference. A wrong batch or a non-finite loss on any rank is
the same verdict on every rank, the rank left out included, as when every rank is in the step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from poplar.checkpoint import load_checkpoint, save_checkpoint
from poplar.comm import DistributedError, Phase
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.types.plans import Plan, PlanError, RankPlan
from poplar.types.route import Collectives
from poplar.types.topology import Topology
from poplar.zero.config import ZeroConfig
from poplar.zero.failures import IterationFailed
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, rank_slice, reference_run

GBS = 12
ITERATIONS = 3
KIND = "sgd"  # SGD with momentum, no clipping: a wrong gradient factor shows
STEP_PHASES = {str(Phase.FORWARD), str(Phase.BACKWARD), str(Phase.STEP)}

# rank 2 sits out: n_i = 5, 3, 0, 4 in micro-steps of unequal counts (3, 1, 0, 2)
LEFT_OUT = Plan([RankPlan(2, 2, 1, shard_weight=2), RankPlan(3, 1, 0, shard_weight=1),
                 RankPlan(0, 0, 0, shard_weight=0), RankPlan(2, 1, 2, shard_weight=1)])
# the same rows on hierarchical collectives over 2 + 2 nodes: ranks 0, 1 | 3 in the step (ZeRO-3:
# with secondary shards)
SPANNING = Plan(LEFT_OUT.ranks, collectives=Collectives.HIERARCHICAL)
# the same, crossing nodes once per iteration (the step's own nodes 0, 1 | 3)
ONCE = Plan(LEFT_OUT.ranks, collectives=Collectives.ONCE_PER_ITERATION)
# node [2, 3] sits out: n_i = 7, 5
NODE_OUT = Plan([RankPlan(3, 2, 1, shard_weight=2), RankPlan(2, 2, 1, shard_weight=1),
                 RankPlan(0, 0, 0, shard_weight=0), RankPlan(0, 0, 0, shard_weight=0)],
                collectives=Collectives.HIERARCHICAL)
# every rank works, even shards: n_i = 3, 3, 3, 3
EVERY = Plan([RankPlan(1, 3, 0), RankPlan(3, 1, 0), RankPlan(1, 3, 0), RankPlan(2, 1, 1)])
TOPOLOGY = Topology.of_sizes([2, 2])


def _config(stage: int, topology: Topology | None = None, nonfinite: str = "skip") -> ZeroConfig:
    if stage == 3:
        return ZeroConfig(3, wrap_policy={nn.Linear, nn.LayerNorm}, topology=topology, nonfinite=nonfinite)
    return ZeroConfig(stage, bucket_size_mb=0.001, topology=topology, nonfinite=nonfinite)


def _engine(stage: int, plan: Plan, topology: Topology | None = None, nonfinite: str = "skip") -> PoplarEngine:
    model = make_model(seed=0)
    return PoplarEngine(model, make_optimizer(model, KIND), zero_stage=_config(stage, topology, nonfinite), plan=plan)


def _train(engine: PoplarEngine, plan: Plan, rank: int, iterations: range) -> list[float]:
    return [engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), loss_fn) for it in iterations]


class Heard:
    """A collective observer that keeps the ops it hears issued (what the emulated network paces)."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def issued(self, op: str, nbytes: int, wire: object) -> None:
        self.ops.append(op)

    def done(self, ticket: object) -> None:
        pass


def parity_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for stage in (1, 2, 3):
        for name, plan, topology in [("flat", LEFT_OUT, None), ("node", NODE_OUT, TOPOLOGY),
                                     ("hier", SPANNING, TOPOLOGY), ("once", ONCE, TOPOLOGY)]:
            if name == "hier" and stage == 3:
                plan = Plan(plan.ranks, collectives=Collectives.SECONDARY_SHARDS)
            engine = _engine(stage, plan, topology)
            heard = Heard()
            with engine.comm.observed(heard):  # the step's collectives run on the step's own communicator
                losses = _train(engine, plan, rank, range(ITERATIONS))
            out[(stage, name, "heard")] = sorted(set(heard.ops))
            step_records = [r for r in engine.comm_ledger.of() if r.phase in STEP_PHASES]
            links = {str(r.link) for r in step_records}
            tags = sorted({r.tag for r in step_records})
            counts = [(t, sum(1 for r in step_records if r.tag == t)) for t in tags]
            out[(stage, name)] = (losses, engine.full_state_dict(), counts, engine.iteration, links)
            out[(stage, name, "secondary")] = engine.memory_report().get("secondary_params", 0)
    return out


def _remaining_batch_reference(plan: Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batch the ranks in the step take (the whole batch:
    a rank left out takes none of it)."""
    assert plan.global_batch_size == GBS
    return reference_run(KIND, GBS, ITERATIONS, None)


@pytest.mark.multiprocess
def test_ranks_in_the_step_equal_the_reference_and_the_left_out_rank_issues_no_step_collective() -> None:
    results = spawn(parity_worker, 4, (), timeout_s=300)
    for stage in (1, 2, 3):
        for name, plan in [("flat", LEFT_OUT), ("node", NODE_OUT), ("hier", SPANNING), ("once", ONCE)]:
            ref_losses, ref_state = _remaining_batch_reference(plan)
            for rank, res in enumerate(results):
                losses, state, step_collectives, iteration, links = res[(stage, name)]
                if name in ("hier", "once") and rank not in plan.left_out:  # the step's own nodes: 0, 1 | 3
                    assert "cross-node" in links and ("intra-node" in links) == (rank < 2), (stage, rank, links)
                    assert (res[(stage, name, "secondary")] > 0) == (stage == 3), (stage, rank)
                assert iteration == ITERATIONS, (stage, name, rank)
                assert max_rel_err(state, ref_state) <= 1e-5, (stage, name, rank)  # a state collective: every rank
                # every rank learns the loss at the status reduction, the one collective of an
                # iteration that the rank left out joins
                assert losses == pytest.approx(ref_losses, rel=1e-5), (stage, name, rank)
                heard = res[(stage, name, "heard")]
                if rank in plan.left_out:
                    assert step_collectives == [("status", ITERATIONS)], (stage, name, rank)
                    assert "reduce_scatter" not in heard, (stage, name, rank)
                else:
                    assert len(step_collectives) > 1, (stage, name, rank)
                    # an observer of the engine's communicator hears the step's collectives too
                    assert "reduce_scatter" in heard or "exchange" in heard, (stage, name, rank, heard)


def rejoin_worker(rank: int, world: int, directory: str) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for stage in (2, 3):
        engine = _engine(stage, LEFT_OUT)
        _train(engine, LEFT_OUT, rank, range(ITERATIONS - 1))
        path = Path(directory) / f"stage{stage}"
        save_checkpoint(engine, path)
        engine.set_plan(EVERY)  # the rank rejoins the running engine
        live = _train(engine, EVERY, rank, range(ITERATIONS - 1, ITERATIONS))
        out[(stage, "live")] = (live, engine.full_state_dict())
        resumed = _engine(stage, EVERY)
        load_checkpoint(resumed, path)
        losses = _train(resumed, EVERY, rank, range(ITERATIONS - 1, ITERATIONS))
        out[(stage, "loaded")] = (losses, resumed.full_state_dict())
    return out


@pytest.mark.multiprocess
def test_a_left_out_rank_rejoins_from_a_checkpoint_or_a_new_plan(tmp_path: Path) -> None:
    results = spawn(rejoin_worker, 4, (str(tmp_path),), timeout_s=300)
    ref_losses, ref_state = reference_run(KIND, GBS, ITERATIONS, None)
    for stage in (2, 3):
        for how in ("live", "loaded"):
            for rank, res in enumerate(results):
                losses, state = res[(stage, how)]
                assert max_rel_err(state, ref_state) <= 1e-5, (stage, how, rank)
                assert losses == pytest.approx(ref_losses[-1:], rel=1e-5), (stage, how, rank)


# rank 1 sits out of 2 + 2 nodes: n_i = 5, 0, 6, 4 (15 samples)
ROWS_15 = Plan([RankPlan(2, 2, 1, shard_weight=2), RankPlan(0, 0, 0, shard_weight=0),
                RankPlan(3, 2, 0, shard_weight=2), RankPlan(2, 1, 2, shard_weight=1)],
               collectives=Collectives.HIERARCHICAL)


def _nan_on_rank_0(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(model, tokens)
    return loss * math.nan if torch.distributed.get_rank() == 0 else loss


def _outcome(engine: PoplarEngine, batch: torch.Tensor, fn=loss_fn) -> tuple[str, str]:
    try:
        return "loss", repr(engine.train_step(batch, fn))
    except DistributedError as e:  # IterationFailed included
        return type(e).__name__, str(e)


def errors_worker(rank: int, world: int) -> dict:
    """Refused plans, and each rank's input errors with rank 1 left out, each followed by a good
    iteration (ZeRO-3 over 2 + 2 nodes)."""
    torch.set_num_threads(1)
    out: dict = {}
    try:
        _engine(0, LEFT_OUT)
        out["zero0"] = None
    except (DistributedError, PlanError) as e:  # agreed at set-up, or the same verdict on every rank
        out["zero0"] = str(e)
    batch = global_batch(0, 15)
    mine = rank_slice(batch, ROWS_15, rank)
    engine = _engine(3, ROWS_15, TOPOLOGY)
    before = engine.full_state_dict()
    out["wrong_size"] = _outcome(engine, batch[:14] if rank == 2 else mine)  # the global batch on rank 2
    out["left_out_given"] = _outcome(engine, batch[:3] if rank == 1 else mine)
    out["nonfinite_skip"] = _outcome(engine, mine, _nan_on_rank_0)
    out["skipped"], out["unchanged"] = engine.skipped_steps, max_rel_err(engine.full_state_dict(), before) == 0
    out["good"], out["iteration"] = _outcome(engine, mine), engine.iteration
    raising = _engine(3, ROWS_15, TOPOLOGY, nonfinite="raise")
    out["nonfinite_raise"] = _outcome(raising, mine, _nan_on_rank_0)
    return out


@pytest.mark.multiprocess
def test_plans_that_cannot_leave_ranks_out_name_the_fix_and_input_errors_are_every_ranks_verdict() -> None:
    results = spawn(errors_worker, 4, (), timeout_s=120, collective_timeout_s=20)
    for res in results:
        assert "ZeRO-1, 2 and 3" in res["zero0"]
    for case, kind, words in [
            ("wrong_size", "IterationFailed", ["rank 2: batch has 14 samples", "needs 6"]),
            ("left_out_given", "IterationFailed", ["rank 1: the plan leaves this rank out", "given 3 samples"]),
            ("nonfinite_raise", "DistributedError", ["non-finite loss or gradients (nonfinite='raise')"])]:
        said = {res[case] for res in results}
        assert len(said) == 1, (case, said)  # the same error on every rank, the rank left out included
        got_kind, message = said.pop()
        assert got_kind == kind and all(w in message for w in words), (case, got_kind, message)
    for rank, res in enumerate(results):
        assert res["nonfinite_skip"] == ("loss", "nan") and res["skipped"] == 1 and res["unchanged"], rank
        assert res["good"][0] == "loss" and math.isfinite(float(res["good"][1])), rank
        assert res["iteration"] == 2, rank  # the failed iterations are not counted, the skipped one is
    assert len({res["good"] for res in results}) == 1
