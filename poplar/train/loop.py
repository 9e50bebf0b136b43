"""The training loop: ``fit(engine, data, iterations)`` — data by plan, logs of measured vs
predicted time, checkpoints, resume and reports. ``PoplarEngine.fit`` calls it.

Every rank runs it together. Per iteration each rank records its ``IterationStats``; every
``log_every`` iterations the ranks exchange them (one small object all-gather, at the same
iteration on every rank) and rank 0 logs the iteration time against the plan's prediction and,
per rank, its samples, compute seconds (collective time taken out) beside the planned ones, its
blocked communication time (waiting for slower ranks included) and its idle time, the rest of
its step (optimizer step, bookkeeping): compute + comm + idle is the rank's step wall time, all
three measured around the step.

``iterations`` is the total to reach, as DeepSpeed's ``train_iters``: a resumed run goes on
from the checkpoint's iteration, and one that has already reached it does nothing (and says so).
Checkpoints are written every ``checkpoint_every`` iterations and at the end, each into its own
step directory of ``checkpoint_dir`` with ``index.json`` pointing at the latest; the newest
``keep_checkpoints`` are kept (``poplar.checkpoint.kept``). Resume: the engine and the data
position are loaded from the latest complete checkpoint there (or from ``checkpoint_dir`` itself
if it is a single checkpoint) — any plan, stage or world size; rank 0 logs which one.

Reports (``report_dir``, written by rank 0): ``metrics.json`` (the ``FitResult`` and every
iteration's per-rank times; rewritten at each checkpoint too, and a resumed run's keeps the
earlier iterations, so it covers every iteration from 0: see ``report.write_metrics``),
``trace.json`` (a Chrome/Perfetto timeline of compute, communication and idle per rank, of this
run), ``plan.json``, and with a profile ``profile.json`` and ``curves.png`` (needs matplotlib).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from poplar.engine import register_fit_loop
from poplar.train.data import LoaderOptions, PlanLoader
from poplar.train.monitor import FitMonitor
from poplar.train.preemption import Preempted, StopSignals
from poplar.train.replan import ReplanOptions, make_replanner
from poplar.train.report import write_metrics
from poplar.types.logs import log, progress_bar


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
    replans: list[dict[str, Any]] = field(default_factory=list)  # re-planning decisions (poplar.train.replan)
    tokens_per_s: float | None = None  # tokens_per_s, mfu, throughput: poplar.train.throughput
    mfu: float | None = None
    throughput: dict[str, Any] | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)  # poplar.train.evaluation

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
    return PlanLoader.for_engine(data, engine, LoaderOptions(seed=seed, **loader_kwargs))


def _resume(engine: Any, loader: PlanLoader, checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Load the latest checkpoint; returns its ``extra`` (None without a checkpoint)."""
    from poplar.checkpoint import load_checkpoint
    from poplar.checkpoint.kept import agree_on_latest

    latest = agree_on_latest(engine.comm, checkpoint_dir)  # every rank; they must all find the same
    if latest is None:
        return None
    meta = load_checkpoint(engine, latest.path)  # every rank; a rank that cannot read it fails them all
    data_state = (meta.get("extra") or {}).get("data")
    if data_state is not None:
        loader.load_state_dict(data_state)
    else:
        loader.iteration = engine.iteration
    if engine.rank == 0:
        for reason in latest.passed_over:
            log.warning(f"not resuming from a damaged or incomplete checkpoint: {reason}")
        log.info(f"resumed from {checkpoint_dir} at iteration {engine.iteration}: {latest.path} "
                 f"({latest.source.value}; saved by {meta['world_size']} ranks at ZeRO-{meta['zero_stage']})")
    return meta.get("extra") or {}


def _stats_row(engine: Any, loss: float, more: tuple, span: tuple[float, float]) -> tuple:
    """``more``: the monitor's (tokens, peak memory bytes, lr); ``span``: this rank's wall and
    blocked-in-collectives seconds measured around the step, so that compute + comm + idle is
    the step's wall (the ledger's per-iteration total also holds the loop's own collectives
    between steps)."""
    s = engine.last_stats
    return (loss, span[0], s.compute_s, span[1], s.samples, *more)


