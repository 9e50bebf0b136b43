"""ZeRO-0's all-reduce overlaps the last backward (poplar.zero.replicated, Note: ZeRO-0's
all-reduce overlaps the last backward): in train_step each unit is all-reduced as soon as the
rank's last backward has filled it, every rank sends each unit once per iteration in the same
order (a rank with no samples, after its micro-steps), the ledger counts them as the iteration's
closing collectives, and the non-finite check still reads each rank's own gradients."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.zero.config import ZeroConfig
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, rank_slice, reference_run
from tests.zero.test_nonfinite import Warnings
from tests.zero.test_stage1_overlap import PLAN, Listener, WhereIssued


def overlap_worker(rank: int, world: int) -> dict:
    model = make_model()
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=ZeroConfig(0, bucket_size_mb=0.001),
                          plan=PLAN)
    where = WhereIssued()
    engine.add_observer(where)
    losses = []
    with engine.comm.observed(Listener(where)):
        for it in range(2):
            where.issued.clear()
            losses.append(engine.train_step(rank_slice(global_batch(it, 8), PLAN, rank), loss_fn))
    records = [r for r in engine.comm_ledger.records if r.iteration == 1 and r.tag.startswith("unit")]
    return {"issued": where.issued, "units": len(engine.stage.units), "losses": losses,
            "phases": sorted({r.phase for r in records}), "ops": sorted({r.op for r in records}),
            "state": engine.full_state_dict()}


@pytest.mark.multiprocess
def test_zero0_all_reduces_each_unit_once_as_the_last_backward_fills_it() -> None:
    results = spawn(overlap_worker, 3, timeout_s=120)
    units = results[0]["units"]
    assert units >= 3  # small buckets: several units, so the overlap has something to overlap
    last = {0: 2, 1: -1, 2: 0}  # each rank's last micro-step (rank 1 has none)
    for rank, res in enumerate(results):
        sums = [where for op, where in res["issued"] if op == "all_reduce"]
        assert len(sums) == units + 1, (rank, res["issued"])  # and the status reduction, after backward
        assert sums[-1] == -1
        if last[rank] >= 0:  # most go out inside the last backward; none in an earlier one
            assert sum(w == last[rank] for w in sums) >= units - 1, (rank, sums)
            assert all(w in (last[rank], -1) for w in sums), (rank, sums)
        else:
            assert all(w == -1 for w in sums), (rank, sums)
        assert res["ops"] == ["all_reduce"] and res["phases"] == ["step"]  # the iteration's closing collectives
    losses, state = reference_run("sgd", 8, 2, None)
    for res in results:
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        assert max_rel_err(res["state"], state) < 1e-5


def nan_worker(rank: int, world: int) -> tuple[list[str], int]:
    """Rank 2's gradients are NaN in the first iteration, its loss finite; the skip line (rank 0's
    log) counts the ranks whose own gradients were not finite, though the sum carried the NaN to
    every rank before the check."""
    model = make_model()
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=ZeroConfig(0, bucket_size_mb=0.001),
                          plan=PLAN)

    def poisoned(module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = module(tokens[:, :-1])
        if rank == 2 and engine.iteration == 0:
            logits.register_hook(lambda g: torch.full_like(g, float("nan")))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    handler = Warnings()
    logging.getLogger("poplar").addHandler(handler)
    for it in range(2):
        engine.train_step(rank_slice(global_batch(it, 8), PLAN, rank), poisoned)
    return handler.messages, engine.skipped_steps


@pytest.mark.multiprocess
def test_the_check_reads_each_ranks_own_gradients() -> None:
    results = spawn(nan_worker, 3, timeout_s=120)
    assert [skipped for _, skipped in results] == [1, 1, 1]
    messages = results[0][0]
    assert len(messages) == 1 and "non-finite gradients on 1 of 3 ranks" in messages[0], messages
