"""A training run's checkpoints (``CheckpointOptions``): resume from the latest, save when due.

The functions of ``poplar.checkpoint`` and ``poplar.checkpoint.kept`` are looked up on their
modules at each call, so that one replaced there (the checkpoint tests' fault injection) is the
one called.

Each save goes into its own step directory of ``dir`` with ``index.json`` pointing at the latest,
and the newest ``keep_checkpoints`` are kept (``poplar.checkpoint.kept``). A checkpoint's
``extra`` holds the loader's position (``data``) and what the monitor keeps (the lr schedule), so
a resumed run continues the same sample stream and schedule under any plan, stage or world size.

One job per directory: the checkpointer claims ``dir`` (rank 0 takes its lock,
``poplar.checkpoint.lock``) before it resumes or deletes anything there, and lets go at ``close``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import poplar.checkpoint as checkpoint
from poplar.checkpoint import kept, lock
from poplar.checkpoint.background import PendingSave, checkpoint_comm
from poplar.train.data import PlanLoader
from poplar.train.options import CheckpointOptions
from poplar.logs import log


def claim(comm: Any, directory: str | Path) -> None:
    """Collective: rank 0 takes ``directory``'s lock (``poplar.checkpoint.lock``: one job per
    checkpoint directory) before anything there is deleted; ``CheckpointError`` on every rank
    when another live job holds it. Held until ``let_go``; a process may claim a directory again
    (it nests)."""
    error = note = None
    if comm.rank == 0:
        try:
            note = lock.acquire(directory)
        except lock.DirectoryLocked as e:
            error = str(e)
        except OSError as e:
            error = f"cannot write the lock file in {directory} ({type(e).__name__}: {e}); give a writable directory"
    try:
        comm.agree(error, f"claim checkpoint directory {directory}", error_type=checkpoint.CheckpointError)
    except checkpoint.CheckpointError:
        if comm.rank == 0 and error is None:
            lock.release(directory)
        raise
    if note is not None:
        log.warning(note)


def let_go(comm: Any, directory: str | Path) -> None:
    """Release what ``claim`` took (rank 0's lock)."""
    if comm.rank == 0:
        lock.release(directory)


class Checkpointer:
    """Every rank holds one and calls it at the same iterations (its methods are collective).
    It claims the checkpoint directory when built and lets go of it at ``close``."""

    def __init__(self, engine: Any, options: CheckpointOptions) -> None:
        self.engine, self.options = engine, options
        claim(engine.comm, options.dir)
        self.claimed = True
        self.pending: PendingSave | None = None  # a save being written in the background
        self.writer_comm: Any = None  # its communicator, made at the first background save

    def close(self) -> None:
        """Release the directory's lock (the lock of a process that dies is stale, and taken
        over). A save still written in the background is left to its thread (a run ends with a
        synchronous last save, so this is a run that failed): not waited for, as the ranks it
        waits on may be gone; the previous checkpoint stays complete, and the next save removes
        what an unfinished one left."""
        self.pending = None
        if self.claimed:
            self.claimed = False
            let_go(self.engine.comm, self.options.dir)

    def poll(self) -> None:
        """At each iteration boundary (collective while a save is written in the background):
        ``CheckpointError`` on every rank if a rank's write failed."""
        if self.pending is not None and self.pending.poll(self.engine.comm):
            self.pending = None

    def finish(self) -> None:
        """Wait for the save written in the background, if any (collective)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait(self.engine.comm)

    def resume(self, loader: PlanLoader) -> dict[str, Any] | None:
        """Load the latest checkpoint into the engine and ``loader``; returns its ``extra``
        (None without a checkpoint). A latest one whose data files are damaged (checksum
        mismatch) is passed over for the previous kept one. Rank 0 logs which one was loaded,
        and any passed over as damaged."""
        engine, directory = self.engine, self.options.dir
        try:
            latest = kept.agree_on_latest(engine.comm, directory)  # every rank; they must all find the same
        except kept.NoCompleteCheckpoint as e:
            raise kept.NoCompleteCheckpoint(e.problem, "pass CheckpointOptions(resume=False)") from None
        if latest is None:
            return None
        passed_over = list(latest.passed_over)
        while True:
            try:  # every rank; a rank that cannot read it fails them all
                loaded = checkpoint.load_checkpoint(engine, latest.path)
                break
            except checkpoint.DamagedCheckpoint as e:
                older = kept.agree_on_latest(engine.comm, directory, below=latest.iteration)
                if older is None:  # every kept one is damaged: say what each said, and what to do
                    raise kept.nothing_loads(directory, passed_over + [str(e)],
                                             "pass CheckpointOptions(resume=False)") from None
                passed_over.append(str(e))
                latest = older
        data_state = loaded.extra.get("data")
        if data_state is not None:
            loader.load_state_dict(data_state)
        else:
            loader.iteration = engine.iteration
        if engine.rank == 0:
            for reason in passed_over:
                log.warning(f"not resuming from a damaged or incomplete checkpoint: {reason}")
            log.info(f"resumed from {directory} at iteration {engine.iteration}: {latest.path} "
                     f"({latest.source.value}; saved by {loaded.world_size} ranks at ZeRO-{loaded.zero_stage})")
        return loaded.extra

    def due(self, done: bool, stopping: bool) -> bool:
        """Whether to save after the iteration just taken: at the end, at a stop, and every
        ``every`` iterations."""
        every = self.options.every
        return done or stopping or bool(every and self.engine.iteration % every == 0)

    def save(self, loader: PlanLoader, extra: dict[str, Any], last: bool = True) -> str:
        """Save at the engine's iteration with the loader's position and ``extra``; returns
        ``"dir@iteration"`` (``FitResult.checkpoints``). With ``async_save`` a save that is not
        the ``last`` is written in the background (the previous one finished first)."""
        directory = self.options.dir
        if not self.claimed:  # closed, then asked to go on: claim the directory again (collective, as the save)
            claim(self.engine.comm, directory)
            self.claimed = True
        self.finish()
        extra = {"data": loader.state_dict(), **extra}
        if self.options.async_save and not last:
            if self.writer_comm is None:
                self.writer_comm = checkpoint_comm(self.engine.comm)
            self.pending = kept.start_save_kept(self.engine, directory, self.writer_comm,
                                                keep=self.options.keep_checkpoints, extra=extra)
        else:
            kept.save_kept(self.engine, directory, keep=self.options.keep_checkpoints, extra=extra)
        return f"{directory}@{self.engine.iteration}"

    def path_at(self, iteration: int) -> str:
        """The step directory of the checkpoint saved at ``iteration``."""
        return str(Path(self.options.dir) / kept.step_name(iteration))
