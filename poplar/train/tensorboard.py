"""TensorBoard event files for ``fit`` (optional: ``pip install 'poplar[tensorboard]'``).

``ScalarLog.open(log_dir)`` returns a writer of scalars when the ``tensorboard`` package is
installed and None otherwise; the import is lazy, so Poplar never needs it. Only rank 0 writes.
Tags: ``train/loss``, ``train/grad_norm`` (the global gradient norm before clipping), ``train/lr``, ``eval/loss``, ``eval/perplexity``,
``throughput/tokens_per_s``, ``throughput/samples_per_s``, ``throughput/mfu``,
``memory/peak_bytes/rank{r}``, and each rank's ``time/compute_s/rank{r}``, ``time/comm_s/rank{r}``,
``time/idle_s/rank{r}`` and ``time/other_s/rank{r}`` (the log table's, defined in
``poplar.train.rank_times``); the step is the iteration.
"""

from __future__ import annotations

import os
from typing import Any


class ScalarLog:
    """A thin wrapper over ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    @classmethod
    def open(cls, log_dir: str | os.PathLike) -> "ScalarLog | None":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard not installed (torch raises ImportError then)
            return None
        return cls(SummaryWriter(log_dir=str(log_dir)))

    def add(self, tag: str, value: float | None, step: int) -> None:
        if value is not None:
            self._writer.add_scalar(tag, float(value), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
