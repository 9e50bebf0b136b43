"""How a planned step's lead prices the profile's led exposure: the constants of the profiler's led
rounds and ``lead_change``, shared by the profiler (which measures at these leads) and the cost
model (which interpolates between them)."""

from __future__ import annotations

from typing import Any

import numpy as np

# A timing round whose slowest rank leads the next by this fraction of its compute or more counts
# as led (``poplar.profiler.exposure``): its collectives found the others waiting. Chosen on the
# CPU emulator (docs/experiments.md); it only sorts grid rounds (a probe's balanced rounds, the
# switch's led ones): a planned step's lead is priced by ``lead_change`` instead.
LEAD_SCALE = 0.1
# The lead of the profiler's steady led rounds: one device type at the balanced compute, the
# others at half of it. A lock-step micro-step (an iteration's end) whose slowest device type
# leads the next by this fraction or more exposes its ``LedExposure.micro_step_s``
# (``LedExposure.iteration_s``); with every rank finishing together, ``Exposure.micro_step_s``
# (``Exposure.iteration_s``); in between, as ``lead_change`` says, because the change grows with
# the lead rather than arriving in full at a small one. Tuned on the CPU emulator
# (docs/experiments.md); the profiler does not measure the led rounds' lead, it sets it.
LED_ROUNDS_LEAD = 0.5
# The lead of the profiler's small led rounds (the others at 85 % of the leader), where it
# measures how the change grows with the lead: a lone leader takes most of it early, several
# leaders more gradually, so one straight line to ``LED_ROUNDS_LEAD`` cannot fit both
# (``lead_change``). Chosen on the CPU emulator; the lead those rounds actually ran at is
# measured (``LedExposure.small_lead``), and the cost model uses the measured one.
SMALL_LEAD = 0.15


def lead_change(lead: Any, change: Any, small_lead: Any = None, small_change: Any = None) -> Any:
    """What of the led exposure ``change`` (measured at ``LED_ROUNDS_LEAD``) a step led by
    ``lead`` pays: piecewise linear through 0 at no lead, ``small_change`` at the measured
    ``small_lead`` and ``change`` from ``LED_ROUNDS_LEAD`` on; a straight line from 0 where the
    small lead is absent (None or NaN) or outside (0, ``LED_ROUNDS_LEAD``). The change grows
    with the lead and saturates, so a small change measured past the full one (or of the other
    sign) is noise and is held to it (between 0 and ``change``). Numbers or arrays."""
    lead = np.asarray(lead, dtype=float)
    change = np.asarray(change, dtype=float)
    if small_lead is None:
        return change * np.minimum(1.0, lead / LED_ROUNDS_LEAD)
    at = np.asarray(small_lead, dtype=float)
    usable = (at > 0) & (at < LED_ROUNDS_LEAD)  # False for NaN
    at = np.where(usable, at, LED_ROUNDS_LEAD / 2)
    small = np.clip(small_change, np.minimum(0.0, change), np.maximum(0.0, change))
    small = np.where(usable, small, change / 2)  # on the straight line
    below = small * lead / at
    above = small + (change - small) * np.minimum(1.0, (lead - at) / (LED_ROUNDS_LEAD - at))
    return np.where(lead < at, below, above)