def _window_records(rows: list[list[tuple]], first: int) -> list[dict[str, Any]]:
    """Per-iteration records from every rank's rows."""
    world = len(rows)
    records = []
    for k in range(min(len(r) for r in rows)):
        compute = [rows[r][k][2] for r in range(world)]
        records.append({"iteration": first + k, "loss": rows[0][k][0], "lr": rows[0][k][7],
                        "wall_s": max(rows[r][k][1] for r in range(world)),
                        # per rank: compute + comm + idle = its wall (idle: neither forward/backward nor in a
                        # collective: the optimizer step, bookkeeping)
                        "ranks": [{"wall_s": rows[r][k][1], "compute_s": compute[r], "comm_s": rows[r][k][3],
                                   "idle_s": max(0.0, rows[r][k][1] - compute[r] - rows[r][k][3]),
                                   "samples": rows[r][k][4], "tokens": rows[r][k][5], "peak_bytes": rows[r][k][6]}
                                  for r in range(world)]})
    return records


def _window_table(engine: Any, records: list[dict[str, Any]]) -> str:
    """The log table of the records' per-rank medians."""
    plan = engine.plan
    head = f"{'rank':>6} {'device':>12} {'samples':>7} {'compute s':>10} {'planned s':>10} {'idle s':>8} {'comm s':>8}"
    lines = [head]
    for r in range(len(records[0]["ranks"])):
        med = lambda key: statistics.median(rec["ranks"][r][key] for rec in records)  # noqa: E731
        planned = plan.ranks[r].predicted_compute_s
        lines.append(f"{r:>6} {str(plan.ranks[r].device_type or '-'):>12} {plan.ranks[r].num_samples:>7} "
                     f"{med('compute_s'):>10.4f} {'-' if planned is None else f'{planned:.4f}':>10} "
                     f"{med('idle_s'):>8.4f} {med('comm_s'):>8.4f}")
    return "\n".join(lines)


