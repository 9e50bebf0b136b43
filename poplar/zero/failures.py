"""A failed iteration as data: which ranks failed and how, so a caller can recover from the
failures it knows (an out-of-memory error at a rank's micro-batch: re-plan and retry,
docs/design.md §11) and re-raise the rest.

``IterationFailed`` is the ``DistributedError`` the status reduction raises on every rank when
some rank failed (docs/design.md §3.4); every rank gets the same ``failures``.
"""

from __future__ import annotations

from enum import Enum

import torch

from poplar.types.errors import DistributedError


class FailureKind(Enum):
    """How one rank's part of an iteration failed."""

    OUT_OF_MEMORY = "out_of_memory"
    ERROR = "error"  # anything else: bad input, a bug, a non-OOM exception


def failure_kind(exc: BaseException | None) -> FailureKind:
    """OUT_OF_MEMORY if ``exc`` or anything in its cause/context chain is ``torch.OutOfMemoryError``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError):
            return FailureKind.OUT_OF_MEMORY
        exc = exc.__cause__ or exc.__context__
    return FailureKind.ERROR


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
