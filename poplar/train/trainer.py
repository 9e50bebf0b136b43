"""The training loop as an object: ``Trainer(engine, data, config).fit(iterations)``, and its
functional door ``poplar.fit(engine, data, iterations, ...)``.

Why this shape. A ``Trainer`` declares its components up front, typed, as torchtitan's does: the
plan-aware loader, the monitor (schedule, evaluation, throughput, TensorBoard), the re-planner,
the checkpointer and the reports, all built from one ``FitConfig`` (``poplar.train.options``).
Building them is collective (the monitor gathers every rank's device; resuming agrees on the
latest checkpoint and loads it), so the constructor does it once, on every rank, before any
iteration, and ``fit`` is the loop alone. ``iterations`` is not part of the config but the
argument of ``fit``: it is the total to reach, as DeepSpeed's ``train_iters`` (a resumed run
goes on from the checkpoint's iteration; one that has already reached it does nothing and says
so), and the same trainer may be asked to go on to a larger one. Each ``fit`` call returns the
``FitResult`` of its own iterations. ``close()`` (or a ``with`` block) closes the TensorBoard
writer. ``poplar.fit`` builds a trainer, runs it once and closes it; its keywords are shortcuts
for the config's most used fields.

Every rank runs the loop together. Per iteration each rank records a ``StepRow``
(``poplar.train.records``); every ``log_every`` iterations the rows are gathered and rank 0 logs
the iteration time against the plan's prediction and each rank's compute, comm, idle and other
time (``poplar.train.rank_times``). Checkpoints (``poplar.train.checkpointing``) are written every ``every`` iterations
and at the end; ``save_pretrained(dir, tokenizer)`` writes a Hugging Face folder on request
(``poplar.train.hf_output``). Reports (``poplar.train.report``): ``metrics.json`` (rewritten at each
checkpoint too; a resumed run's keeps the earlier iterations, so it covers every iteration from
0), ``trace.json`` (this run's timeline), ``plan.json``, and with a profile ``profile.json`` and
``curves.png``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from poplar.train.checkpointing import Checkpointer
from poplar.train.data import LoaderOptions, PlanLoader
from poplar.train.hf_output import save_hf_folder
from poplar.train.monitor import FitMonitor
from poplar.train.options import CheckpointOptions, EvalOptions, FitConfig, ReportOptions
from poplar.train import rank_times
from poplar.train.preemption import Preempted, StopSignals
from poplar.train.records import FitResult, RunClock, StepRow, iteration_records, summarize, window_message
from poplar.train.replan import Replanner, ReplanOptions, make_replanner
from poplar.train.report import Reports
from poplar.logs import log, progress_bar

if TYPE_CHECKING:
    import os

    from poplar.engine import PoplarEngine
    from poplar.profiler.devices import Device
    from poplar.train.config import TrainConfig


class Trainer:
    """Trains ``engine`` on ``data`` (a map-style dataset, cut per the plan by a ``PlanLoader``
    built with ``config.loader``, or a ``PlanLoader``) under ``config``. Every rank builds it
    together; see the module doc."""

    engine: PoplarEngine
    config: FitConfig
    loader: PlanLoader
    monitor: FitMonitor
    replanner: Replanner | None  # None: re-planning off
    checkpointer: Checkpointer | None  # None: no checkpoints
    reports: Reports | None  # None: no report files

    def __init__(self, engine: PoplarEngine, data: Any, config: FitConfig | None = None) -> None:
        config = FitConfig() if config is None else config
        if not isinstance(config, FitConfig):
            raise TypeError(f"config must be a poplar.train.FitConfig, got {type(config).__name__}")
        report = config.report
        self.engine, self.config = engine, config
        self._owns_engine = False  # from_config built it: close() closes it too
        self.loader = _loader_for(engine, data, config.loader)
        self.replanner = make_replanner(engine, config.replan)
        self.monitor = FitMonitor(engine, lr_schedule=config.lr_schedule, loss_fn=config.loss_fn,
                                  evaluation=config.evaluation, report=report, throughput=config.throughput,
                                  collate_fn=config.loader.collate_fn)
        self.checkpointer = Checkpointer(engine, config.checkpoint) if config.checkpoint is not None else None
        self.reports = Reports(engine, report.dir) if report.dir is not None else None
        if self.checkpointer is not None and self.checkpointer.options.resume:
            try:
                self.monitor.load_state(self.checkpointer.resume(self.loader))
            except BaseException:
                self.close()  # let go of the checkpoint directory: no fit follows
                raise

    @classmethod
    def from_config(cls, cfg: TrainConfig, auto_device: Device | None = None) -> Trainer:
        """The run ``cfg`` (a ``poplar train`` config) describes, built on every rank together
        (``poplar.train.from_config``): its model, data, engine and loop. ``auto_device``: the
        device auto mode profiles on where it is not this rank's GPU (an emulated cluster's).
        ``trainer.fit(cfg.iterations)`` trains it; ``close()`` also closes the engine."""
        import torch

        from poplar.train.deepspeed_hints import hint_line, mapped_line
        from poplar.train.from_config import build_engine, fit_config, world_and_rank
        from poplar.train.run_parts import build_parts

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(cfg.seed)
        parts = build_parts(cfg, device)
        if world_and_rank()[1] == 0:
            log.info(f"data: {parts.about_data}")
            if cfg.deepspeed_hints:
                log.info(hint_line(cfg.deepspeed_hints))
            if cfg.deepspeed_mapped:
                log.info(mapped_line(cfg.deepspeed_mapped))
        engine = build_engine(cfg, parts, auto_device)
        try:
            trainer = cls(engine, parts.train_data, fit_config(cfg, parts))
        except BaseException:
            engine.close()
            raise
        trainer._owns_engine = True
        return trainer

    # ------------------------------------------------------------------ the loop
    def fit(self, iterations: int) -> FitResult:
        """Train until the engine's iteration count reaches ``iterations``; returns the
        ``FitResult`` of this call's iterations. Raises ``Preempted`` on every rank after a stop
        signal (``FitConfig.stop_on_signals``), once the checkpoint and the reports are written."""
        _check_iterations(iterations)
        engine = self.engine
        if engine.iteration >= iterations:
            return self._nothing_to_do(iterations)
        if self.loader.plan is not engine.plan:  # a plan set on the engine since the last call
            self.loader.set_plan(engine.plan, engine.rank)
        report = self.config.report
        run = _Run(engine.iteration, iterations, RunClock(self.config.warmup),
                   progress_bar(iterations - engine.iteration, "training", report.progress and engine.rank == 0),
                   len(self.replanner.events) if self.replanner is not None else 0)
        stop = StopSignals().install() if self.config.stop_on_signals else None
        try:
            while engine.iteration < iterations:
                self._step(run)
                done = engine.iteration == iterations
                self.monitor.after_step(done, run.bar)
                if stop is not None and not done:
                    run.signum = stop.agreed(engine.comm)  # every rank: the same answer
                self._after_step(run, done)
                if run.signum is not None:
                    break
        finally:
            run.bar.close()
            if stop is not None:
                stop.uninstall()
        return self._finish(run)

    def _step(self, run: _Run) -> None:
        """One iteration, and this rank's row of it."""
        engine, monitor = self.engine, self.monitor
        run.clock.begin_iteration(engine.iteration - run.start)
        monitor.before_step(engine.iteration)
        batch = next(self.loader)
        ledger = engine.comm_ledger
        last_before = ledger.records[-1] if ledger.records else None
        t_step, c_step = time.perf_counter(), ledger.total_seconds
        if self.replanner is None:
            loss = engine.train_step(batch, self.config.loss_fn)
        else:
            loss, batch = self.replanner.step(self.loader, batch, self.config.loss_fn)
        # wall and blocked-in-collectives seconds measured around the step, so that compute + comm +
        # idle + other is the step's wall (the ledger's per-iteration total also holds the loop's own
        # collectives between steps); the step's flat collectives split the blocked time into comm
        # and idle once every rank's are gathered (``poplar.train.rank_times``)
        wall_s, comm_s = time.perf_counter() - t_step, ledger.total_seconds - c_step
        flat_blocked = rank_times.flat_blocked_seconds(rank_times.step_records(ledger.records, last_before))
        tokens, peak_bytes = monitor.row(batch)
        stats = engine.last_stats
        run.losses.append(loss)
        run.rows.append(StepRow(loss=loss, wall_s=wall_s, compute_s=stats.compute_s, comm_s=comm_s,
                                samples=stats.samples, tokens=tokens, peak_bytes=peak_bytes,
                                lr=monitor.lr(engine.iteration - 1), grad_norm=engine.last_grad_norm,
                                flat_blocked=flat_blocked))
        run.bar.update(1)
        run.bar.set_postfix(loss=f"{loss:.4f}")

    def _after_step(self, run: _Run, done: bool) -> None:
        """Gather, log, save and write metrics when due (every rank decides alike)."""
        engine, stopping = self.engine, run.signum is not None
        log_every = self.config.report.log_every
        log_now = done or bool(log_every and (engine.iteration - run.start) % log_every == 0)
        if self.checkpointer is not None:
            self.checkpointer.poll()  # a save written in the background: a failed write stops every rank here
        save_now = self.checkpointer is not None and self.checkpointer.due(done, stopping)
        # the metrics written at a save, or at a stop, cover it
        if log_now or ((save_now or stopping) and self.reports is not None):
            everyone = engine.comm.all_gather_object(run.rows, tag="fit:log")
            run.records += iteration_records(everyone, run.gathered) if run.rows else []
            run.gathered, run.rows = engine.iteration, []
        if log_now and run.records[run.logged:]:
            window = run.records[run.logged:]
            rates = self.monitor.window(window)
            if engine.rank == 0:
                run.bar.write("[poplar] " + window_message(engine, window, run.iterations, rates), file=sys.stderr)
            run.logged = len(run.records)
        if save_now:
            run.checkpoints.append(self.checkpointer.save(self.loader, self.monitor.state(), last=done or stopping))
            if self.reports is not None and engine.rank == 0:  # a run resumed from this checkpoint has the
                self.reports.write_metrics(self._summary(run))  # metrics up to it

    def _summary(self, run: _Run) -> FitResult:
        result = summarize(self.engine, run.start, run.losses, run.records, run.clock, run.checkpoints)
        self.monitor.complete(result, run.clock.warmup)
        return result

    def _finish(self, run: _Run) -> FitResult:
        engine = self.engine
        result = summarize(engine, run.start, run.losses, run.records, run.clock, run.checkpoints)
        result.replans = self.replanner.records(run.first_replan) if self.replanner is not None else []
        self.monitor.complete(result, run.clock.warmup)
        if run.signum is not None:  # every rank: write the reports, then stop
            if self.reports is not None:
                self.reports.write(result)
            raise Preempted(run.signum, engine.iteration, None if self.checkpointer is None
                            else self.checkpointer.path_at(engine.iteration))
        if engine.rank == 0:
            err = result.prediction_error
            log.info(f"done: iterations {run.start}..{engine.iteration}, {result.samples_per_s:.1f} samples/s, "
                     f"iteration {result.median_iteration_s:.4f} s" + self.monitor.summary(result)
                     + (f" (predicted {result.predicted_iteration_s:.4f} s, {err:+.1%})" if err is not None else ""))
        if self.reports is not None:
            self.reports.write(result)
        return result

    def _nothing_to_do(self, iterations: int) -> FitResult:
        """A run that has already reached ``iterations`` (a finished run started again) trains,
        saves and writes nothing: its reports stay those of the run that did the work."""
        engine, at = self.engine, self.engine.iteration
        if engine.rank == 0:
            where = self.config.report.dir
            log.info(f"nothing to do: the engine is at iteration {at} and iterations={iterations} is reached"
                     + (f"; the reports in {where} are left as they are" if where is not None else "")
                     + " (raise iterations to train further)")
        return FitResult(at, at, [], 0.0, 0.0, 0.0, engine.plan.predicted_iteration_s)

    def save_pretrained(self, directory: str | os.PathLike, tokenizer: Any = None) -> None:
        """Write the model as it is now into ``directory`` as a Hugging Face folder: weights,
        ``config.json`` and ``tokenizer`` (a ``transformers`` tokenizer; None: none), loadable
        with ``from_pretrained(directory)`` and ``AutoTokenizer.from_pretrained(directory)``.
        Every rank calls it (at ZeRO-3 the weights are gathered); rank 0 writes. The model must
        be a ``transformers`` model; any other is a ``TypeError`` naming checkpoints instead."""
        save_hf_folder(self.engine, directory, tokenizer)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the TensorBoard writer and let go of the checkpoint directory (the trainer can
        still ``fit``, without event files; its next save claims the directory again)."""
        self.monitor.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class _Run:
    """What one ``fit`` call accumulates."""

    start: int  # the engine's iteration when the call began
    iterations: int  # the iteration to reach
    clock: RunClock
    bar: Any
    first_replan: int  # the re-planner's decisions before this call
    rows: list[StepRow] = field(default_factory=list)  # this rank's, not gathered yet
    records: list[dict[str, Any]] = field(default_factory=list)  # every rank's, per iteration
    losses: list[float] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    gathered: int = field(init=False)  # the iteration of ``rows[0]``
    logged: int = 0  # records logged so far
    signum: int | None = None  # the stop signal every rank agreed on

    def __post_init__(self) -> None:
        self.gathered = self.start


def fit(engine: PoplarEngine, data: Any, iterations: int, *, lr_schedule: Callable[[int], float | None] | None = None,
        evaluation: EvalOptions | None = None, checkpoint: CheckpointOptions | str | os.PathLike | None = None,
        report: ReportOptions | str | os.PathLike | None = None, replan: bool | ReplanOptions | None = None,
        config: FitConfig | None = None) -> FitResult:
    """Train ``engine`` on ``data`` until its iteration count reaches ``iterations``; returns the
    ``FitResult``. Every rank calls it together.

        poplar.fit(engine, data, iterations=40, lr_schedule=LRSchedule(...),
                   evaluation=EvalOptions(held_out, every=20), checkpoint="runs/x/ckpt", report="runs/x")

    The keywords are shortcuts for the fields of ``config`` (a ``FitConfig``: the loss, warm-up,
    loader, throughput and preemption knobs, and these) and replace them; a field given both
    ways is an error. ``checkpoint`` and ``report`` take a directory for the default policy
    there, and ``replan`` True / False for ``ReplanOptions()`` / ``ReplanOptions(enabled=False)``.
    A ``Trainer`` is the same loop as an object.
    """
    _check_iterations(iterations)
    # the door: the short forms become policies here, once (FitConfig takes the policies alone)
    shortcuts = {"lr_schedule": lr_schedule, "evaluation": evaluation,
                 "checkpoint": CheckpointOptions(checkpoint) if _is_path(checkpoint) else checkpoint,
                 "report": ReportOptions(report) if _is_path(report) else report,
                 "replan": ReplanOptions(enabled=replan) if isinstance(replan, bool) else replan}
    with Trainer(engine, data, _with_shortcuts(config, shortcuts)) as trainer:
        return trainer.fit(iterations)


def _with_shortcuts(config: FitConfig | None, shortcuts: dict[str, Any]) -> FitConfig:
    """``config`` with the shortcuts given (not None) in place of its fields."""
    base = FitConfig() if config is None else config
    if not isinstance(base, FitConfig):
        raise TypeError(f"config must be a poplar.train.FitConfig, got {type(base).__name__}")
    given = {name: value for name, value in shortcuts.items() if value is not None}
    default = FitConfig()
    for name in given:
        mine = getattr(base, name)
        if mine is not None and (name != "report" or mine != default.report):
            raise ValueError(f"{name} is given twice, as fit(..., {name}=...) and in config; give it once")
    return dataclasses.replace(base, **given) if given else base


def _is_path(value: Any) -> bool:
    import os

    return isinstance(value, (str, os.PathLike))


def _check_iterations(iterations: Any) -> None:
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be an int >= 0, got {iterations!r}")


def _loader_for(engine: Any, data: Any, options: LoaderOptions) -> PlanLoader:
    if isinstance(data, PlanLoader):
        if data.plan is not engine.plan:
            data.set_plan(engine.plan, engine.rank)
        return data
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(f"fit takes a map-style dataset or a poplar.train.data.PlanLoader, got {type(data).__name__}")
    return PlanLoader.for_engine(data, engine, options)
