"""The training loop's doors: the policies check their fields before any rank starts a
collective, ``poplar.fit``'s shortcuts replace the config's fields once, the per-rank rows are
typed and picklable, and a ``Trainer`` asked for a larger target goes on exactly where a single
run would be."""

from __future__ import annotations

import pickle

import pytest
import torch

import poplar
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.train import (CheckpointOptions, EvalOptions, FitConfig, LoaderOptions, ReportOptions, ThroughputOptions,
                          Trainer)
from poplar.train.records import StepRow, iteration_records
from poplar.train.replan import ReplanOptions
from poplar.train.trainer import _with_shortcuts
from tests.toy import global_batch, loss_fn, make_model, plan_of

PLAN = plan_of((3, 1, 1), (2, 1, 0))  # 4 + 2 samples


def test_policies_name_the_bad_field_and_the_fix() -> None:
    with pytest.raises(ValueError, match="keep_checkpoints must be an int >= 1"):
        CheckpointOptions("ckpt", keep_checkpoints=0)
    with pytest.raises(ValueError, match="checkpoint every must be an int >= 1"):
        CheckpointOptions("ckpt", every=0)
    with pytest.raises(TypeError, match="CheckpointOptions needs dir"):
        CheckpointOptions(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="EvalOptions needs data"):
        EvalOptions(None)
    with pytest.raises(ValueError, match="eval every must be an int >= 1"):
        EvalOptions([1, 2], every=0)
    with pytest.raises(ValueError, match="tensorboard=True needs a report dir"):
        ReportOptions(tensorboard=True)
    with pytest.raises(ValueError, match="log_every must be an int >= 0"):
        ReportOptions(log_every=-1)
    with pytest.raises(ValueError, match="flops_per_token must be a number > 0"):
        ThroughputOptions(flops_per_token=0)
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        LoaderOptions(num_workers=-1)
    with pytest.raises(ValueError, match="warmup must be an int >= 0"):
        FitConfig(warmup=-1)
    with pytest.raises(TypeError, match="report must be a ReportOptions, got 3"):
        FitConfig(report=3)  # type: ignore[arg-type]


def test_fit_config_takes_policies_and_names_the_short_forms_fix() -> None:
    """Each FitConfig field has one type; the short forms are fit's, converted there once."""
    config = FitConfig(checkpoint=CheckpointOptions("runs/x/ckpt"), report=ReportOptions("runs/x"))
    assert config.checkpoint == CheckpointOptions("runs/x/ckpt") and config.report == ReportOptions("runs/x")
    assert FitConfig().checkpoint is None and FitConfig().report == ReportOptions() and FitConfig().replan is None
    with pytest.raises(TypeError, match=r"write checkpoint=CheckpointOptions\('runs/x/ckpt'\)"):
        FitConfig(checkpoint="runs/x/ckpt")
    with pytest.raises(TypeError, match=r"write report=ReportOptions\('runs/x'\)"):
        FitConfig(report="runs/x")
    with pytest.raises(TypeError, match=r"write replan=ReplanOptions\(enabled=False\)"):
        FitConfig(replan=False)
    assert _with_shortcuts(None, {"checkpoint": CheckpointOptions("c"), "replan": None}).checkpoint == \
        CheckpointOptions("c")


def test_a_field_given_twice_is_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match="replan is given twice"):
        poplar.fit(object(), [], 1, replan=False, config=FitConfig(replan=ReplanOptions()))
    with pytest.raises(ValueError, match="report is given twice"):
        poplar.fit(object(), [], 1, report="a", config=FitConfig(report=ReportOptions("b")))
    with pytest.raises(ValueError, match="iterations must be an int >= 0"):
        poplar.fit(object(), [], -1)


def test_rows_are_typed_picklable_and_make_the_records() -> None:
    # rank 0 blocked 0.125 + 0.125 s in two collectives, rank 1 0.5 + 0.125 s (+ 0.125 s in a
    # node-local one, counted as comm): rank 0 arrived last at the first, so it waited 0 there
    # and rank 1 waited 0.375 s; at the second neither waited
    rows = [[StepRow(loss=2.0, wall_s=1.0, compute_s=0.5, comm_s=0.25, samples=4, tokens=24, peak_bytes=9, lr=0.1,
                     flat_blocked=(0.125, 0.125))],
            [StepRow(loss=2.0, wall_s=1.5, compute_s=1.0, comm_s=0.75, samples=2, tokens=12, peak_bytes=7, lr=0.1,
                     flat_blocked=(0.5, 0.125))]]
    assert pickle.loads(pickle.dumps(rows)) == rows
    [record] = iteration_records(rows, 5)
    assert (record["iteration"], record["loss"], record["lr"], record["wall_s"]) == (5, 2.0, 0.1, 1.5)
    assert [r["idle_s"] for r in record["ranks"]] == [0.0, 0.375]
    assert [r["comm_s"] for r in record["ranks"]] == [0.25, 0.375]
    assert [r["other_s"] for r in record["ranks"]] == [0.25, 0.0]  # never negative
    # ranks that issued different numbers of flat collectives are not matched: all blocked time is comm
    [record] = iteration_records([rows[0], [rows[1][0]._replace(flat_blocked=(0.5,))]], 5)
    assert [r["idle_s"] for r in record["ranks"]] == [0.0, 0.0]
    assert [r["samples"] for r in record["ranks"]] == [4, 2]


def _engine() -> PoplarEngine:
    model = make_model(2)
    return PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), zero_stage=1, plan=PLAN,
                        loss_fn=loss_fn)


def trainer_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    samples = list(global_batch(0, 48))
    data, held_out = samples[:36], samples[36:]
    config = FitConfig(evaluation=EvalOptions(held_out, every=2), report=ReportOptions(log_every=0, progress=False))
    with Trainer(_engine(), data, config) as trainer:
        first, second = trainer.fit(2), trainer.fit(4)
    whole = poplar.fit(_engine(), data, 4, config=config)
    return {"first": (first.start_iteration, first.end_iteration, [e["iteration"] for e in first.evals]),
            "second": (second.start_iteration, second.end_iteration, [e["iteration"] for e in second.evals]),
            "losses": first.losses + second.losses, "whole": whole.losses}


@pytest.mark.multiprocess
def test_a_trainer_goes_on_to_a_larger_target_as_one_run_would() -> None:
    for r in spawn(trainer_worker, 2, timeout_s=120):
        assert r["first"] == (0, 2, [2]) and r["second"] == (2, 4, [4])
        assert r["losses"] == r["whole"]
