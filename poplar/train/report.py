"""Run reports: metrics.json (kept across resumed runs), a per-rank timeline of iterations as a
Chrome/Perfetto trace (JSON, open it in ui.perfetto.dev or chrome://tracing), and a PNG of each
device type's measured points, spline and chosen batch (needs the optional matplotlib extra:
``pip install poplar[plot]``).

The timeline shows, per rank, each micro-step's compute, each collective (whose time
includes waiting for slower ranks), and, on the idle row, the part of each collective spent
waiting for the last rank to arrive: the log's idle (``poplar.train.rank_times``).

``Reports(engine, dir)`` is a training run's writer (``ReportOptions.dir``): ``write(result)``
writes ``metrics.json`` (the ``FitResult`` and every iteration's per-rank times), ``trace.json``
(this run's timeline), ``plan.json``, ``loss.png``, and with a profile ``profile.json`` and
``curves.png`` (the pictures: ``poplar.train.pictures``);
``write_metrics(result)`` rewrites ``metrics.json`` alone at each checkpoint, so that a run
resumed from it has the metrics of every iteration before it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poplar.train import rank_times
from poplar.train.pictures import cluster_name, write_curves_png, write_loss_png
from poplar.types.topology import Link
from poplar.logs import log
from poplar.types.plans import write_text_atomic

if TYPE_CHECKING:
    from poplar.train.records import FitResult


class Reports:
    """Where a training run's reports go; rank 0 writes them."""

    def __init__(self, engine: Any, directory: str | os.PathLike) -> None:
        self.engine, self.dir = engine, directory

    def write_metrics(self, result: "FitResult") -> None:
        """``metrics.json`` alone, from rank 0 (no collective; other ranks do nothing)."""
        if self.engine.rank == 0:
            write_metrics(Path(self.dir) / "metrics.json", result.to_dict())

    def write(self, result: "FitResult") -> None:
        """Every report. Every rank calls it (the timelines are gathered); rank 0 writes the
        files. A failure to write them is a ``DistributedError`` on every rank, which also leave
        together."""
        engine = self.engine
        timelines = engine.comm.all_gather_object(rank_timeline(engine, _device_name(engine)), tag="fit:report")
        error = None
        if engine.rank == 0:
            try:
                _write_report_files(engine, result, Path(self.dir), timelines)
            except Exception as e:  # noqa: BLE001 - reported on every rank
                error = f"{type(e).__name__}: {e}"
        engine.comm.agree(error, f"write the reports to {self.dir}")


def _device_name(engine: Any) -> str:
    dev = getattr(engine, "device", None)
    if dev is not None:
        return getattr(dev, "device_type", None) or getattr(dev, "name", "")
    return engine.rank_plan.device_type or str(engine.comm.device)


