"""The record of every collective: op, bytes, phase, iteration, micro-step and seconds blocked.

The runtime says where it is (phase, micro-step, iteration) through ``CommLedger.scope`` and
``CommLedger.start_iteration``; every collective issued meanwhile is stamped with it. Seconds
are what the calling rank spent blocked, waiting for slower ranks included: the profiler
subtracts exactly this from compute time, and benchmarks read communication volume from it.

[Note: blocked time on a GPU]
On a GPU the host is not what waits: NCCL runs on a stream of its own, and a work's ``wait()``
only makes the compute stream wait for it. Timing on the host's clock needs a device-wide
synchronize around each collective, which also waits for the other collectives in flight and
keeps the host from queueing the next kernels: the collectives issued during backward then run
one after another instead of beside the compute. So on a GPU a collective's blocked time is the
compute stream's: a CUDA event recorded on it before the collective (or its wait) and one after,
their elapsed time read when the ledger is next read (every reader reads at a step's or
micro-step's end, once the compute stream has passed both events). On CPU it is the host's
clock, as the work is done by the waiting thread.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator, NamedTuple

import torch

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


# device spans kept unread at most: a training step reads them every micro-step, but a loop of
# collectives alone (evaluation gathers) may not read the ledger for a long time; past this many,
# adding one reads them all, which waits for the newest (one synchronize per MAX_UNREAD collectives)
MAX_UNREAD = 4096


class Blocked(NamedTuple):
    """Seconds a rank was blocked in a collective (Note: blocked time on a GPU): ``host_s`` on
    the host's clock, plus each CUDA event pair of ``spans`` (start, end) once it has elapsed."""

    host_s: float
    spans: tuple[tuple[Any, Any], ...] = ()

    def plus(self, other: "Blocked") -> "Blocked":
        return Blocked(self.host_s + other.host_s, self.spans + other.spans)


class BlockedTimer:
    """Starts timing a collective on ``device``'s clock (Note: blocked time on a GPU); ``stop()``
    gives the ``Blocked`` time since. ``issue_only``: the timer of an async collective's issue,
    which holds up no stream on a GPU (there it is 0, with no events recorded)."""

    def __init__(self, device: torch.device, issue_only: bool = False) -> None:
        self.on_gpu = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.stream = self.start = None  # on a GPU, the stream and start event of a timed span
        if self.on_gpu and not issue_only:
            self.stream = torch.cuda.current_stream(device)
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(self.stream)

    def stop(self) -> Blocked:
        if not self.on_gpu:
            return Blocked(time.perf_counter() - self.t0)
        if self.start is None:  # an async collective's issue
            return Blocked(0.0)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        return Blocked(0.0, ((self.start, end),))


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

    def __init__(self, max_records: int = 20_000, max_iterations: int = 1024, max_unread: int = MAX_UNREAD) -> None:
        self._records: deque[CommRecord] = deque(maxlen=max_records)
        self._total_seconds = 0.0
        self._per_iteration: OrderedDict[int, float] = OrderedDict()
        self._max_iterations = max_iterations
        self._position = LedgerPosition(Phase.SETUP, -1, 0)
        self._unread: list[tuple[CommRecord, tuple[tuple[Any, Any], ...]]] = []  # device spans not yet read
        self._max_unread = max_unread

    @property
    def records(self) -> deque[CommRecord]:
        self._read_spans()
        return self._records

    @property
    def total_seconds(self) -> float:
        """Seconds of every collective ever recorded."""
        self._read_spans()
        return self._total_seconds

    def _read_spans(self) -> None:
        """Add the device spans recorded since the last read to their records (Note: blocked time
        on a GPU); each waits, if it must, for its end event."""
        unread, self._unread = self._unread, []
        for record, spans in unread:
            seconds = 0.0
            for start, end in spans:
                end.synchronize()
                seconds += start.elapsed_time(end) / 1e3
            self._count(record, seconds)

    def _count(self, record: CommRecord, seconds: float, counted_s: float = 0.0) -> None:
        record.seconds += seconds
        self._total_seconds += seconds - counted_s
        if record.iteration in self._per_iteration:
            self._per_iteration[record.iteration] += seconds

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

    def count_issue(self, seconds: float) -> None:
        """An async collective's issue took ``seconds`` of the host: counted in ``total_seconds``
        now, when they are spent. Its record comes at its wait, perhaps in a later micro-step or
        in the step, and a window's blocked seconds (``total_seconds`` read at its start and end,
        as compute is measured) must be those spent inside it; the record then passes the same
        seconds as ``counted_s`` so they count once."""
        self._total_seconds += seconds

    def add(self, op: str, nbytes: int, seconds: float | Blocked, tag: str = "", link: Link = Link.FLAT,
            counted_s: float = 0.0) -> None:
        """Record a collective at the current position; ``seconds`` blocked, or a ``Blocked``
        whose device spans are read later (Note: blocked time on a GPU). ``counted_s`` of them
        are already in ``total_seconds`` (``count_issue``)."""
        p = self._position
        blocked = seconds if isinstance(seconds, Blocked) else Blocked(seconds)
        if p.iteration not in self._per_iteration:
            self._per_iteration[p.iteration] = 0.0
            if len(self._per_iteration) > self._max_iterations:
                self._per_iteration.popitem(last=False)
        record = CommRecord(op, nbytes, p.phase.value, p.iteration, p.micro_step, 0.0, tag,
                            time.time() - blocked.host_s, link)
        self._count(record, blocked.host_s, counted_s)
        self._records.append(record)
        if blocked.spans:
            self._unread.append((record, blocked.spans))
            if len(self._unread) > self._max_unread:  # nobody reads (collectives outside training steps)
                self._read_spans()

    def clear(self) -> None:
        self._read_spans()  # they still count in total_seconds
        self._records.clear()
        self._per_iteration.clear()

    def of(self, iteration: int | None = None, op: str | None = None, phase: str | None = None,
           micro_step: int | None = None) -> list[CommRecord]:
        """Records matching all the given filters."""
        return [r for r in self.records
                if (iteration is None or r.iteration == iteration) and (op is None or r.op == op)
                and (phase is None or r.phase == phase) and (micro_step is None or r.micro_step == micro_step)]

    def seconds(self, **filters: Any) -> float:
        """Seconds of the records matching ``filters`` (as ``of``)."""
        self._read_spans()
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
