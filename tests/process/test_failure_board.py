"""The job's one failure line: a rank that checked in or ended normally is never named as dead,
also when it checks in between the board's two looks (the check-in list, then whether the
process ended); a rank whose process ended without checking in is."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import torch.distributed as dist

from poplar.process.failure import FailureBoard, FailureReporting, failure_line
from poplar.process.launch import free_port


def _ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class LateCheckIn:
    """A store on which rank 1 checks in, then its process ends, right after the board's first
    look at the check-ins: the interleaving that once named a normally exited rank as dead."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.looks = store, 0

    def check(self, keys: list[str]) -> bool:
        if keys == ["rank1"]:
            self.looks += 1
            if self.looks == 2:  # after the first look: rank 1 checks in (its process has ended already)
                self.store.set("rank1", "1")
        return self.store.check(keys)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def _board(store, rank: int = 0) -> FailureBoard:
    board = FailureBoard(store, rank, 3)
    for r in range(3):
        store.set(f"process{r}", f"{socket.gethostname()} {_ended_pid() if r else 1}")
    return board


def test_a_rank_that_checks_in_between_the_looks_is_not_dead() -> None:
    store = dist.HashStore()
    board = _board(LateCheckIn(store))
    board.check_in()
    store.set("done2", "1")  # rank 2 finished normally
    assert board.absent(grace_s=0.5) == ([], [])


def test_a_rank_that_ended_without_checking_in_is_dead_and_a_finished_one_is_not() -> None:
    store = dist.HashStore()
    board = _board(store)
    assert board.check_in()
    FailureBoard(store, 2, 3).finish()
    dead, silent = board.absent(grace_s=0.5)
    assert (dead, silent) == ([1], [])
    assert failure_line("boom", dead, silent) == "rank 1 died (its process ended); boom"


def test_after_a_peer_died_a_live_rank_here_is_waited_for_briefly_and_named_as_silent() -> None:
    import os
    import time

    store = dist.HashStore()
    board = FailureBoard(store, 0, 3)
    store.set("process0", f"{socket.gethostname()} {os.getpid()}")
    store.set("process1", f"{socket.gethostname()} {os.getppid()}")  # alive: blocked in a collective
    store.set("process2", f"{socket.gethostname()} {_ended_pid()}")
    board.check_in()
    t0 = time.monotonic()
    assert board.absent(grace_s=30.0, local_grace_s=0.3) == ([2], [1])
    assert time.monotonic() - t0 < 10.0  # not the whole grace


def test_a_store_whose_host_is_gone_is_not_used_and_the_rank_reports_alone() -> None:
    """A store call to a host that is gone prints c10d's C++ stack trace before it fails; the
    board asks with a plain socket first and leaves the store alone."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    board = FailureBoard(dist.HashStore(), 0, 2, ("127.0.0.1", port))
    assert board.reachable()
    del server  # its host is gone
    assert not board.reachable()
    reporting = FailureReporting()
    reporting.joined, reporting.board = True, board
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert reporting.check_in() and reporting.board is None  # reports for itself
    finally:
        signal.signal(signal.SIGTERM, handler)  # check_in ignores SIGTERM from then on
    assert not board.store.check(["rank0"])  # and never touched the store
