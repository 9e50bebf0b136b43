"""A failed iteration as data: which ranks failed and how, so a caller can recover from the
failures it knows (an out-of-memory error at a rank's micro-batch: re-plan and retry,
docs/design.md §10) and re-raise the rest.

``IterationFailed`` is the ``DistributedError`` the status reduction raises on every rank when
some rank failed (docs/design.md §3.4); every rank gets the same ``failures``.

[Note: a failed micro-step's frames]
An exception caught in ``ZeroRuntime`` holds its traceback, the traceback holds the frames of the
failed forward (their locals: activations, the autograd graph), and the frames reach back through
``f_back`` to the runtime's frame that keeps the exception to re-raise it later: a reference cycle,
freed only by the garbage collector. After an out-of-memory error that leaves the memory full, so
the next iteration, even on a plan that fits, runs out of memory again unless the user calls
``gc.collect()``. ``release_frames`` turns the traceback into text (an exception note, shown where
the traceback would be) and drops it, so reference counting frees the frames as soon as the step
is abandoned: the error keeps its story, not its frames.
"""

from __future__ import annotations

import traceback
from enum import Enum

import torch

from poplar.types.errors import DistributedError


class FailureKind(Enum):
    """How one rank's part of an iteration failed."""

    OUT_OF_MEMORY = "out_of_memory"
    ERROR = "error"  # anything else: bad input, a bug, a non-OOM exception


def is_oom(exc: BaseException | None) -> bool:
    """True if ``exc`` or anything in its cause/context chain is an out-of-memory error: a
    ``torch.OutOfMemoryError`` (what CUDA raises, and what an emulated device raises), or the
    plain ``RuntimeError("CUDA out of memory ...")`` of older builds. The one detector: the
    runtime's failure report, the capacity search and re-planning all ask it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower() and "CUDA" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def failure_kind(exc: BaseException | None) -> FailureKind:
    """OUT_OF_MEMORY if ``exc`` is an out-of-memory error (``is_oom``), else ERROR."""
    return FailureKind.OUT_OF_MEMORY if is_oom(exc) else FailureKind.ERROR


def release_frames(error: BaseException) -> None:
    """Replace ``error``'s traceback by a note holding its text, and clear the frames' locals
    (Note: a failed micro-step's frames)."""
    tb = error.__traceback__
    if tb is None:
        return
    error.add_note("Traceback of the failed micro-step (its frames were released):\n"
                   + "".join(traceback.format_tb(tb)).rstrip())
    traceback.clear_frames(tb)
    error.__traceback__ = None


class IterationFailed(DistributedError):
    """An iteration some ranks failed; no optimizer step was taken and the iteration count did
    not move. ``failures`` maps each failing rank to its ``FailureKind``."""

    def __init__(self, message: str, iteration: int, failures: dict[int, FailureKind]) -> None:
        super().__init__(message)
        self.iteration, self.failures = iteration, dict(failures)

    @property
    def out_of_memory_ranks(self) -> list[int]:
        return sorted(r for r, k in self.failures.items() if k is FailureKind.OUT_OF_MEMORY)

    @property
    def only_out_of_memory(self) -> bool:
        """Every failing rank ran out of memory (nothing else went wrong)."""
        return bool(self.failures) and all(k is FailureKind.OUT_OF_MEMORY for k in self.failures.values())