def _write_report_files(engine: Any, result: "FitResult", out: Path, timelines: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_metrics(out / "metrics.json", result.to_dict())
    write_trace(out / "trace.json", timelines, result.replans)
    engine.plan.save(out / "plan.json")
    pictures = ["loss.png"]
    profile = engine.profile
    title = f"loss, {profile.model_name} on {cluster_name(profile)}" if profile is not None else ""
    drawn = write_loss_png(out / "loss.png", json.loads((out / "metrics.json").read_text()), title)
    if profile is not None:
        profile.save(out / "profile.json")
        pictures.append("curves.png")
        drawn = write_curves_png(out / "curves.png", profile, engine.plan) and drawn
    if not drawn:
        log.info(f"{' and '.join(pictures)} skipped: they need matplotlib (pip install 'poplar[plot]')")
    log.info(f"reports in {out}/ (trace.json opens in ui.perfetto.dev)")


_RUN_KEYS = ("start_iteration", "end_iteration", "seconds", "samples_per_s", "median_iteration_s",
             "predicted_iteration_s", "checkpoints", "tokens_per_s", "mfu")


def write_metrics(path: str | os.PathLike, metrics: dict[str, Any]) -> None:
    """Write a run's metrics (``FitResult.to_dict()``) to ``path``, keeping the earlier runs'.

    ``iterations`` (and their ``losses``) cover every iteration from ``first_iteration``: those
    before this run's ``start_iteration`` come from the metrics.json already at ``path`` (written
    by the run this one resumed, at its end or at its checkpoints); this run's replace any from
    its start on, and ``evals`` likewise. ``runs`` has each run's summary (start and end iteration, seconds, throughput,
    checkpoints); the other fields are this run's. A run from iteration 0 starts a new file.
    """
    path = Path(path)
    start = metrics["start_iteration"]
    earlier = _earlier_metrics(path) if start > 0 else None
    out = dict(metrics)
    runs = [{k: metrics.get(k) for k in _RUN_KEYS}]
    if earlier is not None:
        before = [r for r in earlier["iterations"] if r["iteration"] < start]
        out["iterations"] = before + metrics["iterations"]
        out["losses"] = [r["loss"] for r in before] + metrics["losses"]
        runs = [r for r in earlier.get("runs") or [] if r["start_iteration"] < start] + runs
        out["evals"] = [e for e in earlier.get("evals") or [] if e["iteration"] <= start] + metrics.get("evals", [])
    out["first_iteration"] = out["iterations"][0]["iteration"] if out["iterations"] else start
    out["runs"] = runs
    write_text_atomic(path, json.dumps(out, indent=1) + "\n")


def _earlier_metrics(path: Path) -> dict[str, Any] | None:
    """The metrics.json at ``path``, if there is one with the fields a merge reads."""
    if not path.is_file():
        return None
    try:
        earlier = json.loads(path.read_text())
        for record in earlier["iterations"]:  # the fields a merge reads
            int(record["iteration"]), float(record["loss"])
        for run in earlier.get("runs") or []:
            int(run["start_iteration"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning(f"{path} cannot be read ({type(e).__name__}: {e}); it is replaced by this run's metrics alone")
        return None
    return earlier


def rank_timeline(engine: Any, device: str = "") -> dict[str, Any]:
    """What one rank contributes to the trace (picklable; gather it to rank 0)."""
    comm = [(r.op, r.phase, r.iteration, r.micro_step, r.start, r.seconds, r.bytes, r.tag, str(r.link))
            for r in engine.comm_ledger.records if r.phase != "setup"]
    return {"rank": engine.rank, "device": device, "compute": list(engine.timeline), "comm": comm}


def chrome_trace(ranks: list[dict[str, Any]], replans: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Trace events for every rank: one process per rank, compute and communication threads;
    each re-planning decision (``poplar.train.replan``) is a global instant event."""
    starts = [c[2] for r in ranks for c in r["compute"]] + [c[4] for r in ranks for c in r["comm"]]
    t0 = min(starts, default=0.0)
    us = lambda s: round((s - t0) * 1e6, 1)  # noqa: E731 - trace timestamps are microseconds
    events: list[dict[str, Any]] = []
    for r in ranks:
        pid = r["rank"]
        label = f"rank {pid}" + (f" ({r['device']})" if r["device"] else "")
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        for tid, name in ((0, "compute"), (1, "communication"), (2, "idle")):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        for it, k, start, dur in r["compute"]:
            events.append({"ph": "X", "name": f"micro-step {k}", "cat": "compute", "pid": pid, "tid": 0,
                           "ts": us(start), "dur": round(dur * 1e6, 1), "args": {"iteration": it}})
        for op, phase, it, k, start, dur, nbytes, tag, _ in r["comm"]:
            events.append({"ph": "X", "name": op, "cat": f"comm:{phase}", "pid": pid, "tid": 1, "ts": us(start),
                           "dur": round(dur * 1e6, 1),
                           "args": {"iteration": it, "micro_step": k, "bytes": nbytes, "tag": tag,
                                    "note": "includes waiting for slower ranks"}})
    events += _idle_spans(ranks, us)
    for e in replans or []:
        events.append({"ph": "i", "s": "g", "name": f"{'re-plan' if e['applied'] else 'drift, plan kept'} "
                       f"({e['kind']})", "cat": "replan", "pid": 0, "tid": 0, "ts": us(e["at"]), "args": e})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _idle_spans(ranks: list[dict[str, Any]], us: Any) -> list[dict[str, Any]]:
    """Each flat collective's wait for the last rank, from the rank's entry, matched across ranks
    by order within an iteration as the log matches them (``rank_times.collective_waits``)."""
    flat: dict[int, list[list[tuple[float, float]]]] = {}  # iteration -> per rank: (start, seconds)
    for i, r in enumerate(ranks):
        for _op, _phase, it, _k, start, dur, _bytes, _tag, link in r["comm"]:
            if link == str(Link.FLAT):
                flat.setdefault(it, [[] for _ in ranks])[i].append((start, dur))
    events = []
    for it, per_rank in flat.items():
        waits = rank_times.collective_waits([[d for _, d in calls] for calls in per_rank])
        for r, rank_waits in enumerate(waits or []):
            for (start, _), wait in zip(per_rank[r], rank_waits):
                if wait > 0:
                    events.append({"ph": "X", "name": "idle", "cat": "idle", "pid": ranks[r]["rank"], "tid": 2,
                                   "ts": us(start), "dur": round(wait * 1e6, 1),
                                   "args": {"iteration": it, "note": "waiting for the last rank to arrive"}})
    return events


def write_trace(path: str | os.PathLike, ranks: list[dict[str, Any]], replans: list[dict[str, Any]] | None = None
                ) -> None:
    write_text_atomic(path, json.dumps(chrome_trace(ranks, replans)))
