"""The policies of a training run, and ``FitConfig``, the one object that holds them.

A run's knobs are grouped by what they govern, as FSDP2 groups its policies, so that every door
stays small and a call names only what differs from the defaults:

- ``CheckpointOptions(dir, every, keep_checkpoints, resume)``: where, how often and how many
  checkpoints, and whether to resume from the latest;
- ``EvalOptions(data, every, loss_fn, max_samples)``: the held-out set and when to evaluate it;
- ``ReportOptions(dir, log_every, progress, tensorboard)``: what the run says about itself: the
  log window, the progress bar, the report files and the TensorBoard events;
- ``ThroughputOptions(tokens_fn, flops_per_token)``: how tokens/s and MFU are counted;
- ``LoaderOptions`` (``poplar.train.data``): the sample stream and how batches are loaded;
- ``ReplanOptions`` (``poplar.train.replan``): re-planning on drift.

``FitConfig`` holds one of each, with the loss, the learning-rate schedule, the warm-up and
preemption; each field has one type, the policy's. ``poplar.fit``, the functional door, also
takes the common short forms and converts them once: ``checkpoint="ckpt"`` is
``CheckpointOptions("ckpt")``, ``report="runs/x"`` is ``ReportOptions("runs/x")``, and
``replan=True`` / ``False`` is ``ReplanOptions()`` / ``ReplanOptions(enabled=False)``.

Every field is checked when the object is built, before any rank starts a collective, and a bad
value is an error that names the field and what it takes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from poplar.train.data import LoaderOptions
from poplar.train.replan import ReplanOptions


def _count(value: Any, minimum: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``minimum``."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


@dataclass(frozen=True)
class CheckpointOptions:
    """Checkpoints every ``every`` iterations (None: only at the end) and at the end, each in
    its own step directory of ``dir`` with ``index.json`` naming the latest; the newest
    ``keep_checkpoints`` are kept (``poplar.checkpoint.kept``). With ``resume`` the run first
    loads the latest complete checkpoint there (or ``dir`` itself if it is a single checkpoint):
    any plan, stage or world size. With ``async_save`` a save between iterations only copies the
    shards to host memory and training goes on while a background thread writes them
    (``poplar.checkpoint.background``); the last save of a run is written before ``fit`` returns."""

    dir: str | os.PathLike
    every: int | None = None
    keep_checkpoints: int = 2
    resume: bool = True
    async_save: bool = False

    def __post_init__(self) -> None:
        if not _is_path(self.dir):
            raise TypeError(f"CheckpointOptions needs dir, the directory the checkpoints go to (a str or a path), "
                            f"got {self.dir!r}")
        if self.every is not None and not _count(self.every, 1):
            raise ValueError(f"checkpoint every must be an int >= 1 (iterations between checkpoints) or None "
                             f"(only at the end), got {self.every!r}")
        if not _count(self.keep_checkpoints, 1):
            raise ValueError(f"keep_checkpoints must be an int >= 1 (how many checkpoints to keep), got "
                             f"{self.keep_checkpoints!r}")
        if not isinstance(self.resume, bool):
            raise TypeError(f"CheckpointOptions.resume must be True or False, got {self.resume!r}")
        if not isinstance(self.async_save, bool):
            raise TypeError(f"CheckpointOptions.async_save must be True or False, got {self.async_save!r}")


@dataclass(frozen=True)
class EvalOptions:
    """Evaluate on the held-out map-style dataset ``data`` every ``every`` iterations (None:
    only at the end) and at the end, exactly over ranks (``poplar.train.evaluation``).
    ``loss_fn``: default the training loss; ``max_samples``: evaluate the first ones only."""

    data: Any
    every: int | None = None
    loss_fn: Callable | None = None
    max_samples: int | None = None

    def __post_init__(self) -> None:
        if self.data is None:
            raise ValueError("EvalOptions needs data, a held-out map-style dataset (evaluation without one is "
                             "not possible: leave evaluation=None to train without it)")
        if not (hasattr(self.data, "__len__") and hasattr(self.data, "__getitem__")):
            raise TypeError(f"EvalOptions.data must be a map-style dataset (__len__ and __getitem__), got "
                            f"{type(self.data).__name__}")
        if self.every is not None and not _count(self.every, 1):
            raise ValueError(f"eval every must be an int >= 1 (iterations between evaluations) or None (only at "
                             f"the end), got {self.every!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"EvalOptions.loss_fn must be loss_fn(module, batch) or None (the training loss), got "
                            f"{type(self.loss_fn).__name__}")
        if self.max_samples is not None and not _count(self.max_samples, 1):
            raise ValueError(f"EvalOptions.max_samples must be an int >= 1 or None (the whole set), got "
                             f"{self.max_samples!r}")


@dataclass(frozen=True)
class ReportOptions:
    """What a run says about itself. Every ``log_every`` iterations (0: only at the end) rank 0
    logs measured against predicted times; ``progress``: a progress bar on rank 0 (when stderr is
    a terminal); ``dir``: the report files (``poplar.train.report``), written by rank 0;
    ``tensorboard``: event files in ``dir/tensorboard`` (None: when the package is installed,
    True: required, False: never)."""

    dir: str | os.PathLike | None = None
    log_every: int = 10
    progress: bool = True
    tensorboard: bool | None = None

    def __post_init__(self) -> None:
        if self.dir is not None and not _is_path(self.dir):
            raise TypeError(f"ReportOptions.dir must be a directory (a str or a path) or None (no report files), "
                            f"got {self.dir!r}")
        if not _count(self.log_every, 0):
            raise ValueError(f"log_every must be an int >= 0 (iterations between log lines; 0: only at the end), "
                             f"got {self.log_every!r}")
        if self.tensorboard is not None and not isinstance(self.tensorboard, bool):
            raise TypeError(f"ReportOptions.tensorboard must be True, False or None (when installed), got "
                            f"{self.tensorboard!r}")
        if self.tensorboard and self.dir is None:
            raise ValueError("tensorboard=True needs a report dir (the event files go to dir/tensorboard): give "
                             "ReportOptions(dir, tensorboard=True)")


@dataclass(frozen=True)
class ThroughputOptions:
    """How tokens/s and MFU are counted (``poplar.train.throughput``): ``tokens_fn(batch)`` counts
    a batch's tokens (default ``count_tokens``: the attention mask's ones, else the token ids);
    ``flops_per_token``: model FLOPs per token (default 6·N for N trainable parameters)."""

    tokens_fn: Callable[[Any], int] | None = None
    flops_per_token: float | None = None

    def __post_init__(self) -> None:
        if self.tokens_fn is not None and not callable(self.tokens_fn):
            raise TypeError(f"ThroughputOptions.tokens_fn must be a function of a batch or None, got "
                            f"{type(self.tokens_fn).__name__}")
        f = self.flops_per_token
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0):
            raise ValueError(f"flops_per_token must be a number > 0 or None (6 x the trainable parameters), got "
                             f"{f!r}")


@dataclass(frozen=True)
class FitConfig:
    """Everything a ``Trainer`` (or ``poplar.fit``) takes besides the engine, the data and the
    iteration to reach.

    Args:
        loss_fn: default the engine's ``loss_fn``.
        lr_schedule: an ``LRSchedule`` (warmup + cosine / linear decay; saved in checkpoints and
            restored on resume) or any function of the iteration returning an lr or None, set as
            every param group's learning rate before that iteration (a function of the iteration
            alone, so a resume continues it).
        warmup: leading iterations of each ``fit`` call left out of the medians and the throughput.
        evaluation: ``EvalOptions``, or None for no evaluation.
        checkpoint: ``CheckpointOptions``, or None for no checkpoints.
        report: ``ReportOptions``.
        loader: ``LoaderOptions`` of the loader built over a dataset (a ``PlanLoader`` given as the
            data keeps its own).
        throughput: ``ThroughputOptions``.
        replan: re-plan when a rank's speed or memory drifts (``poplar.train.replan``): None = on
            when the engine has a profile; a ``ReplanOptions``: on (an error without a profile),
            or off with ``ReplanOptions(enabled=False)``. Adds no collective.
        stop_on_signals: SIGTERM / SIGINT on any rank stop every rank after the same iteration,
            which is checkpointed and reported; then ``Preempted`` is raised on every rank
            (``poplar.train.preemption``). Costs one tiny all-reduce per iteration.
    """

    loss_fn: Callable | None = None
    lr_schedule: Callable[[int], float | None] | None = None
    warmup: int = 1
    evaluation: EvalOptions | None = None
    checkpoint: CheckpointOptions | None = None
    report: ReportOptions = field(default_factory=ReportOptions)
    loader: LoaderOptions = field(default_factory=LoaderOptions)
    throughput: ThroughputOptions = field(default_factory=ThroughputOptions)
    replan: ReplanOptions | None = None
    stop_on_signals: bool = False

    def __post_init__(self) -> None:
        for name, kind, none_ok in (("evaluation", EvalOptions, True), ("checkpoint", CheckpointOptions, True),
                                    ("report", ReportOptions, False), ("loader", LoaderOptions, False),
                                    ("throughput", ThroughputOptions, False), ("replan", ReplanOptions, True)):
            value = getattr(self, name)
            if not (isinstance(value, kind) or (none_ok and value is None)):
                raise TypeError(f"{name} must be a {kind.__name__}{' or None' if none_ok else ''}, got "
                                f"{value!r}{_short_form(name, value)}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be loss_fn(module, batch) or None (the engine's), got "
                            f"{type(self.loss_fn).__name__}")
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            raise TypeError(f"lr_schedule must be an LRSchedule or a function of the iteration, got "
                            f"{type(self.lr_schedule).__name__}")
        if not _count(self.warmup, 0):
            raise ValueError(f"warmup must be an int >= 0 (leading iterations left out of the medians), got "
                             f"{self.warmup!r}")
        if not isinstance(self.stop_on_signals, bool):
            raise TypeError(f"stop_on_signals must be True or False, got {self.stop_on_signals!r}")


def _short_form(name: str, value: Any) -> str:
    """The fix for a short form given to ``FitConfig``, which takes the policy alone."""
    if name in ("checkpoint", "report") and _is_path(value):
        kind = "CheckpointOptions" if name == "checkpoint" else "ReportOptions"
        return f"; write {name}={kind}({str(value)!r}) (poplar.fit(..., {name}=...) also takes the directory alone)"
    if name == "replan" and isinstance(value, bool):
        return (f"; write replan=ReplanOptions({'' if value else 'enabled=False'}) (poplar.fit(..., replan=...) also "
                "takes True / False)")
    return ""
