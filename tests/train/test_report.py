"""The Perfetto/Chrome timeline: compute, communication and idle spans per rank."""

from __future__ import annotations

import json

import pytest

from poplar.engine import PoplarEngine
from poplar.comm.launch import spawn
from poplar.train.report import chrome_trace, rank_timeline, write_trace
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, plan_of, rank_slice

PLAN = plan_of((4, 3, 0), (1, 1, 0))  # rank 1 finishes early and waits


def timeline_worker(rank: int, world: int) -> dict:
    model = make_model()
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=1, plan=PLAN)
    for it in range(2):
        engine.train_step(rank_slice(global_batch(it, PLAN.global_batch_size), PLAN, rank), loss_fn)
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
