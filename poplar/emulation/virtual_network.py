"""A virtual network: the interconnect of an emulated cluster that spans machines, with known
speeds, paced like a virtual device's compute (docs/design.md §4.7).

A ``VirtualLink`` is one link that every collective crosses. A cluster of several nodes has
several: each node its own intra-node link (NVLink, PCIe), and one cross-node link (InfiniBand,
Ethernet) shared by all nodes. ``NetworkSpec`` holds one ``LinkSpeed`` (the profile's type: a
latency and a bandwidth) per node and one for the cross-node link; ``VirtualNetwork`` is a
rank's end of it, a ``CollectiveObserver`` like the virtual link. The ``Wire`` a collective is
issued on (``poplar.types.topology``) says which links it crosses and for how long
(``NetworkSpec.price``):

- an INTRA collective on node k (or a FLAT one whose ranks are all on node k) crosses node k's
  link only: ``latency + ring bus volume / bandwidth`` of that link over the wire's ranks, as a
  ``VirtualLink`` prices it. Collectives on different nodes use different links and overlap.
- a FLAT collective over ranks of several nodes is one ring that crosses the node boundaries:
  every hop carries the ring's bus volume at once, so the slowest link it has hops on paces it
  (in practice the cross-node link; the intra-node hops run in parallel). It occupies the
  cross-node link and the link of every node it has ranks on.
- a CROSS exchange (op ``"exchange"``, ``nbytes`` = the node count times the bytes through the
  busiest node's port) occupies the cross-node link; see [Note: a node's network port] for its time. A ring
  collective on a CROSS wire (an all-reduce over one rank per node, as the profiler measures
  the cross-node link) is priced as the flat ring it is.

[Note: a node's network port]
Each node reaches the others through its own port (a NIC into a switch), full duplex at the
cross-node link's bandwidth: a node can send at that rate while it receives at that rate, and
nodes do not slow each other down in a non-blocking switch. The time of an exchange is then set
by the busiest port: ``latency + max over nodes of (bytes the node sends or receives) /
bandwidth``. The communicator tells the observer the node count times that busiest port's bytes
(``hierarchical.NodeLayout.busiest_port_elements``), so ``latency + nbytes / (nodes x
bandwidth)`` is that time, exact for uneven node shares too. The same port model prices the flat ring above: a ring's boundary hops run in opposite directions, so
every port sends and receives the ring's bus volume at once, one bus volume / bandwidth in all;
a "shared pipe" model (every node's bytes through one link of that bandwidth, total /
bandwidth) would charge a ring twice its bus volume and a 2-node exchange twice its port time.
The planner prices the same port (``planner/link_pricing.py``, the busiest node by its share),
so the two agree for any shares.

Each link carries one collective at a time, in the order the collectives became ready (the
moment their last rank issued them): a collective starts at ``max(ready, every link it occupies
free)``, and holds those links until its end.

How ranks agree without talking. The board (a file every process of the machine maps) keeps
one row sequence per wire (the same ranks on the same link: a process group, in which every
rank issues collectives in the same order). A rank's k-th collective on a wire is row k of that
wire (the count is kept on the board, so a rank's end made anew carries on from the last
one's); it marks itself there under a file lock and keeps the latest issue time. The rank that
completes a row (its last rank) computes the collective's start and end from the links' free
times, kept on the board, and writes them: that happens under the lock, so every collective's
time is computed once, in the order the collectives became ready, and every rank reads the same
end. A rank whose real collective is done reads its row's end (waiting up to ``issue_wait_s``
for a rank that has not issued it yet, as a ``VirtualLink`` does, then ``LinkError``: no hang)
and sleeps until then. A wire of one rank carries nothing and is not paced.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import numpy as np

from poplar.emulation.virtual_link import (ISSUE_WAIT_S, LATE_TOLERANCE_S, REAL_CLOCK, Clock, LinkError, LinkSpec,
                                           VirtualLink)
from poplar.planner.cost_model import bus_bytes
from poplar.types.profiles import LinkSpeed
from poplar.types.topology import Link, Topology, Wire

MAX_WIRES = 32  # distinct wires (rank sets on a link) a job may pace: its process groups
DEPTH = 1024  # rows per wire: far more than the collectives a rank issues ahead of another on one wire
MAX_RANKS = 62  # ranks are bits of an int64 mask
WIRE_CODES = {Link.FLAT: 1, Link.INTRA: 2, Link.CROSS: 3}
OP_CODES = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "exchange": 4}  # others: 0, not compared
ROW = np.dtype([("seq", "i8"), ("op", "i8"), ("joined", "i8"), ("left", "i8"), ("nbytes", "i8"),
                ("ready", "f8"), ("start", "f8"), ("end", "f8")])


def link_seconds(link: LinkSpeed, bus: float) -> float:
    """One collective's time on ``link``: ``latency + bus bytes / bandwidth``."""
    return link.latency_s + bus / link.bandwidth_bytes_per_s


