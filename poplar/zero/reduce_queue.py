"""The bounded queue of gradient reduce-scatters in flight, shared by ZeRO stages 2 and 3, and
the node accumulators' exchanges across nodes (``NodeExchanges``).

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
from typing import Callable, Iterable, Protocol

import torch

from poplar.comm import PendingChain, PendingCollective
from poplar.comm.ledger import CommLedger, Phase


@dataclass
class ReduceHandle:
    """One async reduce-scatter: ``output`` receives this rank's slice of the sum of ``input``
    over ranks and is then added into ``grad``. ``input`` is kept alive until the collective is
    done; ``held_bytes`` is the transient memory the reduce keeps alive, output included."""

    work: PendingCollective | PendingChain | None
    output: torch.Tensor
    input: torch.Tensor
    grad: torch.Tensor
    held_bytes: int
    then: Callable[[], None] | None = None  # what follows once ``grad`` holds it (``NodeExchanges.after_reduce``)

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.grad.add_(self.output)
        if self.then is not None:
            self.then()


@dataclass
class ExchangeHandle:
    """One node accumulator's exchange across nodes in flight (``NodeExchanges``)."""

    work: PendingChain | None
    held_bytes: int = 0  # its incoming partials live inside the collective, freed when it is done

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()


class InFlight(Protocol):
    held_bytes: int

    def finish(self) -> None:
        ...


class ReduceQueue:
    """Reduce-scatters in flight, completed first in, first out, at most ``max_in_flight`` left
    running; ``release(nbytes)`` is told the bytes of each completed one."""

    def __init__(self, max_in_flight: int, release: Callable[[int], None]) -> None:
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
        self.max_in_flight, self._release = max_in_flight, release
        self._in_flight: deque[InFlight] = deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    def push(self, handle: InFlight) -> None:
        """Queue an issued reduce-scatter; complete the oldest ones beyond the bound."""
        self._in_flight.append(handle)
        while len(self._in_flight) > self.max_in_flight:
            self._complete(self._in_flight.popleft())

    def drain(self) -> None:
        """Complete every reduce-scatter in flight, oldest first."""
        while self._in_flight:
            self._complete(self._in_flight.popleft())

    def _complete(self, handle: InFlight) -> None:
        handle.finish()
        self._release(handle.held_bytes)


class NodeExchanges:
    """Across nodes once per iteration (docs/design.md §3.10.12): the exchanges of a stage's node
    accumulators (ZeRO-2's units, ZeRO-3's blocks), each named by a key (its index); ``issue(i)``
    issues accumulator ``i``'s exchange, async.

    [Note: the exchange overlaps the last lock-step micro-step]
    An accumulator holds its node's final partial sums once the in-node reduce-scatter of the
    iteration's last lock-step micro-step (the plan's largest micro-step count) has been added to
    it, so its exchange starts then (``after_reduce``), while backward still computes the
    gradients of the accumulators before it, rather than once every micro-step is over. Every
    rank joins that micro-step, a rank with fewer micro-steps with zeros (``empty_micro_step``),
    and completes its reduce-scatters in the same order, so every rank issues the exchanges in
    the same order. At most ``max_in_flight`` run at once (each holds the other nodes' incoming
    partials). ``finish`` issues those not started (no last lock-step micro-step ran: the stage
    was driven without the runtime's ``last_lockstep_micro_step``) in the order of its keys and
    completes all, before the status reduction reads the gradients.
    """

    def __init__(self, issue: Callable[[int], PendingChain | None], ledger: CommLedger, max_in_flight: int) -> None:
        self._issue, self._ledger = issue, ledger
        self._queue = ReduceQueue(max_in_flight, lambda nbytes: None)
        self._on = self._armed = False
        self._started: set[int] = set()

    def use(self, on: bool) -> None:
        """Whether the stage's route crosses nodes once per iteration (``Routes.accumulates``):
        off, nothing here issues anything."""
        self._on = on
        self.reset()

    def last_micro_step(self) -> None:
        """The last lock-step micro-step begins: exchanges start as its reductions complete."""
        self._armed = self._on

    def after_reduce(self, i: int) -> Callable[[], None] | None:
        """What follows accumulator ``i``'s in-node reduce-scatter once added to it: in the last
        lock-step micro-step its exchange; before it nothing (None)."""
        return (lambda: self._start(i)) if self._armed else None

    def _start(self, i: int) -> None:
        self._started.add(i)
        # an iteration's collective, not the micro-step's: stamped as close_micro_steps stamps it
        with self._ledger.scope(Phase.BACKWARD, micro_step=-1):
            self._queue.push(ExchangeHandle(self._issue(i)))

    def finish(self, keys: Iterable[int]) -> None:
        """Issue the exchanges of ``keys`` not started yet, in that order, and complete every one."""
        for i in keys if self._on else ():
            if i not in self._started:
                self._start(i)
        self._queue.drain()
        self.reset()

    def reset(self) -> None:
        """The iteration is over (or abandoned between micro-steps, nothing in flight)."""
        self._armed = False
        self._started.clear()
