"""How a checkpoint failure is reported: found by one rank, raised on every rank together."""

from __future__ import annotations

from poplar.comm import DistributedError


class CheckpointError(DistributedError):
    """A checkpoint could not be saved or loaded; raised on every rank together."""


class DamagedCheckpoint(CheckpointError):
    """A complete-looking checkpoint whose data files do not match their sha256 (changed or
    damaged after they were written); a run resuming from kept checkpoints goes back to the
    previous one."""


class Invalid(Exception):
    """A problem found by one rank, reported at the next agreement point."""


class Damaged(Invalid):
    """A data file that does not match its sha256 in the index."""