def describe_link(link: LinkSpeed) -> str:
    return f"{1e3 * link.latency_s:.2f} ms + {link.bandwidth_bytes_per_s / 1e6:.4g} MB/s"


class Pricing(NamedTuple):
    """How long a collective holds the network, and the links it holds (node k's is k, the
    cross-node link is the node count)."""

    seconds: float
    links: tuple[int, ...]


@dataclass(frozen=True)
class NetworkSpec:
    """The emulated network of a cluster and the board its ranks share (a path: the spec
    pickles to every rank). ``intra[k]`` is node k's link; ``cross`` the link between nodes
    (None for a single node)."""

    topology: Topology
    intra: tuple[LinkSpeed, ...]
    cross: LinkSpeed | None
    board_path: str
    issue_wait_s: float = ISSUE_WAIT_S  # a rank done with a collective waits this long for the others' issue

    def __post_init__(self) -> None:
        object.__setattr__(self, "intra", tuple(self.intra))  # frozen: a list given is kept as a tuple
        if len(self.intra) != self.topology.node_count:
            raise ValueError(f"a network of {self.topology.describe()} needs one intra-node link per node, "
                             f"got {len(self.intra)}")
        if self.topology.spans_nodes and self.cross is None:
            raise ValueError(f"a network of {self.topology.describe()} needs a cross-node link")
        for link in self.intra + ((self.cross,) if self.cross is not None else ()):
            if not link.latency_s >= 0 or not link.bandwidth_bytes_per_s > 0:
                raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {link.latency_s} s and "
                                 f"{link.bandwidth_bytes_per_s} B/s")
        if self.topology.world_size > MAX_RANKS:
            raise ValueError(f"a virtual network joins at most {MAX_RANKS} ranks, got {self.topology.world_size}")

    @classmethod
    def create(cls, topology: Topology, intra: tuple[LinkSpeed, ...] | list[LinkSpeed], cross: LinkSpeed | None,
               directory: str | None = None, issue_wait_s: float = ISSUE_WAIT_S) -> "NetworkSpec":
        """A network with a fresh, zeroed board file (in /dev/shm where there is one); the
        caller removes it with ``remove`` when the cluster is done."""
        directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        fd, path = tempfile.mkstemp(prefix="poplar-network-", suffix=".board", dir=directory)
        try:
            spec = cls(topology, tuple(intra), cross, path, issue_wait_s)
            os.ftruncate(fd, _Board.size(spec.link_count))
        except BaseException:
            os.close(fd)
            os.remove(path)
            raise
        os.close(fd)
        return spec

    @classmethod
    def single(cls, link: LinkSpec, directory: str | None = None) -> "NetworkSpec":
        """A network of one node whose link is ``link``'s, with its own fresh board."""
        return cls.create(Topology.single(link.world_size), (LinkSpeed(link.bandwidth_bytes_per_s, link.latency_s),),
                          None, directory, link.issue_wait_s)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.board_path)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def link_count(self) -> int:
        """Node links 0..K-1, then the cross-node link (K)."""
        return self.topology.node_count + 1

    def speed(self, link: int) -> LinkSpeed:
        if link == self.topology.node_count:
            assert self.cross is not None
            return self.cross
        return self.intra[link]

    def price(self, op: str, nbytes: int, wire: Wire) -> Pricing:
        """The seconds and links of one collective (module doc); ``LinkError`` for a wire the
        topology cannot carry (the same on every rank of the wire, so none waits for another)."""
        counts: dict[int, int] = {}
        for r in wire.ranks:
            if not 0 <= r < self.world_size:
                raise LinkError(f"wire {wire.link} on ranks {list(wire.ranks)}: rank {r} is outside the "
                                f"network's {self.world_size} ranks ({self.topology.describe()})")
            node = self.topology.node_of(r)
            counts[node] = counts.get(node, 0) + 1
        n, cross = len(wire.ranks), self.topology.node_count
        if n < 2:
            return Pricing(0.0, ())
        if wire.link is Link.CROSS and len(counts) < 2:
            raise LinkError(f"a cross-node collective on ranks {list(wire.ranks)} of one node "
                            f"({self.topology.describe()}): run it as an intra-node collective")
        if wire.link is Link.CROSS and op == "exchange":
            return Pricing(link_seconds(self.speed(cross), nbytes / len(counts)), (cross,))
        if len(counts) == 1:
            (node,) = counts
            return Pricing(link_seconds(self.intra[node], bus_bytes(op, nbytes, n)), (node,))
        if wire.link is Link.INTRA:  # a ring on a CROSS wire (one rank per node, say) is priced as below
            raise LinkError(f"an intra-node collective on ranks {list(wire.ranks)} spans nodes "
                            f"{sorted(counts)} of {self.topology.describe()}: give it a FLAT or CROSS wire")
        bus = bus_bytes(op, nbytes, n)
        hops = [cross] + [k for k, c in counts.items() if c > 1]  # a node with one of the ring's ranks has no intra hop
        return Pricing(max(link_seconds(self.speed(k), bus) for k in hops), tuple(sorted(counts)) + (cross,))

    def describe(self) -> str:
        nodes = ", ".join(f"node {k} {describe_link(s)}" for k, s in enumerate(self.intra))
        return f"network {self.topology.describe()}: {nodes}" + (
            f"; cross-node {describe_link(self.cross)}" if self.cross is not None else "")


