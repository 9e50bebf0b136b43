"""End the process group while the interpreter still runs.

[Note: gloo at interpreter exit]
A process group left to interpreter shutdown is destroyed late, after modules are torn down; gloo's
worker threads can then be destroyed while still joinable and abort a process that finished its
work (SIGABRT, "terminate called without an active exception"), which a launcher reports as a
failed job. A front door whose group outlives the user's script (a Lightning strategy that started
it, a Trainer whose Accelerate started it) ends it at exit, after a collection has freed the work
objects that still hold it. At exit nothing can use the group any more, so ending it is safe.
"""

from __future__ import annotations

import atexit
import gc

import torch.distributed as dist

_registered = False


def end_process_group() -> None:
    """Collect what holds the group's work, then destroy the default group if it still exists."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_process_group_at_exit() -> None:
    """Register ``end_process_group`` to run at interpreter exit (once per process)."""
    global _registered
    if not _registered:
        atexit.register(end_process_group)
        _registered = True
