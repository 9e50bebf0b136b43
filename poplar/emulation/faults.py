"""Injected drift for tests and benches: a virtual device that slows down, recovers, or loses
memory while training (docs/design.md §10).

A ``FaultSchedule`` is plain data set on a ``VirtualDevice`` (``device.faults``, or
``EmulatedCluster(..., faults={rank: schedule})``). Its clock is the iteration of the runtime
the device is attached to, so it follows training (``fit`` continues the engine's count) and
never fires while the device is detached:

- speed: from iteration ``slow_from`` until ``slow_until`` (exclusive; None = for good) every
  micro-step lasts ``slow_factor`` times the device's curve;
- memory: from iteration ``memory_from`` the capacity is ``memory_factor`` times its own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol


class _Clocked(Protocol):
    iteration: int


@dataclass(frozen=True)
class FaultSchedule:
    """When and how much a virtual device drifts (see the module doc)."""

    slow_factor: float = 1.0
    slow_from: int | None = None
    slow_until: int | None = None
    memory_factor: float = 1.0
    memory_from: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.slow_factor) and self.slow_factor > 0):
            raise ValueError(f"slow_factor must be a finite number > 0 (2.0 = twice as slow), got {self.slow_factor}")
        if not (0 < self.memory_factor <= 1):
            raise ValueError(f"memory_factor must be in (0, 1] (the share of the capacity left), got "
                             f"{self.memory_factor}")
        for name in ("slow_from", "slow_until", "memory_from"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an iteration (int >= 0) or None, got {value!r}")
        if self.slow_until is not None and (self.slow_from is None or self.slow_until <= self.slow_from):
            raise ValueError(f"slow_until ({self.slow_until}) needs slow_from before it, got slow_from="
                             f"{self.slow_from}")

    def slow_at(self, iteration: int | None) -> float:
        """The time factor at ``iteration`` (1.0 outside the slow window or without a clock)."""
        if iteration is None or self.slow_from is None or iteration < self.slow_from:
            return 1.0
        if self.slow_until is not None and iteration >= self.slow_until:
            return 1.0
        return self.slow_factor

    def capacity_at(self, capacity: int, iteration: int | None) -> int:
        """``capacity`` as it is at ``iteration``."""
        if iteration is None or self.memory_from is None or iteration < self.memory_from:
            return capacity
        return int(capacity * self.memory_factor)

    def time_factor(self, runtime: _Clocked | None) -> float:
        """The time factor now, for a device attached to ``runtime`` (None: detached)."""
        return self.slow_at(runtime.iteration if runtime is not None else None)

    def capacity(self, capacity: int, runtime: _Clocked | None) -> int:
        """The capacity now, for a device attached to ``runtime`` (None: detached)."""
        return self.capacity_at(capacity, runtime.iteration if runtime is not None else None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FaultSchedule":
        return cls(**d)
