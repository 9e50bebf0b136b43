"""What a training run measures and returns: each rank's ``StepRow`` per iteration, the
per-iteration records built from every rank's rows, the log window rank 0 prints, and the
``FitResult``.

Per iteration each rank records a ``StepRow``; every ``log_every`` iterations the ranks exchange
them (one small object all-gather, at the same iteration on every rank) and every rank turns them
into records: the iteration's loss, global gradient norm (before clipping; the same on every
rank) and lr, its wall time (the slowest rank's) and, per rank, its
samples, tokens, peak memory and its compute, comm, idle and other seconds (defined in
``poplar.train.rank_times``; they add up to the rank's step wall time, measured around the step).
"""

from __future__ import annotations

import math

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from poplar.train import rank_times


class StepRow(NamedTuple):
    """One rank's iteration. It travels through ``all_gather_object``, so it stays a plain
    picklable tuple of numbers."""

    loss: float
    wall_s: float  # the step's wall time on this rank
    compute_s: float  # forward and backward, collectives taken out (``IterationStats.compute_s``)
    comm_s: float  # blocked in collectives during the step, waiting for slower ranks included
    samples: int
    tokens: int
    peak_bytes: int
    lr: float  # the learning rate the iteration ran at
    grad_norm: float | None = None  # the global gradient norm before clipping (None: the step was skipped)
    # each flat collective's blocked seconds in the step, in order (``rank_times.flat_blocked_seconds``):
    # matched across ranks, they split comm_s into the collectives' own time and the wait for the slowest
    flat_blocked: tuple[float, ...] = ()


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
    other_s: float = 0.0


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


def iteration_records(rows: list[list[StepRow]], first: int) -> list[dict[str, Any]]:
    """Per-iteration records (JSON-safe: ``FitResult.iterations``, ``metrics.json``) from every
    rank's rows, iteration ``first`` first."""
    records = []
    for k in range(min(len(r) for r in rows)):
        at = [rank_rows[k] for rank_rows in rows]
        times = rank_times.split([row.wall_s for row in at], [row.compute_s for row in at],
                                 [row.comm_s for row in at], [row.flat_blocked for row in at])
        # the first rank in the step says the iteration's loss and gradient norm (a rank left out of it
        # learns the loss at the status reduction but has no norm: its reduction is the step's, §3.12)
        said = next((row for row in at if row.samples), at[0])
        records.append({"iteration": first + k, "loss": said.loss, "grad_norm": said.grad_norm, "lr": said.lr,
                        "wall_s": max(row.wall_s for row in at),
                        # per rank: compute + comm + idle + other = its wall (``poplar.train.rank_times``)
                        "ranks": [{"wall_s": row.wall_s, **t._asdict(),
                                   "samples": row.samples, "tokens": row.tokens, "peak_bytes": row.peak_bytes}
                                  for row, t in zip(at, times)]})
    return records


def window_message(engine: Any, records: list[dict[str, Any]], total: int, rates: str) -> str:
    """Rank 0's log of a window of records: the last iteration's loss and gradient norm, the
    median iteration against the plan's prediction, the throughput ``rates`` and each rank's
    medians."""
    wall = statistics.median(r["wall_s"] for r in records)
    pred = engine.plan.predicted_iteration_s
    vs = f" (predicted {pred:.4f} s, {(wall - pred) / pred:+.1%})" if pred else ""
    norm = records[-1].get("grad_norm")
    return (f"iteration {engine.iteration}/{total}: loss {records[-1]['loss']:.4f}, "
            + (f"grad norm {norm:.3g}, " if norm is not None else "")
            +             f"{engine.global_batch_size / wall:.1f} samples/s, iteration {wall:.4f} s{vs}\n"
            + (f"  {rates}\n" if rates else "") + _window_table(engine, records))


def _window_table(engine: Any, records: list[dict[str, Any]]) -> str:
    """The log table of the records' per-rank medians."""
    plan = engine.plan
    head = f"{'rank':>6} {'device':>12} {'samples':>7} {'compute s':>10} {'planned s':>10} {'idle s':>8} {'comm s':>8} {'other s':>8}"
    lines = [head]
    for r in range(len(records[0]["ranks"])):
        med = lambda key: statistics.median(rec["ranks"][r][key] for rec in records)  # noqa: E731
        planned = plan.ranks[r].predicted_compute_s
        lines.append(f"{r:>6} {str(plan.ranks[r].device_type or '-'):>12} {plan.ranks[r].num_samples:>7} "
                     f"{med('compute_s'):>10.4f} {'-' if planned is None else f'{planned:.4f}':>10} "
                     f"{med('idle_s'):>8.4f} {med('comm_s'):>8.4f} {med('other_s'):>8.4f}")
    return "\n".join(lines)


@dataclass
class RunClock:
    """The wall clock of one ``fit`` call: from its start, and from the end of its warm-up."""

    warmup: int
    start: float = field(default_factory=time.perf_counter)
    measured_from: float | None = None

    def __post_init__(self) -> None:
        if self.warmup == 0:
            self.measured_from = self.start

    def begin_iteration(self, done: int) -> None:
        """Called before each iteration with the iterations this call has done: the measured time
        starts once the warm-up's are done."""
        if done == self.warmup:
            self.measured_from = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def summarize(engine: Any, start: int, losses: list[float], records: list[dict[str, Any]], clock: RunClock,
              checkpoints: list[str]) -> FitResult:
    """The ``FitResult`` of iterations ``start`` to now: rates and medians over the records after
    the warm-up (all of them if there are no more)."""
    warmup, seconds = clock.warmup, clock.seconds()
    measured = records[warmup:] or records
    n_measured = len(records) - warmup if len(records) > warmup else len(records)
    t_measured = clock.measured_from
    elapsed = (time.perf_counter() - t_measured) if (t_measured is not None and len(records) > warmup) else seconds
    walls = [r["wall_s"] for r in measured]
    ranks = []
    for r in range(engine.world_size):
        med = lambda key: statistics.median(rec["ranks"][r][key] for rec in measured) if measured else 0.0  # noqa
        ranks.append(RankSummary(r, str(engine.plan.ranks[r].device_type or ""), engine.plan.ranks[r].num_samples,
                                 med("compute_s"), engine.plan.ranks[r].predicted_compute_s, med("idle_s"),
                                 med("comm_s"), med("other_s")))
    return FitResult(start, engine.iteration, losses, seconds,
                     engine.global_batch_size * n_measured / elapsed if elapsed > 0 and n_measured else 0.0,
                     statistics.median(walls) if walls else 0.0, engine.plan.predicted_iteration_s, ranks,
                     checkpoints, records)
