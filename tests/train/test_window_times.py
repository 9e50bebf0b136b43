"""Per-rank times of the training loop add up: compute + comm + idle + other is each rank's wall
time of every iteration, even with the loop's own collectives (log gathers) between steps; and
a rank that waits for a slower one counts the wait as idle, not as comm
(``poplar.train.rank_times``)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.train import ReportOptions, fit
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks
from tests.toy import plan_of

PLAN = plan_of((3, 2, 1), (2, 1, 0))
SLOW_S = 0.3  # what rank 1 adds to each of its micro-steps in the slow-rank test


def slow_on_rank_1(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """The model's loss; rank 1 also sleeps, so that rank 0 waits for it in the collectives."""
    if dist.get_rank() == 1:
        time.sleep(SLOW_S)
    return llama_loss_fn(logits, batch)


def fit_rank(rank: int, world: int, stage: int, slow: bool) -> list[dict]:
    torch.set_num_threads(1)
    model = create_model("llama-tiny", seed=3, max_seq_len=16)
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), zero_stage=stage,
                          plan=PLAN, loss_fn=slow_on_rank_1 if slow else llama_loss_fn)
    return fit(engine, TextBlocks(seq_len=16), 4, report=ReportOptions(log_every=1, progress=False),
               replan=False).iterations


def _add_up(records: list[dict]) -> None:
    for rec in records:
        for r in rec["ranks"]:
            assert min(r["comm_s"], r["idle_s"], r["other_s"]) >= 0
            parts = r["compute_s"] + r["comm_s"] + r["idle_s"] + r["other_s"]
            assert parts == pytest.approx(r["wall_s"], rel=1e-9, abs=1e-9)
        assert rec["wall_s"] == max(r["wall_s"] for r in rec["ranks"])


@pytest.mark.parametrize("stage", [3])
@pytest.mark.multiprocess
def test_compute_comm_idle_and_other_add_up_to_each_ranks_wall(stage: int) -> None:
    records = spawn(fit_rank, 2, (stage, False), timeout_s=120)[0]
    assert len(records) == 4
    _add_up(records)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.multiprocess
@pytest.mark.timing
def test_the_wait_for_a_slower_rank_is_idle_not_comm(stage: int) -> None:
    # rank 1 runs its one micro-step SLOW_S later than it would: rank 0, done with its two, waits
    # for it in the gradient reduction (stage 0) or the per-block gathers (stage 3)
    records = spawn(fit_rank, 2, (stage, True), timeout_s=120)[0]
    _add_up(records)
    for rec in records[1:]:  # the first iteration also waits on each rank's start-up
        fast, slow = rec["ranks"]
        assert fast["idle_s"] > 0.6 * SLOW_S, rec  # the wait is idle...
        assert fast["comm_s"] < 0.5 * fast["idle_s"], rec  # ...not the collectives' own time
        assert slow["idle_s"] < 0.5 * fast["idle_s"], rec  # the slow rank waits for nobody
        assert slow["compute_s"] > SLOW_S
