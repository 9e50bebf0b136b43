"""Per-rank times of the training loop add up: compute + communication + idle is each rank's
wall time of every iteration, even with the loop's own collectives (log gathers) between steps."""

from __future__ import annotations

import pytest
import torch

from poplar.comm.launch import spawn
from poplar.engine import PoplarEngine
from poplar.train import ReportOptions, fit
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks
from tests.toy import plan_of

PLAN = plan_of((3, 2, 1), (2, 1, 0))


def fit_rank(rank: int, world: int, stage: int) -> list[dict]:
    torch.set_num_threads(1)
    model = create_model("llama-tiny", seed=3, max_seq_len=16)
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), zero_stage=stage,
                          plan=PLAN, loss_fn=llama_loss_fn)
    return fit(engine, TextBlocks(seq_len=16), 4, report=ReportOptions(log_every=1, progress=False),
               replan=False).iterations


@pytest.mark.parametrize("stage", [3])
@pytest.mark.multiprocess
def test_compute_comm_and_idle_add_up_to_each_ranks_wall(stage: int) -> None:
    records = spawn(fit_rank, 2, (stage,), timeout_s=120)[0]
    assert len(records) == 4
    for rec in records:
        for r in rec["ranks"]:
            assert r["comm_s"] <= r["wall_s"] and r["idle_s"] >= 0
            assert r["compute_s"] + r["comm_s"] + r["idle_s"] == pytest.approx(r["wall_s"], rel=1e-9, abs=1e-9)
        assert rec["wall_s"] == max(r["wall_s"] for r in rec["ranks"])
