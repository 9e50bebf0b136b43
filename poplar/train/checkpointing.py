"""A training run's checkpoints (``CheckpointOptions``): resume from the latest, save when due.

The functions of ``poplar.checkpoint`` and ``poplar.checkpoint.kept`` are looked up on their
modules at each call, so that one replaced there (the checkpoint tests' fault injection) is the
one called.

Each save goes into its own step directory of ``dir`` with ``index.json`` pointing at the latest,
and the newest ``keep_checkpoints`` are kept (``poplar.checkpoint.kept``). A checkpoint's
``extra`` holds the loader's position (``data``) and what the monitor keeps (the lr schedule), so
a resumed run continues the same sample stream and schedule under any plan, stage or world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import poplar.checkpoint as checkpoint
from poplar.checkpoint import kept
from poplar.train.data import PlanLoader
from poplar.train.options import CheckpointOptions
from poplar.types.logs import log


class Checkpointer:
    """Every rank holds one and calls it at the same iterations (its methods are collective)."""

    def __init__(self, engine: Any, options: CheckpointOptions) -> None:
        self.engine, self.options = engine, options

    def resume(self, loader: PlanLoader) -> dict[str, Any] | None:
        """Load the latest checkpoint into the engine and ``loader``; returns its ``extra``
        (None without a checkpoint). Rank 0 logs which one, and any passed over as damaged."""
        engine, directory = self.engine, self.options.dir
        latest = kept.agree_on_latest(engine.comm, directory)  # every rank; they must all find the same
        if latest is None:
            return None
        meta = checkpoint.load_checkpoint(engine, latest.path)  # every rank; a rank that cannot read it fails them all
        data_state = (meta.get("extra") or {}).get("data")
        if data_state is not None:
            loader.load_state_dict(data_state)
        else:
            loader.iteration = engine.iteration
        if engine.rank == 0:
            for reason in latest.passed_over:
                log.warning(f"not resuming from a damaged or incomplete checkpoint: {reason}")
            log.info(f"resumed from {directory} at iteration {engine.iteration}: {latest.path} "
                     f"({latest.source.value}; saved by {meta['world_size']} ranks at ZeRO-{meta['zero_stage']})")
        return meta.get("extra") or {}

    def due(self, done: bool, stopping: bool) -> bool:
        """Whether to save after the iteration just taken: at the end, at a stop, and every
        ``every`` iterations."""
        every = self.options.every
        return done or stopping or bool(every and self.engine.iteration % every == 0)

    def save(self, loader: PlanLoader, extra: dict[str, Any]) -> str:
        """Save at the engine's iteration with the loader's position and ``extra``; returns
        ``"dir@iteration"`` (``FitResult.checkpoints``)."""
        directory = self.options.dir
        kept.save_kept(self.engine, directory, keep=self.options.keep_checkpoints,
                  extra={"data": loader.state_dict(), **extra})
        return f"{directory}@{self.engine.iteration}"

    def path_at(self, iteration: int) -> str:
        """The step directory of the checkpoint saved at ``iteration``."""
        return str(Path(self.options.dir) / kept.step_name(iteration))
