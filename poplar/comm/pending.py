"""Collectives in flight: what the communicator's async calls return, and who hears them.

A ``PendingCollective`` is one collective on one group; a ``PendingChain`` is a hierarchical
collective (``poplar.comm.hierarchical``), a chain of steps on groups of their own. Both record
in the communicator's ledger when waited on, at the position where they were issued, and tell
the communicator's ``CollectiveObserver`` when each collective (each step) is issued and done.

[Note: chains of steps, issued in order]
A hierarchical collective is two steps (in-node, exchange), the second issued only once the first
is done. Its first step is issued with the call and overlaps what the rank does next; its last
step is issued when the collective is waited on or, at the latest, before the rank's next
collective of any kind (``settle``: every chain issued before is brought to its last step,
oldest first). So every rank issues every step of every collective in one order, the order of
the calls, which is the same on every rank: no group sees two orders, an observer hears the same
sequence on every rank of a wire, and a rank never blocks in a collective while a peer waits for
a step it has not issued. The price: a collective's first step (in-node for a reduce-scatter, the
exchange for an all-gather) completes before the next collective is issued; its last step still
overlaps until the next wait. Later steps run on groups of their own (``NodeGroups``), so even a
step issued at a different moment on two ranks meets no other call of its group in between.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch.distributed as dist

from poplar.comm.hierarchical import HierarchicalCall, Step
from poplar.comm.ledger import Blocked, BlockedTimer, CommLedger
from poplar.process.sigterm_watch import BLOCKED
from poplar.types.errors import DistributedError
from poplar.types.topology import Link, Wire


def guarded(rank: int, op: str, tag: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``, a collective's issue or wait on ``rank``; a peer that died or timed out becomes a
    clear error on this rank. While it runs, ``BLOCKED`` says so (``poplar.process.sigterm_watch``)."""
    BLOCKED.enter(f"{op} ({tag or 'untagged'})")
    try:
        return fn()
    except (RuntimeError, dist.DistBackendError) as e:
        if isinstance(e, DistributedError):
            raise
        raise DistributedError(
            f"rank {rank}: collective {op} ({tag or 'untagged'}) failed — another rank probably died, "
            f"raised outside a collective, or timed out ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
        ) from e
    finally:
        BLOCKED.leave()


class CollectiveObserver(Protocol):
    """What an observer of the tensor collectives implements (the same calls, in the same order,
    on every rank of ``wire.ranks``; a hierarchical collective's steps are heard one by one, in
    one order on every rank: Note: chains of steps, issued in order): ``issued`` before a collective starts, returning a ticket,
    and ``done`` with that ticket once the collective is complete on this rank. ``nbytes`` is
    the same on every rank taking part: the full buffer of a collective, and for a cross-node
    exchange (op ``"exchange"``) the node count times the bytes through the busiest node's port
    (the most any node sends or receives), so a port model that divides it by the nodes prices
    uneven node shares exactly.
    ``wire`` says which link it runs on and which global ranks take part."""

    def issued(self, op: str, nbytes: int, wire: Wire) -> Any:
        ...

    def done(self, ticket: Any) -> None:
        ...


class Issuer(Protocol):
    """What a collective in flight uses of the communicator that issued it."""

    ledger: CommLedger
    observer: CollectiveObserver | None

    def settle(self, upto: "PendingChain | None" = None) -> None:
        ...

    def start_timer(self, issue_only: bool = False) -> BlockedTimer:
        ...

    rank: int


class PendingCollective:
    """An async collective in flight; ``wait()`` blocks until it is done and records the seconds
    blocked (issue time included) at the position where it was issued."""

    def __init__(self, comm: Issuer, work: Any, op: str, nbytes: int, issue: Blocked, tag: str,
                 observer: CollectiveObserver | None = None, ticket: Any = None,
                 finish: Callable[[], None] | None = None, link: Link = Link.FLAT) -> None:
        self.comm, self.work, self.op, self.nbytes, self.issue, self.tag = comm, work, op, nbytes, issue, tag
        self.link = link  # the link of the group it runs on, for the ledger
        self.observer, self.ticket = observer, ticket  # who heard it issued, and its ticket there
        self.finish = finish  # what completes it once torch's work is done (an uneven call's copy-out)
        self.position = comm.ledger.position
        comm.ledger.count_issue(issue.host_s)

    def wait(self) -> None:
        timer = self.comm.start_timer()
        if self.work is not None:
            guarded(self.comm.rank, self.op, self.tag, self.work.wait)
        if self.finish is not None:
            self.finish()
            self.finish = None
        if self.observer is not None:  # the observer that heard it issued, even if its block has ended
            self.observer.done(self.ticket)
            self.observer = None
        blocked = self.issue.plus(timer.stop())
        with self.comm.ledger.at(self.position):
            self.comm.ledger.add(self.op, self.nbytes, blocked, self.tag, self.link, counted_s=self.issue.host_s)


class PendingChain:
    """A hierarchical collective in flight (Note: chains of steps, issued in order): its current
    step and the steps still to issue. ``wait()`` issues and completes what is left; each step is
    recorded when done, with its link, at the position where the collective was issued."""

    def __init__(self, comm: Issuer, op: str, call: HierarchicalCall, tag: str) -> None:
        self.comm, self.op, self.call, self.tag = comm, op, call, tag
        self.position = comm.ledger.position
        self.next = 0  # call.steps[:next] have been issued
        self.current: tuple[Step, Any, CollectiveObserver | None, Any, Blocked] | None = None

    @property
    def issued_all(self) -> bool:
        return self.next == len(self.call.steps)

    def issue_next(self) -> None:
        step = self.call.steps[self.next]
        self.next += 1
        timer = self.comm.start_timer(issue_only=True)
        observer = self.comm.observer if step.wire is not None else None
        ticket = observer.issued(step.op, step.observed_bytes, step.wire) if observer is not None else None
        work = guarded(self.comm.rank, self.op, self.tag, lambda: step.run(True))
        issue = timer.stop()
        if step.wire is not None:  # a step with no wire is not recorded: its seconds stay compute
            self.comm.ledger.count_issue(issue.host_s)
        self.current = (step, work, observer, ticket, issue)

    def complete_current(self) -> None:
        if self.current is None:
            return
        (step, work, observer, ticket, issue), self.current = self.current, None
        timer = self.comm.start_timer()
        if work is not None:
            guarded(self.comm.rank, self.op, self.tag, work.wait)
        if step.finish is not None:
            step.finish()
        if observer is not None:
            observer.done(ticket)
        blocked = issue.plus(timer.stop())
        if step.wire is not None:
            with self.comm.ledger.at(self.position):
                self.comm.ledger.add(self.op, step.sent_bytes, blocked, self.tag, step.link, counted_s=issue.host_s)

    def issue_rest(self) -> None:
        """Complete each step and issue the next, until the last is issued."""
        while not self.issued_all:
            self.complete_current()
            self.issue_next()

    def wait(self) -> None:
        self.comm.settle(upto=self)  # the chains issued before first, then this one's own steps
        self.issue_rest()
        self.complete_current()
        if self.call.finish is not None:
            self.call.finish()
            self.call = HierarchicalCall(self.call.steps, None)
