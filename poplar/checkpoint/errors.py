"""How a checkpoint failure is reported: found by one rank, raised on every rank together."""

from __future__ import annotations

from typing import Any

from poplar.comm import DistributedError


class CheckpointError(DistributedError):
    """A checkpoint could not be saved or loaded; raised on every rank together."""


class Invalid(Exception):
    """A problem found by one rank, reported at the next agreement point."""


def gather_or_raise(comm: Any, error: str | None, payload: Any, what: str) -> list[Any]:
    """Every rank's payload, or ``CheckpointError`` on every rank naming each failing rank (on
    every surviving rank, naming the failed collective, if a rank died or timed out)."""
    return comm.agree(error, what, payload, error_type=CheckpointError)
