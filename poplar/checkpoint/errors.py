"""How a checkpoint failure is reported: found by one rank, raised on every rank together."""

from __future__ import annotations

from poplar.comm import DistributedError


class CheckpointError(DistributedError):
    """A checkpoint could not be saved or loaded; raised on every rank together."""


class Invalid(Exception):
    """A problem found by one rank, reported at the next agreement point."""
