"""The training loop: ``fit(engine, data, iterations)`` — data by plan, logs of measured vs
predicted time, checkpoints, resume and reports. ``PoplarEngine.fit`` calls it.

Every rank runs it together. Per iteration each rank records its ``IterationStats``; every
``log_every`` iterations the ranks exchange them (one small object all-gather, at the same
iteration on every rank) and rank 0 logs the iteration time against the plan's prediction and,
per rank, its samples, compute seconds (collective time taken out) beside the planned ones, its
idle time (the slowest rank's compute minus its own) and its blocked communication time.

``iterations`` is the total to reach, as DeepSpeed's ``train_iters``: a resumed run goes on
from the checkpoint's iteration. Resume: when ``checkpoint_dir`` holds a checkpoint (on any
rank), the engine and the data position are loaded from it — any plan, stage or world size.
Checkpoints are written every ``checkpoint_every`` iterations and at the end.

Reports (``report_dir``, written by rank 0): ``metrics.json`` (the ``FitResult`` and every
iteration's per-rank times), ``trace.json`` (a Chrome/Perfetto timeline of compute,
communication and idle per rank), ``plan.json``, and with a profile ``profile.json`` and
``curves.png`` (needs matplotlib).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from poplar.engine import register_fit_loop
from poplar.train.data import PlanLoader
from poplar.types.logs import log, progress_bar
from poplar.types.plans import write_text_atomic


@dataclass
class RankSummary:
    """One rank over the measured iterations (medians)."""

    rank: int
    device: str
    samples: int
    compute_s: float
    predicted_compute_s: float | None
    idle_s: float
    comm_s: float


@dataclass
class FitResult:
    start_iteration: int
    end_iteration: int
    losses: list[float]
    seconds: float  # wall time of the loop
    samples_per_s: float  # global batch x iterations / seconds (warm-up excluded)
    median_iteration_s: float  # the slowest rank's iteration wall time, median
    predicted_iteration_s: float | None
    ranks: list[RankSummary] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    iterations: list[dict[str, Any]] = field(default_factory=list)  # per iteration: loss and per-rank times

    @property
    def prediction_error(self) -> float | None:
        """(measured - predicted) / predicted iteration time."""
        p = self.predicted_iteration_s
        return None if not p else (self.median_iteration_s - p) / p

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prediction_error"] = self.prediction_error
        return d


def _device_name(engine: Any) -> str:
    dev = getattr(engine, "device", None)
    if dev is not None:
        return getattr(dev, "device_type", None) or getattr(dev, "name", "")
    return engine.rank_plan.device_type or str(engine.comm.device)


def _make_loader(engine: Any, data: Any, seed: int, loader_kwargs: dict[str, Any]) -> PlanLoader:
    if isinstance(data, PlanLoader):
        if data.plan is not engine.plan:
            data.set_plan(engine.plan, engine.rank)
        return data
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(f"fit() takes a map-style dataset or a poplar.data.PlanLoader, got {type(data).__name__}")
    return PlanLoader.for_engine(data, engine, seed=seed, **loader_kwargs)


def _resume(engine: Any, loader: PlanLoader, checkpoint_dir: str | os.PathLike) -> bool:
    from poplar.checkpoint import load_checkpoint

    present = (Path(checkpoint_dir) / "index.json").is_file()
    if not any(engine.comm.all_gather_object(present, tag="fit:resume")):
        return False
    meta = load_checkpoint(engine, checkpoint_dir)  # every rank; a rank that cannot see it fails them all
    data_state = (meta.get("extra") or {}).get("data")
    if data_state is not None:
        loader.load_state_dict(data_state)
    else:
        loader.iteration = engine.iteration
    if engine.rank == 0:
        log.info(f"resumed from {checkpoint_dir} at iteration {engine.iteration} (saved by {meta['world_size']} "
                 f"ranks at ZeRO-{meta['zero_stage']})")
    return True


def _stats_row(engine: Any, loss: float) -> tuple[float, float, float, float, int]:
    s = engine.last_stats
    return (loss, s.wall_s, s.compute_s, s.comm_s, s.samples)


def _window_table(engine: Any, rows: list[list[tuple]], first: int) -> tuple[list[dict[str, Any]], str]:
    """Per-iteration records from every rank's rows, and the log table of their medians."""
    world = len(rows)
    n = min(len(r) for r in rows)
    records = []
    for k in range(n):
        compute = [rows[r][k][2] for r in range(world)]
        slowest = max(compute)
        records.append({"iteration": first + k, "loss": rows[0][k][0],
                        "wall_s": max(rows[r][k][1] for r in range(world)),
                        "ranks": [{"compute_s": compute[r], "comm_s": rows[r][k][3], "idle_s": slowest - compute[r],
                                   "samples": rows[r][k][4]} for r in range(world)]})
    plan = engine.plan
    head = f"{'rank':>6} {'device':>12} {'samples':>7} {'compute s':>10} {'planned s':>10} {'idle s':>8} {'comm s':>8}"
    lines = [head]
    for r in range(world):
        med = lambda key: statistics.median(rec["ranks"][r][key] for rec in records)  # noqa: E731
        planned = plan.ranks[r].predicted_compute_s
        lines.append(f"{r:>6} {str(plan.ranks[r].device_type or '-'):>12} {plan.ranks[r].num_samples:>7} "
                     f"{med('compute_s'):>10.4f} {'-' if planned is None else f'{planned:.4f}':>10} "
                     f"{med('idle_s'):>8.4f} {med('comm_s'):>8.4f}")
    return records, "\n".join(lines)


