"""A virtual link: the interconnect of an emulated cluster, with a known speed, paced like a
virtual device's compute (docs/design.md §4.7).

Between processes sharing a few CPU cores, a gloo collective takes as long as the scheduler
lets it: on a 2-core machine a 4-rank all-reduce of a few hundred KB lasts 3-8 ms and an 8-rank
one 20-30 ms, with a long tail, and the spread moves with the machine's load from one minute to
the next. Collectives then set the emulated cluster's speed, not its GPUs. A ``VirtualLink``
gives the cluster a link of known speed instead: a collective of ``nbytes`` takes

    latency_s + bus volume / bandwidth   (ring: 2 (N-1)/N nbytes for an all-reduce, (N-1)/N for
                                          a reduce-scatter or an all-gather; the profiler's fit)

from the moment the last rank issued it, and the link carries one collective at a time (a
collective starts when the one before it ended). Each rank writes the moment it issues a
collective into a shared board (a file mapped by every process of the machine: ``LinkBoard``),
one row per collective, counted in issue order. When the real collective is done on a rank,
every rank has issued it and all before it, so the rank reads their rows, computes when the
link would have finished it, and sleeps until then (``Communicator.observed`` calls it there, so
the ledger's blocked seconds are the link's). A collective can be done on a rank before every
rank issued it: an uneven all-gather run as broadcasts has no sender on a rank whose part is
empty (shard weight 0), so a receiver is done once the senders are. The rank then waits on the
board until the others have issued it (``LinkSpec.issue_wait_s`` at most), as a GPU collective
would. A collective whose real gloo time overshoots the link's is *late* (``late_collectives``
of ``paced_collectives``), as a late micro-step is.

Every rank sees the same rows and computes the same ends: the ranks leave a collective together,
as on a GPU cluster. Calibration picks a link slow enough for the real collectives to fit
(``link_calibration.measure_link``).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from poplar.planner.cost_model import bus_bytes
from poplar.types.topology import Wire


SLOTS = 1 << 14  # rows of the board: far more than the collectives a rank can issue ahead of another
LATE_TOLERANCE_S = 5e-4  # a real collective this much past the link's end is late
# how long a rank done with a collective waits by default for another rank to issue it (a rank
# with an empty part computing its micro-step meanwhile) before the order is called wrong: far
# past any emulated micro-step, within the collective timeouts the tests and benches give
ISSUE_WAIT_S = 120.0


class Clock:
    """The clock a link paces by: ``now`` (``time.perf_counter``) and ``sleep``. Tests give a
    manual one to check the link's arithmetic exactly, with no real waiting."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


REAL_CLOCK = Clock()


class LinkError(RuntimeError):
    """The ranks' paced collectives disagree (a rank issued one the others did not)."""


@dataclass(frozen=True)
class LinkSpec:
    """The emulated link and the board its ranks share (a path: the spec pickles to every rank)."""

    latency_s: float
    bandwidth_bytes_per_s: float
    world_size: int
    board_path: str
    issue_wait_s: float = ISSUE_WAIT_S  # a rank done with a collective waits this long for the others' issue

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {self.latency_s} s and "
                             f"{self.bandwidth_bytes_per_s} B/s")
        if self.world_size < 1:
            raise ValueError(f"a link needs a world size >= 1, got {self.world_size}")

    @classmethod
    def create(cls, latency_s: float, bandwidth_bytes_per_s: float, world_size: int,
               directory: str | None = None) -> "LinkSpec":
        """A link with a fresh, zeroed board file (in /dev/shm where there is one); the caller
        removes it with ``remove`` when the cluster is done."""
        directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        fd, path = tempfile.mkstemp(prefix="poplar-link-", suffix=".board", dir=directory)
        os.close(fd)
        spec = cls(float(latency_s), float(bandwidth_bytes_per_s), world_size, path)
        board = np.memmap(path, dtype=np.float64, mode="w+", shape=(SLOTS, world_size, 2))
        board.flush()
        del board
        return spec

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.board_path)

    def seconds(self, op: str, nbytes: int) -> float:
        """How long the link takes for one collective of ``nbytes`` (the full buffer)."""
        return self.latency_s + bus_bytes(op, nbytes, self.world_size) / self.bandwidth_bytes_per_s

    def describe(self) -> str:
        return f"link {1e3 * self.latency_s:.2f} ms + {self.bandwidth_bytes_per_s / 1e9:.3g} GB/s"


@dataclass
class _Ticket:
    index: int
    seconds: float
    end: float | None = None


class VirtualLink:
    """One rank's end of a ``LinkSpec`` (a ``CollectiveObserver`` for ``Communicator.observed``)."""

    def __init__(self, spec: LinkSpec, rank: int, *, record: bool = False, clock: Clock = REAL_CLOCK) -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} outside a link of {spec.world_size} ranks")
        self.spec, self.rank, self.clock = spec, rank, clock
        # with ``record``: per collective, the real seconds from the link's start to the real end
        self.real_seconds: list[float] | None = [] if record else None
        self.issued_count = 0
        self.paced_collectives = 0
        self.late_collectives = 0
        self._board: np.memmap | None = None
        self._open: deque[_Ticket] = deque()  # issued, end not yet computed, in issue order
        self._free = 0.0  # when the link finished the last collective it computed

    def __getstate__(self) -> dict[str, Any]:  # the board is mapped again in the process that unpickles
        return {**self.__dict__, "_board": None}

    def board(self) -> np.memmap:
        if self._board is None:
            self._board = np.memmap(self.spec.board_path, dtype=np.float64, mode="r+",
                                    shape=(SLOTS, self.spec.world_size, 2))
        return self._board

    def issued(self, op: str, nbytes: int, wire: Wire) -> _Ticket:
        ticket = _Ticket(self.issued_count, self.spec.seconds(op, nbytes))
        self.board()[ticket.index % SLOTS, self.rank] = (ticket.index + 1, self.clock.now())
        self.issued_count += 1
        self._open.append(ticket)
        return ticket

    def done(self, ticket: _Ticket) -> None:
        """Sleep until the link would have finished ``ticket``'s collective (its real one is done)."""
        real_end = self.clock.now()
        while ticket.end is None:
            self._compute_end(self._open.popleft())
        self.paced_collectives += 1
        if self.real_seconds is not None:
            self.real_seconds.append(real_end - (ticket.end - ticket.seconds))
        if real_end > ticket.end + LATE_TOLERANCE_S:
            self.late_collectives += 1
        # a plain sleep, no spin to the exact moment: every rank wakes here at once, and ranks
        # spinning together would take the cores the others' compute needs
        remaining = ticket.end - self.clock.now()
        if remaining > 0:
            self.clock.sleep(remaining)

    def _compute_end(self, ticket: _Ticket) -> None:
        row = np.array(self.board()[ticket.index % SLOTS])
        if not (row[:, 0] == ticket.index + 1).all():  # a rank without a part to send has not issued it yet
            waited_until = self.clock.now() + self.spec.issue_wait_s
            while not (row[:, 0] == ticket.index + 1).all() and self.clock.now() < waited_until:
                self.clock.sleep(2e-4)
                row = np.array(self.board()[ticket.index % SLOTS])
        if not (row[:, 0] == ticket.index + 1).all():
            behind = [r for r in range(self.spec.world_size) if row[r, 0] != ticket.index + 1]
            raise LinkError(f"rank {self.rank}: paced collective #{ticket.index} was not issued on ranks {behind} "
                            "(every rank must run the same collectives on the paced link, in the same order)")
        start = max(float(row[:, 1].max()), self._free)
        ticket.end = self._free = start + ticket.seconds
