"""A record of recent micro-steps (iteration, micro-step, wall-clock start, seconds), kept by an
observer of the step; the training loop's trace is drawn from it."""

from __future__ import annotations

import time
from collections import deque
from typing import Iterator

from poplar.zero.observers import MicroStep, StepObserver

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