def fit(engine: Any, data: Any, iterations: int, *, loss_fn: Any = None, log_every: int = 10, warmup: int = 1,
        checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None, resume: bool = True,
        report_dir: str | os.PathLike | None = None, progress: bool = True, seed: int = 0,
        lr_at: Callable[[int], float | None] | None = None, **loader_kwargs: Any) -> FitResult:
    """Train ``engine`` until its iteration count reaches ``iterations``.

    Args:
        data: a map-style dataset (a ``PlanLoader`` over it is built for the engine's plan) or a
            ``PlanLoader``. ``seed`` and ``loader_kwargs`` (shuffle, drop_last, collate_fn,
            num_workers, ...) go to the loader.
        loss_fn: default the engine's ``loss_fn``.
        log_every: log measured vs predicted times every this many iterations (0: only at the end).
        warmup: leading iterations of this call left out of the medians and the throughput.
        checkpoint_dir / checkpoint_every / resume: see the module doc.
        report_dir: write the reports there (rank 0).
        progress: a progress bar on rank 0 (when stderr is a terminal).
        lr_at: a schedule: ``lr_at(iteration)`` is set as every param group's learning rate
            before that iteration (a function of the iteration alone, so a resume continues it).
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be an int >= 0, got {iterations!r}")
    if checkpoint_every is not None and (checkpoint_every < 1 or checkpoint_dir is None):
        raise ValueError("checkpoint_every needs checkpoint_dir and must be >= 1")
    loader = _make_loader(engine, data, seed, loader_kwargs)
    if checkpoint_dir is not None and resume:
        _resume(engine, loader, checkpoint_dir)
    start = engine.iteration
    rank0 = engine.rank == 0
    bar = progress_bar(iterations - start, "training", progress and rank0)
    rows: list[tuple] = []
    records: list[dict[str, Any]] = []
    checkpoints: list[str] = []
    losses: list[float] = []
    t_loop = time.perf_counter()
    t_measured: float | None = None if warmup > 0 else t_loop
    logged = start

    try:
        while engine.iteration < iterations:
            if engine.iteration - start == warmup:
                t_measured = time.perf_counter()
            if lr_at is not None and (lr := lr_at(engine.iteration)) is not None:
                for group in engine.optimizer.param_groups:
                    group["lr"] = lr
            batch = next(loader)
            loss = engine.train_step(batch, loss_fn)
            losses.append(loss)
            rows.append(_stats_row(engine, loss))
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            done = engine.iteration == iterations
            if done or (log_every and (engine.iteration - start) % log_every == 0):
                records += _exchange(engine, rows, logged, rank0, iterations, bar)
                logged, rows = engine.iteration, []
            if checkpoint_dir is not None and (done or (checkpoint_every and engine.iteration % checkpoint_every == 0)):
                from poplar.checkpoint import save_checkpoint

                save_checkpoint(engine, checkpoint_dir, extra={"data": loader.state_dict()})
                checkpoints.append(f"{checkpoint_dir}@{engine.iteration}")
    finally:
        bar.close()
    seconds = time.perf_counter() - t_loop
    result = _result(engine, start, losses, records, seconds, t_measured, warmup, checkpoints)
    if rank0 and start < iterations:
        err = result.prediction_error
        log.info(f"done: iterations {start}..{engine.iteration}, {result.samples_per_s:.1f} samples/s, "
                 f"iteration {result.median_iteration_s:.4f} s"
                 + (f" (predicted {result.predicted_iteration_s:.4f} s, {err:+.1%})" if err is not None else ""))
    if report_dir is not None:
        write_reports(engine, result, report_dir)
    return result


def _exchange(engine: Any, rows: list[tuple], first: int, rank0: bool, total: int, bar: Any) -> list[dict[str, Any]]:
    everyone = engine.comm.all_gather_object(rows, tag="fit:log")
    if not rows:
        return []
    records, table = _window_table(engine, everyone, first)
    if rank0:
        walls = sorted(r["wall_s"] for r in records)
        wall = statistics.median(walls)
        pred = engine.plan.predicted_iteration_s
        vs = f" (predicted {pred:.4f} s, {(wall - pred) / pred:+.1%})" if pred else ""
        message = (f"iteration {engine.iteration}/{total}: loss {records[-1]['loss']:.4f}, "
                   f"{engine.global_batch_size / wall:.1f} samples/s, iteration {wall:.4f} s{vs}\n{table}")
        bar.write("[poplar] " + message, file=sys.stderr)
    return records


def _result(engine: Any, start: int, losses: list[float], records: list[dict[str, Any]], seconds: float,
            t_measured: float | None, warmup: int, checkpoints: list[str]) -> FitResult:
    measured = records[warmup:] or records
    n_measured = len(records) - warmup if len(records) > warmup else len(records)
    elapsed = (time.perf_counter() - t_measured) if (t_measured is not None and len(records) > warmup) else seconds
    walls = [r["wall_s"] for r in measured]
    ranks = []
    for r in range(engine.world_size):
        med = lambda key: statistics.median(rec["ranks"][r][key] for rec in measured) if measured else 0.0  # noqa
        ranks.append(RankSummary(r, str(engine.plan.ranks[r].device_type or ""), engine.plan.ranks[r].num_samples,
                                 med("compute_s"), engine.plan.ranks[r].predicted_compute_s, med("idle_s"),
                                 med("comm_s")))
    return FitResult(start, engine.iteration, losses, seconds,
                     engine.global_batch_size * n_measured / elapsed if elapsed > 0 and n_measured else 0.0,
                     statistics.median(walls) if walls else 0.0, engine.plan.predicted_iteration_s, ranks,
                     checkpoints, records)


def write_reports(engine: Any, result: FitResult, report_dir: str | os.PathLike) -> None:
    """Every rank calls it (the timelines are gathered); rank 0 writes the files."""
    from poplar.train.report import rank_timeline, write_curves_png, write_trace

    timelines = engine.comm.all_gather_object(rank_timeline(engine, _device_name(engine)), tag="fit:report")
    if engine.rank != 0:
        return
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "metrics.json", json.dumps(result.to_dict(), indent=1) + "\n")
    write_trace(out / "trace.json", timelines)
    engine.plan.save(out / "plan.json")
    if engine.profile is not None:
        engine.profile.save(out / "profile.json")
        if not write_curves_png(out / "curves.png", engine.profile, engine.plan):
            log.info("curves.png skipped: it needs matplotlib (pip install 'poplar[plot]')")
    log.info(f"reports in {out}/ (trace.json opens in ui.perfetto.dev)")


register_fit_loop(fit)