def fit(engine: Any, data: Any, iterations: int, *, loss_fn: Any = None, log_every: int = 10, warmup: int = 1,
        checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None, resume: bool = True,
        keep_checkpoints: int = 2, report_dir: str | os.PathLike | None = None, progress: bool = True, seed: int = 0,
        lr_at: Callable[[int], float | None] | None = None, stop_on_signals: bool = False,
        lr_schedule: Any = None, eval_data: Any = None, eval_every: int | None = None, tensorboard: bool | None = None,
        tokens_fn: Callable[[Any], int] | None = None, flops_per_token: float | None = None,
        replan: bool | ReplanOptions | None = None, **loader_kwargs: Any) -> FitResult:
    """Train ``engine`` until its iteration count reaches ``iterations``.

    Args:
        data: a map-style dataset (a ``PlanLoader`` over it is built for the engine's plan) or a
            ``PlanLoader``. ``seed`` and ``loader_kwargs`` (shuffle, drop_last, collate_fn,
            num_workers, ...) go to the loader.
        loss_fn: default the engine's ``loss_fn``.
        log_every: log measured vs predicted times every this many iterations (0: only at the end).
        warmup: leading iterations of this call left out of the medians and the throughput.
        checkpoint_dir / checkpoint_every / resume / keep_checkpoints: see the module doc.
        report_dir: write the reports there (rank 0).
        progress: a progress bar on rank 0 (when stderr is a terminal).
        lr_at: a schedule: ``lr_at(iteration)`` is set as every param group's learning rate
            before that iteration (a function of the iteration alone, so a resume continues it).
        lr_schedule: a ``poplar.train.schedule.LRSchedule`` (warmup + cosine / linear decay), saved
            in checkpoints; instead of ``lr_at``.
        eval_data / eval_every: evaluate on this held-out dataset every ``eval_every`` iterations
            and at the end; exact over ranks (``poplar.train.evaluation``).
        tensorboard / tokens_fn / flops_per_token: event files in ``report_dir/tensorboard`` (None:
            when installed), token counting and model FLOPs per token for tokens/s and MFU
            (``poplar.train.monitor``, ``poplar.train.throughput``).
        stop_on_signals: SIGTERM / SIGINT on any rank stop every rank after the same iteration,
            which is checkpointed (with ``checkpoint_dir``) and reported; then ``Preempted`` is
            raised on every rank (``poplar.train.preemption``). Costs one tiny all-reduce per
            iteration. ``poplar train`` turns it on.
        replan: re-plan when a rank's speed or memory drifts (``poplar.train.replan``): None = on
            when the engine has a profile, True / False, or ``ReplanOptions`` (threshold, patience
            K, margin, ...). Adds no collective: the per-rank stats ride the step's status reduction.
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be an int >= 0, got {iterations!r}")
    if checkpoint_every is not None and (checkpoint_every < 1 or checkpoint_dir is None):
        raise ValueError("checkpoint_every needs checkpoint_dir and must be >= 1")
    if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints must be an int >= 1 (how many checkpoints to keep), got "
                         f"{keep_checkpoints!r}")
    if lr_at is not None and lr_schedule is not None:
        raise ValueError("give lr_schedule or lr_at, not both")
    loader = _make_loader(engine, data, seed, loader_kwargs)
    replanner = make_replanner(engine, replan)
    monitor = FitMonitor(engine, lr_schedule=lr_schedule or lr_at, eval_data=eval_data, eval_every=eval_every,
                         collate_fn=loader_kwargs.get("collate_fn"), tokens_fn=tokens_fn, loss_fn=loss_fn,
                         flops_per_token=flops_per_token, report_dir=report_dir, tensorboard=tensorboard)
    if checkpoint_dir is not None and resume:
        monitor.load_state(_resume(engine, loader, checkpoint_dir))
    start = engine.iteration
    rank0 = engine.rank == 0
    if start >= iterations:
        monitor.close()
        return _nothing_to_do(engine, iterations, report_dir)
    bar = progress_bar(iterations - start, "training", progress and rank0)
    rows: list[tuple] = []
    records: list[dict[str, Any]] = []
    checkpoints: list[str] = []
    losses: list[float] = []
    t_loop = time.perf_counter()
    t_measured: float | None = None if warmup > 0 else t_loop
    gathered, logged = start, 0  # the next iteration to gather, and how many records were logged
    stop, signum = (StopSignals().install() if stop_on_signals else None), None

    try:
        while engine.iteration < iterations:
            if engine.iteration - start == warmup:
                t_measured = time.perf_counter()
            monitor.before_step(engine.iteration)
            batch = next(loader)
            t_step, c_step = time.perf_counter(), engine.comm_ledger.total_seconds
            loss, batch = (engine.train_step(batch, loss_fn), batch) if replanner is None else \
                replanner.step(loader, batch, loss_fn)
            span = (time.perf_counter() - t_step, engine.comm_ledger.total_seconds - c_step)
            losses.append(loss)
            rows.append(_stats_row(engine, loss, (*monitor.row(batch), monitor.lr(engine.iteration - 1)), span))
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            done = engine.iteration == iterations
            monitor.after_step(done, bar)
            if stop is not None and not done:
                signum = stop.agreed(engine.comm)  # every rank: the same answer
            log_now = done or bool(log_every and (engine.iteration - start) % log_every == 0)
            save_now = checkpoint_dir is not None and (
                done or signum is not None or bool(checkpoint_every and engine.iteration % checkpoint_every == 0))
            # the metrics written at a save, or at a stop, cover it
            if log_now or ((save_now or signum is not None) and report_dir is not None):
                records += _gather(engine, rows, gathered)
                gathered, rows = engine.iteration, []
            if log_now and records[logged:]:
                _log_window(engine, records[logged:], rank0, iterations, bar, monitor.window(records[logged:]))
                logged = len(records)
            if save_now:
                checkpoints.append(_save(engine, loader, checkpoint_dir, keep_checkpoints, monitor.state()))
                if report_dir is not None and rank0:  # a run resumed from this checkpoint has the metrics up to it
                    partial = _result(engine, start, losses, records, time.perf_counter() - t_loop, t_measured,
                                      warmup, checkpoints)
                    monitor.complete(partial, warmup)
                    write_metrics(Path(report_dir) / "metrics.json", partial.to_dict())
            if signum is not None:
                break
    finally:
        bar.close()
        if stop is not None:
            stop.uninstall()
        monitor.close()
    seconds = time.perf_counter() - t_loop
    result = _result(engine, start, losses, records, seconds, t_measured, warmup, checkpoints)
    result.replans = replanner.records() if replanner is not None else []
    monitor.complete(result, warmup)
    if signum is not None:  # every rank: write the reports, then stop
        from poplar.checkpoint.kept import step_name

        if report_dir is not None:
            write_reports(engine, result, report_dir)
        raise Preempted(signum, engine.iteration, None if checkpoint_dir is None else str(
            Path(checkpoint_dir) / step_name(engine.iteration)))
    if rank0:
        err = result.prediction_error
        log.info(f"done: iterations {start}..{engine.iteration}, {result.samples_per_s:.1f} samples/s, "
                 f"iteration {result.median_iteration_s:.4f} s" + monitor.summary(result)
                 + (f" (predicted {result.predicted_iteration_s:.4f} s, {err:+.1%})" if err is not None else ""))
    if report_dir is not None:
        write_reports(engine, result, report_dir)
    return result


def _save(engine: Any, loader: PlanLoader, checkpoint_dir: str | os.PathLike, keep: int, more: dict) -> str:
    from poplar.checkpoint.kept import save_kept

    save_kept(engine, checkpoint_dir, keep=keep, extra={"data": loader.state_dict(), **more})
    return f"{checkpoint_dir}@{engine.iteration}"


def _nothing_to_do(engine: Any, iterations: int, report_dir: str | os.PathLike | None) -> FitResult:
    """A run that has already reached ``iterations`` (a finished run started again) trains,
    saves and writes nothing: its reports stay those of the run that did the work."""
    at = engine.iteration
    if engine.rank == 0:
        log.info(f"nothing to do: the engine is at iteration {at} and iterations={iterations} is reached"
                 + (f"; the reports in {report_dir} are left as they are" if report_dir is not None else "")
                 + " (raise iterations to train further)")
    return FitResult(at, at, [], 0.0, 0.0, 0.0, engine.plan.predicted_iteration_s)


def _gather(engine: Any, rows: list[tuple], first: int) -> list[dict[str, Any]]:
    """Every rank's rows since iteration ``first`` as per-iteration records (collective)."""
    everyone = engine.comm.all_gather_object(rows, tag="fit:log")
    return _window_records(everyone, first) if rows else []