class _Board:
    """The shared file: link free times, the wires' keys, and every wire's rows."""

    def __init__(self, path: str, links: int) -> None:
        self.file = open(path, "r+b")  # noqa: SIM115 - held for the process's life, closed with it
        self.map = mmap.mmap(self.file.fileno(), self.size(links))
        self.free = np.ndarray((links,), np.float64, self.map, 0)  # when each link finished its last collective
        offset = 8 * links
        self.keys = np.ndarray((MAX_WIRES + 1, 2), np.int64, self.map, offset)  # row 0: [wires registered, 0]
        offset += 16 * (MAX_WIRES + 1)
        # collectives each rank issued on each wire: on the board, so a rank's end made anew (a
        # second runtime of the same job) goes on from where the rank's last one stopped
        self.issued = np.ndarray((MAX_WIRES, MAX_RANKS), np.int64, self.map, offset)
        offset += 8 * MAX_WIRES * MAX_RANKS
        self.rows = np.ndarray((MAX_WIRES, DEPTH), ROW, self.map, offset)

    @staticmethod
    def size(links: int) -> int:
        return 8 * links + 16 * (MAX_WIRES + 1) + 8 * MAX_WIRES * MAX_RANKS + ROW.itemsize * MAX_WIRES * DEPTH

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self.file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.file, fcntl.LOCK_UN)


