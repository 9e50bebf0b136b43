"""The training loop: a run interrupted and resumed from its checkpoint ends bitwise where an
uninterrupted run ends (data position, optimizer, schedule and RNG included), and the reports
are written."""

from __future__ import annotations

import pytest

import json
from pathlib import Path

import torch

from poplar.engine import PoplarEngine
from poplar.train import CheckpointOptions, FitConfig, LoaderOptions, ReportOptions, fit
from poplar.process.launch import spawn
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks
from tests.toy import plan_of

PLAN = plan_of((3, 2, 1), (2, 1, 0))  # n_i = 7, 2: uneven, different micro-step counts


def schedule(iteration: int) -> float:
    return 1e-3 * (iteration + 1) / 4 if iteration < 4 else 1e-3


def _engine(stage: int) -> PoplarEngine:
    model = create_model("llama-tiny", seed=3, max_seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    return PoplarEngine(model, opt, zero_stage=stage, plan=PLAN, loss_fn=llama_loss_fn, max_grad_norm=1.0)


def fit_rank(rank: int, world: int, tmp: str, stage: int) -> dict:
    data = TextBlocks(seq_len=16)
    common = {"lr_schedule": schedule, "config": FitConfig(loader=LoaderOptions(seed=7))}
    quiet = ReportOptions(log_every=2, progress=False)
    whole = _engine(stage)
    a = fit(whole, data, 6, checkpoint=CheckpointOptions(f"{tmp}/a", every=3),
            report=ReportOptions(f"{tmp}/report", log_every=2, progress=False), **common)
    first = _engine(stage)
    b1 = fit(first, data, 3, checkpoint=f"{tmp}/b", report=quiet, **common)
    second = _engine(stage)  # a fresh engine: everything comes from the checkpoint
    b2 = fit(second, data, 6, checkpoint=f"{tmp}/b", report=quiet, **common)
    return {"a": whole.full_state_dict(), "b": second.full_state_dict(), "a_losses": a.losses,
            "b_losses": b1.losses + b2.losses, "b2_start": b2.start_iteration, "a_records": len(a.iterations),
            "a_ranks": [r.samples for r in a.ranks], "a_checkpoints": a.checkpoints,
            "lr": [g["lr"] for g in second.optimizer.param_groups]}


@pytest.mark.multiprocess
def test_resumed_fit_equals_uninterrupted_bitwise(tmp_path: Path) -> None:
    results = spawn(fit_rank, 2, (str(tmp_path), 2), timeout_s=180, collective_timeout_s=60)
    for r in results:
        assert r["b2_start"] == 3
        assert r["a_losses"] == r["b_losses"]
        for k, v in r["a"].items():
            assert torch.equal(v, r["b"][k]), k
        assert r["lr"] == [schedule(5)]
        assert r["a_records"] == 6 and r["a_ranks"] == [7, 2]
        assert r["a_checkpoints"] == [f"{tmp_path}/a@3", f"{tmp_path}/a@6"]
    assert results[0]["a_losses"] == results[1]["a_losses"]
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["end_iteration"] == 6 and len(metrics["iterations"]) == 6
    assert all(len(it["ranks"]) == 2 and it["ranks"][0]["samples"] == 7 for it in metrics["iterations"])
    trace = json.loads((tmp_path / "report" / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"micro-step 0", "micro-step 2", "reduce_scatter"} <= names
    assert json.loads((tmp_path / "report" / "plan.json").read_text())["global_batch_size"] == 9


def grad_norm_rank(rank: int, world: int, tmp: str) -> None:
    model = create_model("llama-tiny", seed=3, max_seq_len=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = PoplarEngine(model, opt, zero_stage=2, plan=PLAN, loss_fn=llama_loss_fn)  # no clipping
    fit(engine, TextBlocks(seq_len=16), 4, report=ReportOptions(tmp, log_every=2, progress=False),
        config=FitConfig(loader=LoaderOptions(seed=7)))


@pytest.mark.multiprocess
def test_metrics_hold_the_global_grad_norm_of_one_process(tmp_path: Path) -> None:
    """The gradient norm recorded per iteration, measured with clipping off, is the total norm
    one process gets on the whole global batch (2 uneven ranks, ZeRO-2: sharded gradients)."""
    from torch.utils.data import default_collate

    from poplar.train.data import GlobalBatchSampler

    spawn(grad_norm_rank, 2, (str(tmp_path),), timeout_s=120, collective_timeout_s=60)
    records = json.loads((tmp_path / "metrics.json").read_text())["iterations"]
    data = TextBlocks(seq_len=16)
    model = create_model("llama-tiny", seed=3, max_seq_len=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = GlobalBatchSampler(len(data), PLAN.global_batch_size, seed=7)
    norms = []
    for k in range(4):
        opt.zero_grad()
        llama_loss_fn(model, default_collate([data[i] for i in sampler.indices(k)])).backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        opt.step()
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-5, abs=1e-5)
    assert len(set(round(n, 3) for n in norms)) == 4  # four different steps, not one value repeated
