"""A reference for emulated times, measured in the same test, under the same load.

A virtual device pads a micro-step to its curve and a virtual link holds a collective for its
time, both by sleeping until a deadline (``sleep_until``): neither can end early, so an emulated
time is bounded below exactly. Above, a busy machine adds what it adds to any sleep, a late
wake-up and the work after it, and how much moves with the other jobs on the machine. So a test
bounds an emulated time above by the emulated time, the margin it allowed on a quiet machine,
and the latest wake-up of bare ``sleep_until`` calls taken by the same process right beside the
timed steps (between them, or just before and after a profile). On a quiet machine that lateness
is a fraction of a millisecond and the bound is the quiet one; on a busy one it grows with what
the machine does to a sleep at that moment, not with a guess.
"""

from __future__ import annotations

import time

from poplar.emulation.speed_padding import sleep_until


def sleep_lateness(seconds: float) -> float:
    """How late one ``sleep_until`` of ``seconds`` wakes up, now, in this process."""
    deadline = time.perf_counter() + seconds
    sleep_until(deadline)
    return time.perf_counter() - deadline


def latest_wake_up(seconds: float, count: int = 5) -> float:
    """The latest of ``count`` wake-ups of ``sleep_lateness(seconds)`` in a row."""
    return max(sleep_lateness(seconds) for _ in range(count))
