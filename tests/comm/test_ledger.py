"""The ledger's device spans (``poplar.comm.ledger``, Note: blocked time on a GPU), with stand-ins
for CUDA events: a span is read only when the ledger is read, then counted once in its record,
its iteration and the total; unread spans are bounded; an async collective's issue counts when it is spent. The CUDA events themselves:
``tests/comm/test_cuda_blocked.py``."""

from __future__ import annotations

import torch

from poplar.comm.ledger import Blocked, BlockedTimer, CommLedger
from poplar.comm.pending import PendingCollective


class Event:
    """A CUDA event's stand-in: ``elapsed_time`` in milliseconds from ``start``; counts waits."""

    def __init__(self, ms: float = 0.0) -> None:
        self.ms, self.waits = ms, 0

    def synchronize(self) -> None:
        self.waits += 1

    def elapsed_time(self, end: "Event") -> float:
        return end.ms - self.ms


def test_a_span_is_read_when_the_ledger_is_read_and_counted_once() -> None:
    ledger = CommLedger()
    ledger.start_iteration(3)
    end = Event(250.0)
    ledger.add("all_reduce", 64, Blocked(0.001, ((Event(0.0), end),)), tag="bucket")
    ledger.add("all_reduce", 8, 0.002, tag="status")
    assert end.waits == 0  # adding waits for nothing
    assert abs(ledger.total_seconds - 0.253) < 1e-12 and end.waits == 1
    assert abs(ledger.seconds(iteration=3) - 0.253) < 1e-12
    assert [round(r.seconds, 9) for r in ledger.records] == [0.251, 0.002]
    assert abs(ledger.total_seconds - 0.253) < 1e-12 and end.waits == 1  # read once


def test_spans_add_up_and_clearing_reads_them_first() -> None:
    ledger = CommLedger()
    two = Blocked(0.0, ((Event(0.0), Event(100.0)),)).plus(Blocked(0.5, ((Event(10.0), Event(30.0)),)))
    ledger.add("exchange", 1, two)
    ledger.clear()
    assert abs(ledger.total_seconds - 0.62) < 1e-12 and not ledger.records


def test_unread_spans_are_bounded() -> None:
    ledger = CommLedger(max_unread=3)
    ends = [Event(1.0) for _ in range(5)]
    for end in ends:
        ledger.add("all_gather", 1, Blocked(0.0, ((Event(0.0), end),)))
    assert [e.waits for e in ends] == [1, 1, 1, 1, 0]  # the fourth add read the four
    assert abs(ledger.total_seconds - 0.005) < 1e-12


class _Issuer:
    """What ``PendingCollective`` uses of a communicator: a ledger and a host timer."""

    def __init__(self) -> None:
        self.ledger, self.observer, self.rank = CommLedger(), None, 0

    def settle(self, upto: object = None) -> None:
        pass

    def start_timer(self, issue_only: bool = False) -> BlockedTimer:
        return BlockedTimer(torch.device("cpu"), issue_only)


def test_an_async_collectives_issue_counts_in_the_window_it_was_spent_and_once() -> None:
    # the runtime measures a micro-step's compute as its wall minus the growth of total_seconds:
    # an async collective issued in the micro-step and waited for in the step must take its issue
    # seconds out of that micro-step, not add them to the step's (they were counted twice)
    comm = _Issuer()
    before = comm.ledger.total_seconds
    pending = PendingCollective(comm, None, "all_reduce", 64, Blocked(0.004), "bucket")
    assert abs(comm.ledger.total_seconds - before - 0.004) < 1e-12  # the micro-step's window
    in_step = comm.ledger.total_seconds
    pending.wait()
    waited = comm.ledger.total_seconds - in_step  # the step's window: the wait alone
    assert 0.0 <= waited < 0.004
    (record,) = comm.ledger.records
    assert abs(record.seconds - (0.004 + waited)) < 1e-12
    assert abs(comm.ledger.total_seconds - record.seconds) < 1e-12