def _log_window(engine: Any, records: list[dict[str, Any]], rank0: bool, total: int, bar: Any, rates: str) -> None:
    if not rank0:
        return
    wall = statistics.median(r["wall_s"] for r in records)
    pred = engine.plan.predicted_iteration_s
    vs = f" (predicted {pred:.4f} s, {(wall - pred) / pred:+.1%})" if pred else ""
    message = (f"iteration {engine.iteration}/{total}: loss {records[-1]['loss']:.4f}, "
               f"{engine.global_batch_size / wall:.1f} samples/s, iteration {wall:.4f} s{vs}\n"
               + (f"  {rates}\n" if rates else "") + _window_table(engine, records))
    bar.write("[poplar] " + message, file=sys.stderr)


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
    """Every rank calls it (the timelines are gathered); rank 0 writes the files. A failure to
    write them is a ``DistributedError`` on every rank, which also leave together."""
    from poplar.train.report import rank_timeline

    timelines = engine.comm.all_gather_object(rank_timeline(engine, _device_name(engine)), tag="fit:report")
    error = None
    if engine.rank == 0:
        try:
            _write_report_files(engine, result, Path(report_dir), timelines)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"{type(e).__name__}: {e}"
    engine.comm.agree(error, f"write the reports to {report_dir}")


def _write_report_files(engine: Any, result: FitResult, out: Path, timelines: list[dict[str, Any]]) -> None:
    from poplar.train.report import write_curves_png, write_trace

    out.mkdir(parents=True, exist_ok=True)
    write_metrics(out / "metrics.json", result.to_dict())
    write_trace(out / "trace.json", timelines, result.replans)
    engine.plan.save(out / "plan.json")
    if engine.profile is not None:
        engine.profile.save(out / "profile.json")
        if not write_curves_png(out / "curves.png", engine.profile, engine.plan):
            log.info("curves.png skipped: it needs matplotlib (pip install 'poplar[plot]')")
    log.info(f"reports in {out}/ (trace.json opens in ui.perfetto.dev)")


register_fit_loop(fit)