@dataclass
class _Ticket:
    wire: Wire
    op: str
    pricing: Pricing
    wire_id: int = -1  # -1: a wire of one rank, nothing to carry
    seq: int = 0
    start: float = 0.0
    end: float | None = None


class VirtualNetwork:
    """One rank's end of a ``NetworkSpec`` (a ``CollectiveObserver`` for ``Communicator.observed``),
    counting like a ``VirtualLink``: ``paced_collectives``, ``late_collectives``, and with
    ``record`` the real seconds of every collective from its start on the network."""

    def __init__(self, spec: NetworkSpec, rank: int, *, record: bool = False, clock: Clock = REAL_CLOCK) -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} outside a network of {spec.world_size} ranks")
        self.spec, self.rank, self.clock = spec, rank, clock
        self.real_seconds: list[float] | None = [] if record else None
        self.issued_count = 0
        self.paced_collectives = 0
        self.late_collectives = 0
        self._board: _Board | None = None
        self._wire_ids: dict[Wire, int] = {}  # the board's index of each wire this rank used

    def __getstate__(self) -> dict[str, Any]:  # the board is mapped again in the process that unpickles
        return {**self.__dict__, "_board": None}

    def board(self) -> _Board:
        if self._board is None:
            self._board = _Board(self.spec.board_path, self.spec.link_count)
        return self._board

    def issued(self, op: str, nbytes: int, wire: Wire) -> _Ticket:
        now = self.clock.now()
        self.issued_count += 1
        if self.rank not in wire.ranks:
            raise LinkError(f"rank {self.rank} issued a collective on ranks {list(wire.ranks)}, which it is not one of")
        ticket = _Ticket(wire, op, self.spec.price(op, nbytes, wire))
        if len(wire.ranks) < 2:
            ticket.start = ticket.end = now
            return ticket
        board = self.board()
        with board.locked():
            ticket.wire_id = self._wire_id(board, wire)
            ticket.seq = int(board.issued[ticket.wire_id, self.rank])
            board.issued[ticket.wire_id, self.rank] = ticket.seq + 1
            self._join(board, ticket, nbytes, now)
        return ticket

    def done(self, ticket: _Ticket) -> None:
        """Sleep until the network would have finished ``ticket``'s collective (its real one is done)."""
        real_end = self.clock.now()
        if ticket.wire_id < 0:
            return
        ticket.start, ticket.end = self._await_end(ticket, real_end)
        board = self.board()
        with board.locked():
            board.rows["left"][ticket.wire_id, ticket.seq % DEPTH] |= 1 << self.rank
        self.paced_collectives += 1
        if self.real_seconds is not None:
            self.real_seconds.append(real_end - ticket.start)
        if real_end > ticket.end + LATE_TOLERANCE_S:
            self.late_collectives += 1
        # a plain sleep, no spin to the exact moment (as on a ``VirtualLink``)
        remaining = ticket.end - self.clock.now()
        if remaining > 0:
            self.clock.sleep(remaining)

    def _wire_id(self, board: _Board, wire: Wire) -> int:
        """The wire's index on the board, registering it (under the lock) the first time any rank uses it."""
        if wire in self._wire_ids:
            return self._wire_ids[wire]
        key = (WIRE_CODES[wire.link], _mask(wire.ranks))
        count = int(board.keys[0, 0])
        found = [i for i in range(count) if tuple(board.keys[1 + i]) == key]
        if found:
            wid = found[0]
        elif count == MAX_WIRES:
            raise LinkError(f"the virtual network paces at most {MAX_WIRES} distinct wires (process groups); "
                            "create a job's groups once, not per step")
        else:
            wid = count
            board.keys[1 + wid] = key
            board.keys[0, 0] = count + 1
        self._wire_ids[wire] = wid
        return wid

    def _join(self, board: _Board, ticket: _Ticket, nbytes: int, now: float) -> None:
        """Under the lock: mark this rank on the ticket's row (starting the row if it is the
        first); the last rank to join computes the collective's start and end."""
        rows, slot = board.rows, (ticket.wire_id, ticket.seq % DEPTH)
        mask, code = _mask(ticket.wire.ranks), OP_CODES.get(ticket.op, 0)
        if rows["seq"][slot] != ticket.seq + 1:
            if rows["seq"][slot] != 0 and rows["left"][slot] != mask:
                raise LinkError(f"rank {self.rank}: more than {DEPTH} collectives in flight on ranks "
                                f"{list(ticket.wire.ranks)} ({ticket.wire.link}); a rank stopped waiting for them")
            rows[slot] = (ticket.seq + 1, code, 0, 0, nbytes, -np.inf, np.nan, np.nan)
        elif code and rows["op"][slot] and rows["op"][slot] != code:
            other = {v: k for k, v in OP_CODES.items()}[int(rows["op"][slot])]
            raise LinkError(f"rank {self.rank}: collective #{ticket.seq} on ranks {list(ticket.wire.ranks)} "
                            f"({ticket.wire.link}) is a {ticket.op} here but a {other} on the ranks that issued it "
                            "first (every rank of a wire must run the same collectives, in the same order)")
        if rows["joined"][slot] >> self.rank & 1:
            raise LinkError(f"rank {self.rank} issued collective #{ticket.seq} on ranks {list(ticket.wire.ranks)} "
                            f"({ticket.wire.link}) twice")
        rows["joined"][slot] |= 1 << self.rank
        rows["ready"][slot] = max(float(rows["ready"][slot]), now)
        rows["nbytes"][slot] = max(int(rows["nbytes"][slot]), nbytes)
        if rows["joined"][slot] != mask:
            return
        pricing = ticket.pricing
        if int(rows["nbytes"][slot]) != nbytes:
            pricing = self.spec.price(ticket.op, int(rows["nbytes"][slot]), ticket.wire)
        start = max([float(rows["ready"][slot])] + [float(board.free[k]) for k in pricing.links])
        end = start + pricing.seconds
        for k in pricing.links:
            board.free[k] = end
        rows["start"][slot], rows["end"][slot] = start, end

    def _await_end(self, ticket: _Ticket, real_end: float) -> tuple[float, float]:
        """The row's (start, end), once its last rank issued it (``issue_wait_s`` at most)."""
        rows, slot = self.board().rows, (ticket.wire_id, ticket.seq % DEPTH)
        waited_until = real_end + self.spec.issue_wait_s
        while True:
            if rows["seq"][slot] == ticket.seq + 1 and not np.isnan(rows["end"][slot]):
                return float(rows["start"][slot]), float(rows["end"][slot])
            if self.clock.now() >= waited_until:
                joined = int(rows["joined"][slot]) if rows["seq"][slot] == ticket.seq + 1 else 0
                behind = [r for r in ticket.wire.ranks if not joined >> r & 1]
                raise LinkError(f"rank {self.rank}: paced collective #{ticket.seq} on ranks {list(ticket.wire.ranks)} "
                                f"({ticket.wire.link}) was not issued on ranks {behind} (every rank of a wire must "
                                "run the same collectives on the paced network, in the same order)")
            self.clock.sleep(2e-4)


def _mask(ranks: tuple[int, ...]) -> int:
    return sum(1 << r for r in set(ranks))


def paced_link(spec: LinkSpec | NetworkSpec, rank: int, *, record: bool = False) -> VirtualLink | VirtualNetwork:
    """Rank ``rank``'s end of an emulated interconnect: a ``VirtualLink`` of a ``LinkSpec`` (one
    link, every rank), a ``VirtualNetwork`` of a ``NetworkSpec``."""
    if isinstance(spec, NetworkSpec):
        return VirtualNetwork(spec, rank, record=record)
    return VirtualLink(spec, rank, record=record)
