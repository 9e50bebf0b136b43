"""A capacity search guided by a memory model: few trial steps when the model is right, the
exact answer whatever it says.

A step's peak memory grows with the batch as a convex, piecewise linear function (model states
and stage buffers are constant; saved activations grow linearly, and the peak is the largest of
a few such lines over the step). ``PeakModel`` is a line through one measured point (a step that
fitted: its peak; a step that did not: the usage when the device gave up, a lower bound of its
peak). Its answer, the largest batch whose line stays within the capacity, is the next trial;
every trial moves the line's point to the newest measurement. With activation memory known
from another configuration of the same model (it does not depend on the ZeRO stage) the first
guess is usually ``mbs`` itself, and two trials (``mbs`` fits, ``mbs + 1`` does not) settle it.

``guided_mbs`` only ever narrows a bracket (largest batch known to fit, smallest known not to),
so with a monotone trial the result is the same as ``capacity.search_mbs``'s. After
``GUIDED_TRIALS`` guesses (or whenever there is no model) it continues without one: doubling
up from the largest fit, halving the distance down from the smallest failure, then bisection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

GUIDED_TRIALS = 3  # model-guided trials before the search goes on without the model


@dataclass(frozen=True)
class PeakModel:
    """Peak bytes of a step of ``b`` samples: ``bytes + slope * (b - batch)``."""

    batch: int
    bytes: float
    slope: float  # bytes per sample (> 0)

    def largest(self, capacity: float) -> int:
        """The largest batch whose predicted peak is within ``capacity`` (may be < 1)."""
        return self.batch + math.floor((capacity - self.bytes) / self.slope)

    def shifted(self, delta: float) -> "PeakModel":
        """The same line ``delta`` bytes higher (another stage's model states)."""
        return PeakModel(self.batch, self.bytes + delta, self.slope)

    def moved(self, batch: int, nbytes: float) -> "PeakModel":
        """The same slope through a new measured point."""
        return PeakModel(batch, nbytes, self.slope)


def peak_model(peaks: dict[int, int], slope: float | None = None) -> PeakModel | None:
    """A line through the largest measured peak, with the secant of the two largest as its slope
    (``slope`` when there is only one point): by convexity the secant does not overestimate the
    growth beyond them, so the line's answer is not below the true one."""
    if not peaks:
        return None
    xs = sorted(peaks)
    top = xs[-1]
    if len(xs) >= 2:
        prev = xs[-2]
        slope = (peaks[top] - peaks[prev]) / (top - prev)
    if slope is None or slope <= 0:
        return None
    return PeakModel(top, float(peaks[top]), float(slope))


def guided_mbs(trial: Callable[[int], bool], guess: Callable[[], int | None], max_batch: int, *,
               lo: int = 0, hi: int | None = None, guided: int = GUIDED_TRIALS) -> int:
    """Largest batch in [0, max_batch] for which the monotone ``trial`` holds, given that ``lo``
    fits (0: nothing known) and ``hi`` (if given) does not. ``guess()`` is the model's next
    batch after the trials so far (None: no model)."""
    tries, down = 0, 1
    while hi is None or hi - lo > 1:
        if lo >= max_batch:
            return lo
        g = guess() if tries < guided else None
        tries += 1
        if g is None:
            if hi is None:
                b = max(1, 2 * lo)
            elif lo == 0:
                b, down = hi - down, 2 * down  # nothing fits yet: step down, doubling the step
            else:
                b = (lo + hi) // 2
        else:
            b = g
        b = max(b, lo + 1)
        b = min(b, max_batch if hi is None else hi - 1)
        if trial(b):
            lo = b
        else:
            hi = b
    return lo
