"""What the comm ledger records: where each stage communicates."""

from __future__ import annotations

from collections import Counter

import pytest

from poplar.engine import PoplarEngine
from poplar.process.launch import spawn
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, plan_of, rank_slice
from poplar.zero.config import ZeroConfig

# micro-step counts 4, 0, 2: rank 1 has no samples, rank 2 fewer micro-steps
PLAN = plan_of((3, 3, 1), (0, 0, 0), (2, 2, 0))


def ledger_worker(rank: int, world: int, stage: int) -> tuple[list, int, list]:
    model = make_model()
    engine = PoplarEngine(model, make_optimizer(model, "adamw"), zero_stage=ZeroConfig(stage, bucket_size_mb=0.002), plan=PLAN, max_grad_norm=1.0)
    for it in range(2):
        engine.train_step(rank_slice(global_batch(it, PLAN.global_batch_size), PLAN, rank), loss_fn)
    records = [(r.op, r.phase, r.iteration, r.micro_step, r.tag, r.bytes) for r in engine.comm_ledger.records]
    return records, len(engine.stage.units), [engine.comm_ledger.summary(1)]


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.multiprocess
def test_stage_0_1_communicate_only_at_the_boundary(stage: int) -> None:
    for records, units, _ in spawn(ledger_worker, 3, (stage,)):
        assert units > 1
        in_micro = [r for r in records if r[1] in ("forward", "backward") or r[3] >= 0]
        assert in_micro == []
        grads = Counter((r[0], r[2]) for r in records if r[1] == "step" and r[4].startswith("unit"))
        if stage == 0:
            assert grads == {("all_reduce", 0): units, ("all_reduce", 1): units}
        else:
            assert grads == {("reduce_scatter", 0): units, ("all_gather", 0): units,
                             ("reduce_scatter", 1): units, ("all_gather", 1): units}


@pytest.mark.multiprocess
def test_stage_2_reduce_scatters_every_micro_step_on_every_rank() -> None:
    results = spawn(ledger_worker, 3, (2,))
    for records, units, _ in results:
        rs = Counter((r[2], r[3]) for r in records if r[0] == "reduce_scatter")
        # every rank, including the one with no samples, joins all 4 micro-steps with every bucket
        assert rs == {(it, k): units for it in range(2) for k in range(PLAN.max_micro_steps)}
        assert all(r[1] == "backward" for r in records if r[0] == "reduce_scatter")
        gathers = [r for r in records if r[0] == "all_gather" and r[1] == "step"]
        assert len(gathers) == 2 * units
    # the same sequence of collectives on every rank (a mismatch would hang or corrupt)
    seqs = [[(r[0], r[4], r[5]) for r in records] for records, _, _ in results]
    assert seqs[0] == seqs[1] == seqs[2]
