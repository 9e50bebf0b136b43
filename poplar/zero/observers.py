"""The one way to extend a training step: observers the runtime calls at named points.

A ``StepObserver`` overrides the points it needs; ``ZeroRuntime.add_observer`` attaches it and
returns an ``ObserverHandle`` whose ``remove()`` detaches it. The points of one micro-step, in
order:

    micro_step_start -> forward_start -> forward_end -> backward_start -> collectives_completing
        -> backward_end -> micro_step_end

framed by ``iteration_start`` and ``iteration_end``. ``backward_end`` comes after the stage has
completed the micro-step's collectives (ZeRO-2/3 reduce-scatters), so a device that pads compute
there pads the whole micro-step. ``collectives_completing`` comes between the
micro-step's own compute (autograd has returned) and the stage completing its collectives; an
observer must not raise there, nor in ``transient_allocated`` from then on or outside a
micro-step (the zeros a rank joins the others' collectives with, the gathers of a full state):
the other ranks would be left inside those collectives. ``transient_allocated`` is called
whenever the stage has just allocated a transient buffer that counts against memory (a ZeRO-3
gathered block). ``host_copy`` is called at the optimizer step of a rank that offloads its
optimizer (``poplar.zero.offload``), once its gradient shards were copied to the host and once
the stepped values were queued back, with the bytes copied: a device that models its host link
(an emulated GPU) takes that long there; it must not raise (the other ranks' collectives follow).
``micro_step_abort`` replaces the remaining points of a micro-step that raised.

Start points run in the order observers were added, end points in reverse order, as nested
context managers would. An observer may raise (a virtual device raises its out-of-memory
error); the step then fails as if its own code had raised.

``MicroStepTimeline`` is the observer the training loop draws its trace from: the windows of
recent micro-steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Iterator

import torch


class CopyDirection(str, Enum):
    """Which way an offloading rank's copies of its optimizer shard went."""

    TO_HOST = "to_host"  # the reduced gradient shards
    TO_DEVICE = "to_device"  # the stepped parameter shards


@dataclass
class MicroStep:
    """One micro-step: ``batch_size`` samples (0 when a loop of the user's own gave an input
    whose batch size could not be read) of ``iteration``, at position ``index``."""

    iteration: int
    index: int
    batch_size: int
    forward_started: bool = False
    forward_ended: bool = False


@dataclass
class IterationStats:
    """What one iteration cost this rank, measured: ``compute_s`` is forward+backward time with
    the seconds spent blocked in collectives taken out; ``comm_s`` is all the iteration's
    blocked collective time (waiting for slower ranks included). ``rank_compute_s`` and
    ``rank_samples`` are every rank's compute seconds and samples, shared by the iteration's
    status reduction (empty for a step that failed before it)."""

    iteration: int
    wall_s: float
    compute_s: float
    comm_s: float
    samples: int
    micro_steps: int
    rank_compute_s: tuple[float, ...] = ()
    rank_samples: tuple[int, ...] = ()


class StepObserver:
    """Base class: every point is a no-op; override the ones you need."""

    def iteration_start(self, iteration: int) -> None:
        pass

    def micro_step_start(self, step: MicroStep) -> None:
        pass

    def forward_start(self, step: MicroStep) -> None:
        pass

    def forward_end(self, step: MicroStep) -> None:
        pass

    def backward_start(self, step: MicroStep, loss: torch.Tensor) -> None:
        pass

    def collectives_completing(self, step: MicroStep) -> None:
        pass

    def backward_end(self, step: MicroStep) -> None:
        pass

    def micro_step_end(self, step: MicroStep) -> None:
        pass

    def micro_step_abort(self, step: MicroStep, error: BaseException) -> None:
        pass

    def iteration_end(self, stats: IterationStats) -> None:
        pass

    def transient_allocated(self) -> None:
        pass

    def host_copy(self, direction: CopyDirection, nbytes: int) -> None:
        pass


class ObserverHandle:
    """Returned by ``add_observer``; ``remove()`` detaches the observer (idempotent)."""

    def __init__(self, observers: "Observers", observer: StepObserver) -> None:
        self._observers, self.observer = observers, observer

    def remove(self) -> None:
        self._observers.discard(self.observer)


class Observers:
    """The runtime's list of observers and the dispatch of each point."""

    def __init__(self) -> None:
        self._list: list[StepObserver] = []
        # snapshots rebuilt on attach/detach, not per point: an observer may detach itself mid-dispatch
        self._in_order: tuple[StepObserver, ...] = ()
        self._in_reverse: tuple[StepObserver, ...] = ()

    def add(self, observer: StepObserver) -> ObserverHandle:
        if not isinstance(observer, StepObserver):
            raise TypeError(f"an observer must be a poplar StepObserver, got {type(observer).__name__}")
        if observer in self._list:
            raise ValueError(f"{type(observer).__name__} is already attached to this runtime")
        self._list.append(observer)
        self._snapshot()
        return ObserverHandle(self, observer)

    def discard(self, observer: StepObserver) -> None:
        if observer in self._list:
            self._list.remove(observer)
            self._snapshot()

    def __bool__(self) -> bool:
        return bool(self._list)

    def _snapshot(self) -> None:
        self._in_order, self._in_reverse = tuple(self._list), tuple(reversed(self._list))

    def _forward(self) -> tuple[StepObserver, ...]:
        return self._in_order

    def _backward(self) -> tuple[StepObserver, ...]:
        return self._in_reverse

    def iteration_start(self, iteration: int) -> None:
        for o in self._forward():
            o.iteration_start(iteration)

    def micro_step_start(self, step: MicroStep) -> None:
        for o in self._forward():
            o.micro_step_start(step)

    def forward_start(self, step: MicroStep) -> None:
        for o in self._forward():
            o.forward_start(step)

    def forward_end(self, step: MicroStep) -> None:
        for o in self._backward():
            o.forward_end(step)

    def backward_start(self, step: MicroStep, loss: torch.Tensor) -> None:
        for o in self._forward():
            o.backward_start(step, loss)

    def collectives_completing(self, step: MicroStep) -> None:
        for o in self._backward():
            o.collectives_completing(step)

    def backward_end(self, step: MicroStep) -> None:
        for o in self._backward():
            o.backward_end(step)

    def micro_step_end(self, step: MicroStep) -> None:
        for o in self._backward():
            o.micro_step_end(step)

    def micro_step_abort(self, step: MicroStep, error: BaseException) -> None:
        for o in self._backward():
            o.micro_step_abort(step, error)

    def iteration_end(self, stats: IterationStats) -> None:
        for o in self._backward():
            o.iteration_end(stats)

    def transient_allocated(self) -> None:
        for o in self._forward():
            o.transient_allocated()

    def host_copy(self, direction: CopyDirection, nbytes: int) -> None:
        for o in self._forward():
            o.host_copy(direction, nbytes)


TimelineEntry = tuple[int, int, float, float]  # (iteration, micro-step, start wall clock, seconds)


class MicroStepTimeline(StepObserver):
    """The last ``max_entries`` micro-steps' windows, from ``micro_step_start`` to ``micro_step_end``."""

    def __init__(self, max_entries: int = 8_192) -> None:
        self.entries: deque[TimelineEntry] = deque(maxlen=max_entries)
        self._t0 = 0.0

    def micro_step_start(self, step: MicroStep) -> None:
        self._t0 = time.perf_counter()

    def micro_step_end(self, step: MicroStep) -> None:
        dt = time.perf_counter() - self._t0
        self.entries.append((step.iteration, step.index, time.time() - dt, dt))

    def __iter__(self) -> Iterator[TimelineEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
