"""Emulated runs that must hold their speed: a bench's run is repeated with more headroom until
its devices kept to their curves (docs/design.md §4.5)."""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

from poplar.emulation.calibration import MARGIN
from poplar.emulation.speed_padding import LATE_BUDGET

T = TypeVar("T")


def until_on_time(name: str, attempts: int, run_once: Callable[[float], tuple[T, float]],
                  margin: float = MARGIN) -> tuple[T, float, int]:
    """A bench's emulated run, repeated until its devices held their speed: ``run_once(margin)``
    calibrates at ``margin``, runs, and returns (its result, its late-step fraction). Over
    ``LATE_BUDGET`` the run does not count and is made again with 0.7 x the margin (more
    headroom), ``attempts`` times at most. Returns the last (result, late fraction, attempts
    used); a late fraction still over the budget means the result is not valid."""
    for attempt in range(attempts):
        result, late = run_once(margin)
        if late <= LATE_BUDGET:
            break
        print(f"# {name}: {100 * late:.1f}% of micro-steps late (budget {100 * LATE_BUDGET:.0f}%): "
              + ("re-calibrating with margin %.2f" % (0.7 * margin) if attempt + 1 < attempts else "kept as INVALID"),
              file=sys.stderr, flush=True)
        margin *= 0.7
    return result, late, attempt + 1


