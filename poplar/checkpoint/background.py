"""Saves written while training goes on: the shards are copied to host memory between
iterations (the only wait), then a thread writes them, over a process group of its own, with
the guarantees of a synchronous save (``save.write_checkpoint``: index last, rename, the
previous checkpoint kept until the new one is whole). Every rank asks at each iteration
boundary (``PendingSave.poll``, collective) whether every rank's thread is done; a failed write
on any rank is a ``CheckpointError`` on every rank there. One save is in flight at a time.

[Note: a group of its own]
The thread's collectives (DCP's plans, the agreement on the files written) run while the main
thread runs the training's collectives. On one process group their order would differ between
ranks; so the checkpoint thread has its own gloo group (``checkpoint_comm``), made once, by
every rank together, between iterations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from poplar.checkpoint.errors import CheckpointError
from poplar.comm import Communicator

# a background write waits on the other ranks' writes (DCP's plans, the files' agreement); one
# that passes this is a failed save, reported at the next iteration boundary
WRITE_TIMEOUT_S = 1800.0


def checkpoint_comm(comm: Any) -> Communicator:
    """A communicator over a new gloo group of the same ranks, for the checkpoint thread.
    Collective (every rank, between iterations)."""
    if not comm.distributed:
        return Communicator(None, torch.device("cpu"))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=WRITE_TIMEOUT_S))
    return Communicator(group, torch.device("cpu"))


class PendingSave:
    """One save being written by a background thread."""

    def __init__(self, write: Callable[[], None], label: str) -> None:
        self.label = label
        self.error: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(write,), name=f"poplar-save {label}", daemon=True)
        self.thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - reported on every rank at the next boundary
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()

    def poll(self, comm: Any) -> bool:
        """Collective: whether every rank's write is done; ``CheckpointError`` on every rank if
        any rank's failed."""
        finished = comm.agree(self.error, f"save checkpoint {self.label} (written in the background)",
                              self.done.is_set(), error_type=CheckpointError)
        return all(finished)

    def wait(self, comm: Any) -> None:
        """Collective: wait for this rank's write, then as ``poll``."""
        self.done.wait()
        self.poll(comm)
