"""The training loop with a rank left out of the step (docs/design.md §3.12): it keeps the loop's
pace, joins the checkpoint saves, and the run ends where the same run ends with that rank in
the step on no samples; every rank's loss, the rank left out's too, and the records' are those
of the ranks in the step, also when the rank left out is rank 0, who writes the log."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.train import CheckpointOptions, FitConfig, LoaderOptions, ReportOptions, fit
from poplar.types.plans import Plan, RankPlan
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks

ROWS = [(0, 0, 0), (3, 2, 1), (2, 1, 0)]  # n_i = 0, 7, 2


def _plan(weights: tuple[float, ...]) -> Plan:
    return Plan([RankPlan(*row, shard_weight=w) for row, w in zip(ROWS, weights)])


def fit_rank(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, weights in [("left_out", (0, 1, 1)), ("in_step", (1, 1, 1))]:
        model = create_model("llama-tiny", seed=3, max_seq_len=16)
        opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
        engine = PoplarEngine(model, opt, zero_stage=2, plan=_plan(weights), loss_fn=llama_loss_fn)
        result = fit(engine, TextBlocks(seq_len=16), 4, checkpoint=CheckpointOptions(f"{tmp}/{name}", every=2),
                     report=ReportOptions(log_every=2, progress=False),
                     config=FitConfig(loader=LoaderOptions(seed=7)))
        out[name] = (result.losses, [r["loss"] for r in result.iterations], engine.full_state_dict(),
                     len(result.checkpoints))
    return out


@pytest.mark.multiprocess
def test_fit_with_rank_0_left_out_equals_the_run_with_it_in_the_step(tmp_path: Path) -> None:
    results = spawn(fit_rank, 3, (str(tmp_path),), timeout_s=240, collective_timeout_s=60)
    _, ref_records, ref_state, _ = results[1]["in_step"]
    for rank, res in enumerate(results):
        losses, records, state, checkpoints = res["left_out"]
        assert checkpoints == 2
        assert records == pytest.approx(ref_records, rel=1e-5) and all(math.isfinite(x) for x in records)
        assert losses == pytest.approx(ref_records, rel=1e-5)  # rank 0 too: it joins the status reduction
        for k, v in ref_state.items():
            assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-7), (rank, k)
