"""ZeRO-1's closing reduction overlaps the last backward (poplar.zero.stage1): in train_step each
unit is reduce-scattered as soon as the rank's last backward has filled it, every rank sends each
unit once per iteration in the same order (a rank with no samples, after its micro-steps), and
the ledger still counts them as the iteration's closing collectives."""

from __future__ import annotations

from typing import Any

import pytest

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.zero.config import ZeroConfig
from poplar.zero.observers import StepObserver
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, plan_of, rank_slice, \
    reference_run

PLAN = plan_of((2, 2, 1), (0, 0, 0), (3, 1, 0))  # 3 micro-steps, none, one: a global batch of 8


class WhereIssued(StepObserver):
    """Which micro-step's backward (or none: -1) each tensor collective was issued in."""

    def __init__(self) -> None:
        self.backward_of: int = -1
        self.issued: list[tuple[str, int]] = []

    def backward_start(self, step: Any, objective: Any) -> None:
        self.backward_of = step.index

    def backward_end(self, step: Any) -> None:
        self.backward_of = -1

    def micro_step_abort(self, step: Any, error: BaseException) -> None:
        self.backward_of = -1

    # the collective observer's side
    def issued_collective(self, op: str, nbytes: int) -> None:
        self.issued.append((op, self.backward_of))


class Listener:
    def __init__(self, where: WhereIssued) -> None:
        self.where = where

    def issued(self, op: str, nbytes: int, wire: Any) -> None:
        self.where.issued_collective(op, nbytes)

    def done(self, ticket: Any) -> None:
        pass


def overlap_worker(rank: int, world: int) -> dict:
    model = make_model()
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=ZeroConfig(1, bucket_size_mb=0.001),
                          plan=PLAN)
    where = WhereIssued()
    engine.add_observer(where)
    losses = []
    with engine.comm.observed(Listener(where)):
        for it in range(2):
            where.issued.clear()
            losses.append(engine.train_step(rank_slice(global_batch(it, 8), PLAN, rank), loss_fn))
    records = [r for r in engine.comm_ledger.records if r.iteration == 1 and r.op == "reduce_scatter"]
    return {"issued": where.issued, "units": len(engine.stage.units), "losses": losses,
            "phases": sorted({r.phase for r in records}), "state": engine.full_state_dict()}


@pytest.mark.multiprocess
def test_zero1_reduces_each_unit_once_as_the_last_backward_fills_it() -> None:
    results = spawn(overlap_worker, 3, timeout_s=120)
    units = results[0]["units"]
    assert units >= 3  # small buckets: several units, so the overlap has something to overlap
    last = {0: 2, 1: -1, 2: 0}  # each rank's last micro-step (rank 1 has none)
    for rank, res in enumerate(results):
        scatters = [where for op, where in res["issued"] if op == "reduce_scatter"]
        assert len(scatters) == units, (rank, res["issued"])
        if last[rank] >= 0:  # most go out inside the last backward; none in an earlier one
            assert sum(w == last[rank] for w in scatters) >= units - 1, (rank, scatters)
            assert all(w in (last[rank], -1) for w in scatters), (rank, scatters)
        else:
            assert all(w == -1 for w in scatters), (rank, scatters)
        assert res["phases"] == ["step"]  # recorded as the iteration's closing collectives
    losses, state = reference_run("sgd", 8, 2, None)
    for res in results:
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        assert max_rel_err(res["state"], state) < 1e-5
