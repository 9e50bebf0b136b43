"""The bounded queue of gradient reduce-scatters in flight, shared by ZeRO stages 2 and 3.

A stage issues a reduce-scatter asynchronously as soon as a bucket (stage 2) or a block (stage
3) is ready, and pushes its ``ReduceHandle`` here. The queue completes handles in issue order
and never leaves more than ``max_in_flight`` running, which bounds the gradient buffers alive
at once; ``drain()`` completes the rest (at the end of a micro-step). Waiting is safe: every rank
issues the same reduce-scatters in the same order, so the one waited on has been issued by all.
Completing a handle adds this rank's reduced slice into its persistent gradient and hands the
transient bytes it kept alive back to the stage's accounting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from poplar.comm import PendingCollective


@dataclass
class ReduceHandle:
    """One async reduce-scatter: ``output`` receives this rank's slice of the sum of ``input``
    over ranks and is then added into ``grad``. ``input`` is kept alive until the collective is
    done; ``held_bytes`` is the transient memory the reduce keeps alive, output included."""

    work: PendingCollective | None
    output: torch.Tensor
    input: torch.Tensor
    grad: torch.Tensor
    held_bytes: int

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.grad.add_(self.output)


class ReduceQueue:
    """Reduce-scatters in flight, completed first in, first out, at most ``max_in_flight`` left
    running; ``release(nbytes)`` is told the bytes of each completed one."""

    def __init__(self, max_in_flight: int, release: Callable[[int], None]) -> None:
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
        self.max_in_flight, self._release = max_in_flight, release
        self._in_flight: deque[ReduceHandle] = deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    def push(self, handle: ReduceHandle) -> None:
        """Queue an issued reduce-scatter; complete the oldest ones beyond the bound."""
        self._in_flight.append(handle)
        while len(self._in_flight) > self.max_in_flight:
            self._complete(self._in_flight.popleft())

    def drain(self) -> None:
        """Complete every reduce-scatter in flight, oldest first."""
        while self._in_flight:
            self._complete(self._in_flight.popleft())

    def _complete(self, handle: ReduceHandle) -> None:
        handle.finish()
        self._release(handle.held_bytes)
