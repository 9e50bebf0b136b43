"""What ``fit`` does around each step besides training: the learning-rate schedule, periodic
evaluation, tokens/s and MFU, peak memory, and TensorBoard scalars. One ``FitMonitor`` per
``Trainer``; the loop calls it at fixed points (every rank at the same ones):

- ``before_step(k)``: sets the schedule's lr for iteration k;
- ``row(batch)``: this rank's tokens and peak memory of the iteration, appended to the stats row
  the loop already gathers (no extra collective);
- ``after_step(done)``: evaluates on ``EvalOptions.data`` every ``EvalOptions.every`` iterations
  and at the end (``poplar.train.evaluation``: collective);
- ``window(records)``: the log line's tokens/s and MFU, and the TensorBoard scalars (rank 0);
- ``state()`` / ``load_state(extra)``: what a checkpoint keeps (the schedule's settings);
- ``complete(result, warmup)``: throughput, MFU, peak memory and evaluations into the ``FitResult``.

Constructing it gathers every rank's device and peak FLOP/s once (one small all-gather).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from poplar.train.evaluation import EvalResult, evaluate
from poplar.train.options import EvalOptions, ReportOptions, ThroughputOptions
from poplar.train.schedule import LRSchedule, apply_lr
from poplar.train.tensorboard import ScalarLog
from poplar.train.throughput import (RankDevice, count_tokens, describe, model_flops_per_token, peak_memory_bytes,
                                     rank_device, throughput)
from poplar.logs import log


class FitMonitor:
    """See the module doc. ``lr_schedule``: an ``LRSchedule`` (checkpointed) or any function of
    the iteration returning an lr or None; ``loss_fn``: the training loss, the evaluation's
    default; ``collate_fn``: the loader's, which evaluation collates with. The options are
    checked when they are built (``poplar.train.options``)."""

    def __init__(self, engine: Any, *, lr_schedule: Callable[[int], float | None] | None = None,
                 loss_fn: Callable | None = None, evaluation: EvalOptions | None = None,
                 report: ReportOptions | None = None, throughput: ThroughputOptions | None = None,
                 collate_fn: Callable | None = None) -> None:
        report = report if report is not None else ReportOptions()
        throughput = throughput if throughput is not None else ThroughputOptions()
        self.engine = engine
        self.schedule = lr_schedule
        self.evaluation = evaluation
        self.eval_loss_fn = (evaluation.loss_fn if evaluation is not None else None) or loss_fn
        self.collate_fn = collate_fn
        self.tokens_fn = throughput.tokens_fn or count_tokens
        self.flops_per_token = (float(throughput.flops_per_token) if throughput.flops_per_token
                                else model_flops_per_token(engine.module))
        self.evals: list[EvalResult] = []
        self.devices: list[RankDevice] = engine.comm.all_gather_object(rank_device(engine), tag="fit:devices")
        self.board: ScalarLog | None = None
        if engine.rank == 0 and report.dir is not None and report.tensorboard is not False:
            self.board = ScalarLog.open(Path(report.dir) / "tensorboard")
            if self.board is None and report.tensorboard:
                raise ImportError("tensorboard=True but the tensorboard package is not installed: "
                                  "pip install 'poplar[tensorboard]' (or pass tensorboard=None)")
            if self.board is None:  # tensorboard=None: events when installed, and a line when not
                log.info("TensorBoard events skipped: the tensorboard package is not installed "
                         "(pip install 'poplar[tensorboard]')")

    # ------------------------------------------------------------------ the step
    def before_step(self, iteration: int) -> None:
        if self.schedule is not None and (lr := self.schedule(iteration)) is not None:
            apply_lr(self.engine.optimizer, lr)

    def row(self, batch: Any) -> tuple[int, int]:
        """(tokens, peak memory bytes) of this rank's iteration."""
        return int(self.tokens_fn(batch)), peak_memory_bytes(self.engine)

    def after_step(self, done: bool, bar: Any = None) -> EvalResult | None:
        """Evaluate when due (every rank)."""
        options = self.evaluation
        if options is None:
            return None
        it = self.engine.iteration
        if not (done or (options.every and it % options.every == 0)):
            return None
        if self.evals and self.evals[-1].iteration == it:
            return None
        result = evaluate(self.engine, options.data, loss_fn=self.eval_loss_fn, collate_fn=self.collate_fn,
                          max_samples=options.max_samples)
        self.evals.append(result)
        if self.engine.rank == 0:
            message = (f"[poplar] eval at iteration {it}: loss {result.loss:.4f}, perplexity {result.perplexity:.2f} "
                       f"({result.samples} samples, {result.count:,.0f} scored, {result.seconds:.2f} s)")
            _say(message, bar)
            if self.board is not None:
                self.board.add("eval/loss", result.loss, it)
                self.board.add("eval/perplexity", result.perplexity, it)
                self.board.flush()
        return result

    def window(self, records: list[dict[str, Any]]) -> str:
        """The throughput part of a log message over ``records``; TensorBoard scalars (rank 0)."""
        t = throughput(records, self.engine.global_batch_size, self.flops_per_token, self.devices)
        if self.engine.rank != 0 or t is None:
            return ""
        if self.board is not None:
            for rec in records:
                k = rec["iteration"] + 1  # the iteration count after the step, as eval and the log use
                self.board.add("train/loss", rec["loss"], k)
                self.board.add("train/grad_norm", rec.get("grad_norm"), k)
                self.board.add("train/lr", rec.get("lr"), k)
                for r, rank in enumerate(rec["ranks"]):
                    self.board.add(f"memory/peak_bytes/rank{r}", rank.get("peak_bytes"), k)
                    for part in ("compute_s", "comm_s", "idle_s", "other_s"):  # the log table's per-rank times
                        self.board.add(f"time/{part}/rank{r}", rank.get(part), k)
            last = records[-1]["iteration"] + 1
            self.board.add("throughput/tokens_per_s", t.tokens_per_s, last)
            self.board.add("throughput/samples_per_s", t.samples_per_s, last)
            self.board.add("throughput/mfu", t.mfu, last)
            self.board.flush()
        return describe(t)

    def lr(self, iteration: int) -> float:
        """The lr iteration ``iteration`` ran at (the schedule's, else the first group's now)."""
        lr = self.schedule(iteration) if self.schedule is not None else None
        return float(self.engine.optimizer.param_groups[0]["lr"] if lr is None else lr)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        return {"lr_schedule": self.schedule.state_dict()} if isinstance(self.schedule, LRSchedule) else {}

    def load_state(self, extra: dict[str, Any] | None) -> None:
        """Restore the checkpoint's schedule (rank 0 says so when the caller's differs)."""
        saved = (extra or {}).get("lr_schedule")
        if saved is None or not isinstance(self.schedule, LRSchedule):
            return
        restored = LRSchedule.from_state_dict(saved)
        if restored != self.schedule and self.engine.rank == 0:
            log.warning(f"the checkpoint's lr schedule {saved} differs from the one given "
                        f"{self.schedule.state_dict()}: continuing the checkpoint's (start a new run to change it)")
        self.schedule = restored

    # ------------------------------------------------------------------ the end
    def complete(self, result: Any, warmup: int) -> None:
        """Fill ``result`` (a ``FitResult``): throughput and MFU of its iterations after the
        warm-up, per-rank peak memory, and the evaluations of its iterations (an evaluation
        follows a step, so those of a run from iteration s are at iterations after s)."""
        measured = result.iterations[warmup:] or result.iterations
        t = throughput(measured, self.engine.global_batch_size, self.flops_per_token, self.devices)
        result.tokens_per_s = t.tokens_per_s if t is not None else None
        result.mfu = t.mfu if t is not None else None
        result.throughput = t.to_dict() if t is not None else None
        result.evals = [e.to_dict() for e in self.evals if e.iteration > result.start_iteration]

    @staticmethod
    def summary(result: Any) -> str:
        """The end-of-run log's part: tokens/s, MFU, the last eval loss."""
        parts = []
        if result.tokens_per_s is not None:
            parts.append(f"{result.tokens_per_s:,.0f} tokens/s")
        if result.mfu is not None:
            parts.append(f"MFU {100 * result.mfu:.3g}%")
        if result.evals:
            parts.append(f"eval loss {result.evals[-1]['loss']:.4f}")
        return "".join(f", {p}" for p in parts)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


def _say(message: str, bar: Any) -> None:
    import sys

    if bar is not None:
        bar.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)
