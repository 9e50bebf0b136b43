"""The collective timeout every door of a job uses by default, and setting it on a group that
someone else created.

A collective whose peer hangs (stopped, deadlocked, on a machine that went away) blocks until this
timeout; then the rank fails with one line naming the peer (``poplar.process.failure``). ``poplar
train`` (``"poplar.collective_timeout_s"``), ``PoplarStrategy`` and ``PoplarTrainer`` share the
default: long enough for a first step that profiles or compiles, short enough that a hung job
ends within minutes rather than the half hour of torch's and Hugging Face's defaults.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 300.0


def set_collective_timeout(timeout_s: float) -> bool:
    """Give the default process group's collectives ``timeout_s`` from now on (a group that a
    framework created with its own timeout: Accelerate's, or the user's). False where this torch
    build cannot change the timeout of an existing group (the group keeps its own)."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is None or not dist.is_initialized():
        return False
    setter(timedelta(seconds=timeout_s))
    return True
