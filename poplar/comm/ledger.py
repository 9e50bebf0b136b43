"""The record of every collective: op, bytes, phase, iteration, micro-step and seconds blocked.

The runtime says where it is (phase, micro-step, iteration) through ``CommLedger.scope`` and
``CommLedger.start_iteration``; every collective issued meanwhile is stamped with it. Seconds
are what the calling rank spent blocked, waiting for slower ranks included: the profiler
subtracts exactly this from compute time, and benchmarks read communication volume from it.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator

from poplar.types.topology import Link


class Phase(str, Enum):
    """Where in a training step a collective was issued (compares equal to its value string)."""

    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"
    EVAL = "eval"
    STATE = "state"

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class CommRecord:
    op: str
    bytes: int
    phase: str
    iteration: int
    micro_step: int
    seconds: float
    tag: str = ""
    start: float = 0.0  # wall clock (time.time()) when the rank entered the collective
    link: Link = Link.FLAT  # the link it used (``poplar.types.topology``)


@dataclass(frozen=True)
class LedgerPosition:
    """A point of the step: what the ledger stamps on the collectives issued there."""

    phase: Phase
    micro_step: int
    iteration: int


class CommLedger:
    """Every collective, stamped with the position the runtime set.

    Only the latest ``max_records`` records are kept (a few MB; the trace report draws them), so a
    long run's memory stays flat once the window is full;
    ``total_seconds`` counts every collective ever recorded, and the seconds of each of the last
    ``max_iterations`` iterations are kept as running totals (``seconds(iteration=i)`` is O(1)).
    """

    def __init__(self, max_records: int = 20_000, max_iterations: int = 1024) -> None:
        self.records: deque[CommRecord] = deque(maxlen=max_records)
        self.total_seconds = 0.0
        self._per_iteration: OrderedDict[int, float] = OrderedDict()
        self._max_iterations = max_iterations
        self._position = LedgerPosition(Phase.SETUP, -1, 0)

    @property
    def position(self) -> LedgerPosition:
        return self._position

    @property
    def phase(self) -> Phase:
        return self._position.phase

    @property
    def micro_step(self) -> int:
        return self._position.micro_step

    @property
    def iteration(self) -> int:
        return self._position.iteration

    @contextlib.contextmanager
    def scope(self, phase: Phase | None = None, micro_step: int | None = None) -> Iterator[None]:
        """Stamp collectives issued inside the block with ``phase`` / ``micro_step`` (the ones
        given); the previous position comes back when the block ends."""
        saved = self._position
        self._position = LedgerPosition(saved.phase if phase is None else phase,
                                        saved.micro_step if micro_step is None else micro_step, saved.iteration)
        try:
            yield
        finally:
            self._position = LedgerPosition(saved.phase, saved.micro_step, self._position.iteration)

    @contextlib.contextmanager
    def at(self, position: LedgerPosition) -> Iterator[None]:
        """Stamp the block's collectives with an earlier ``position`` (an async collective that
        completes later is recorded where it was issued)."""
        saved, self._position = self._position, position
        try:
            yield
        finally:
            self._position = saved

    def start_iteration(self, iteration: int) -> None:
        """The runtime begins ``iteration``: collectives from now on carry its number."""
        self._position = LedgerPosition(self._position.phase, 0, iteration)

    def add(self, op: str, nbytes: int, seconds: float, tag: str = "", link: Link = Link.FLAT) -> None:
        p = self._position
        self.total_seconds += seconds
        if p.iteration not in self._per_iteration:
            self._per_iteration[p.iteration] = 0.0
            if len(self._per_iteration) > self._max_iterations:
                self._per_iteration.popitem(last=False)
        self._per_iteration[p.iteration] += seconds
        self.records.append(CommRecord(op, nbytes, p.phase.value, p.iteration, p.micro_step, seconds, tag,
                                       time.time() - seconds, link))

    def clear(self) -> None:
        self.records.clear()
        self._per_iteration.clear()

    def of(self, iteration: int | None = None, op: str | None = None, phase: str | None = None,
           micro_step: int | None = None) -> list[CommRecord]:
        """Records matching all the given filters."""
        return [r for r in self.records
                if (iteration is None or r.iteration == iteration) and (op is None or r.op == op)
                and (phase is None or r.phase == phase) and (micro_step is None or r.micro_step == micro_step)]

    def seconds(self, **filters: Any) -> float:
        """Seconds of the records matching ``filters`` (as ``of``)."""
        if filters.keys() == {"iteration"} and filters["iteration"] in self._per_iteration:
            return self._per_iteration[filters["iteration"]]
        return sum(r.seconds for r in self.of(**filters))

    def summary(self, iteration: int | None = None) -> dict[str, dict[str, float]]:
        """Per op: count, bytes and seconds (of one iteration, or of all)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0, "seconds": 0.0})
        for r in self.of(iteration=iteration):
            s = out[r.op]
            s["count"] += 1
            s["bytes"] += r.bytes
            s["seconds"] += r.seconds
        return dict(out)

    def table(self, iteration: int | None = None) -> str:
        lines = [f"{'op':<16} {'count':>6} {'MB':>10} {'seconds':>9}"]
        for op, s in sorted(self.summary(iteration).items()):
            lines.append(f"{op:<16} {int(s['count']):>6} {s['bytes'] / 1e6:>10.3f} {s['seconds']:>9.4f}")
        return "\n".join(lines)
