"""The Perfetto/Chrome timeline: compute, communication and idle spans per rank."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from poplar.engine import PoplarEngine
from poplar.process.launch import spawn
from poplar.train.report import chrome_trace, rank_timeline, write_trace
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, plan_of, rank_slice

PLAN = plan_of((4, 3, 0), (1, 1, 0))  # rank 1 finishes early and waits
SLOW_S = 0.05  # what rank 0 adds to each micro-step, so rank 1's wait stands out of the machine's noise


def slow_on_rank_0(rank: int):
    def loss(*args):
        if rank == 0:
            time.sleep(SLOW_S)
        return loss_fn(*args)
    return loss


def timeline_worker(rank: int, world: int) -> dict:
    model = make_model()
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=1, plan=PLAN)
    for it in range(2):
        engine.train_step(rank_slice(global_batch(it, PLAN.global_batch_size), PLAN, rank), slow_on_rank_0(rank))
    return rank_timeline(engine, device=f"dev{rank}")


@pytest.mark.multiprocess
def test_trace_has_every_span(tmp_path) -> None:
    ranks = spawn(timeline_worker, 2)
    trace = chrome_trace(ranks)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in spans if e["cat"] == "compute"]
    assert sorted((e["pid"], e["args"]["iteration"]) for e in compute) == sorted(
        [(0, i) for i in range(2) for _ in range(3)] + [(1, 0), (1, 1)])
    assert {e["name"] for e in spans if e["cat"].startswith("comm")} >= {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    # rank 1 (one micro-step of 1 sample) waits for rank 0 (three of 4) in each iteration's reduction:
    # its idle spans lie inside its collectives and add up to more than rank 0's
    idle = {pid: [e for e in spans if e["cat"] == "idle" and e["pid"] == pid] for pid in (0, 1)}
    assert idle[1] and sum(e["dur"] for e in idle[1]) > sum(e["dur"] for e in idle[0])
    comm = [e for e in spans if e["cat"].startswith("comm") and e["pid"] == 1]
    assert all(any(c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"] + 0.2 for c in comm)
               for e in idle[1])
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        "rank 0 (dev0)", "rank 1 (dev1)"}
    path = tmp_path / "trace.json"
    write_trace(path, ranks)
    assert json.loads(path.read_text())["traceEvents"]


def test_curves_png_marks_the_chosen_batches(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from poplar.emulation.synthetic import synthetic_profile
    from poplar.planner import plan
    from poplar.train.report import write_curves_png

    profile = synthetic_profile("B", 2)
    path = tmp_path / "curves.png"
    assert write_curves_png(path, profile, plan(profile, 64, 2))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_curves_png_says_why_a_type_runs_below_its_best_batch_and_loss_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from poplar.emulation.synthetic import synthetic_profile
    from poplar.planner import plan
    from poplar.planner.curves import SpeedCurve
    from poplar.train.pictures import below_best, cluster_name, write_loss_png

    profile = synthetic_profile("B", 2)
    chosen = plan(profile, 64, 2)
    t4 = next(r for r in profile.ranks if r.device_type == "T4-16G")
    curve = SpeedCurve.from_points("T4-16G", t4.mbs, [(p.batch, p.compute_s) for p in t4.points])
    row = next(r for r in chosen.ranks if r.device_type == "T4-16G")
    assert row.num_samples < curve.peak_batch  # the small global batch leaves the T4 below its best
    why = below_best(curve, row, chosen)
    assert why is not None and f"share of the global batch 64 is {row.num_samples} samples" in why
    fast = next(r for r in chosen.ranks if r.device_type == "V100-16G")
    v100 = next(r for r in profile.ranks if r.device_type == "V100-16G")
    best = SpeedCurve.from_points("V100-16G", v100.mbs, [(p.batch, p.compute_s) for p in v100.points])
    assert (below_best(best, fast, chosen) is None) == (fast.micro_batch_size >= best.peak_batch)
    assert "2 x V100-16G + 2 x T4-16G" in cluster_name(profile)
    # the even plan's picture says why in the even plan's terms, not in the planner's
    even = plan(profile, 32, 2, strategy="even")
    even_row = next(r for r in even.ranks if r.device_type == "V100-16G")
    why = below_best(best, even_row, even)
    assert why is not None and "even plan gives every rank an equal share of the global batch 32, 8 samples" in why
    assert "ends with the others" not in why and "shortest predicted" not in why
    metrics = {"iterations": [{"iteration": i, "loss": 5.0 - i / 10} for i in range(20)],
               "evals": [{"iteration": 10, "loss": 4.5}, {"iteration": 20, "loss": 3.9}]}
    path = tmp_path / "loss.png"
    assert write_loss_png(path, metrics, "loss")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curves_title_names_the_plan_and_says_when_speeds_are_emulated() -> None:
    from poplar.emulation.synthetic import synthetic_profile
    from poplar.planner import plan
    from poplar.train.pictures import curves_title

    profile = synthetic_profile("B", 2)
    assert curves_title(profile, plan(profile, 64, 2, strategy="even")).splitlines()[1:] == [
        "ZeRO-2, fp32, even plan", "computed from presets, not measured"]
    measured = dataclasses.replace(profile, provenance=dataclasses.replace(
        profile.provenance, emulated=dataclasses.replace(profile.provenance.emulated, synthetic=False)))
    assert curves_title(measured, plan(measured, 64, 2)).splitlines()[1:] == [
        "ZeRO-2, fp32, poplar plan", "emulated on a CPU: speeds follow the machine's load"]
    real = dataclasses.replace(profile, provenance=dataclasses.replace(profile.provenance, emulated=None))
    assert curves_title(real).splitlines()[1:] == ["ZeRO-2, fp32"]
