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


def test_after_a_peer_died_a_live_rank_here_is_waited_for_briefly_and_not_blamed() -> None:
    """After a SIGKILL of rank 2, rank 1 (alive on this machine, still blocked in a collective
    with a rank that has not left yet) is not named: only the dead rank is."""
    import os
    import time

    store = dist.HashStore()
    board = FailureBoard(store, 0, 3)
    store.set("process0", f"{socket.gethostname()} {os.getpid()}")
    store.set("process1", f"{socket.gethostname()} {os.getppid()}")  # alive: blocked in a collective
    store.set("process2", f"{socket.gethostname()} {_ended_pid()}")
    board.check_in()
    t0 = time.monotonic()
    dead, silent = board.absent(grace_s=30.0, local_grace_s=0.3)
    assert (dead, silent) == ([2], [])
    assert time.monotonic() - t0 < 10.0  # not the whole grace
    assert failure_line("boom", dead, silent) == "rank 2 died (its process ended); boom"


def test_with_no_rank_dead_a_live_rank_that_never_checks_in_is_named_and_so_is_one_elsewhere() -> None:
    """A hang: every other rank's collective timed out, and the rank that never checked in is the
    one to blame; a rank on another machine cannot be seen and is named as not reporting too."""
    import os

    store = dist.HashStore()
    board = FailureBoard(store, 0, 4)
    store.set("process0", f"{socket.gethostname()} {os.getpid()}")
    store.set("process1", f"{socket.gethostname()} {os.getppid()}")  # alive, hung outside a collective
    store.set("process2", f"elsewhere-{socket.gethostname()} 1")
    FailureBoard(store, 3, 4).check_in()
    board.check_in()
    assert board.absent(grace_s=0.5, local_grace_s=0.1) == ([], [1, 2])
    store.set("process3", f"{socket.gethostname()} {_ended_pid()}")  # and with a death: rank 2 is still unseen
    store.delete_key("rank3")
    assert board.absent(grace_s=0.3, local_grace_s=0.1) == ([3], [2])


def test_only_the_reporter_writes_the_failure_into_torchruns_record_and_it_is_the_earliest(tmp_path, monkeypatch,
                                                                                           capsys) -> None:
    """[Note: one record per failure]: the reporter's record holds the line; every other failing
    rank's holds a pointer to it, stamped later in whole seconds (torchrun's root cause is the
    earliest stamp, a tie going to the lowest rank)."""
    import json

    store = dist.HashStore()
    handler = signal.getsignal(signal.SIGTERM)
    records = {}
    ranks = {}
    try:
        for rank in (2, 0, 1):  # rank 2 fails first
            ranks[rank] = reporting = FailureReporting()
            reporting.joined, reporting.board = True, FailureBoard(store, rank, 3)
            reporter = reporting.check_in()
            assert reporter == (rank == 2) and reporting.reporter == (None if reporter else 2)
        for rank, reporting in ranks.items():
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"{rank}.json"))
            reporting.report("error: the config is bad", rank == 2, wait=True)
            records[rank] = json.loads((tmp_path / f"{rank}.json").read_text())["message"]
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert capsys.readouterr().err.count("the config is bad") == 1
    assert records[2]["extraInfo"]["py_callstack"] == "poplar train: error: the config is bad"
    for rank in (0, 1):
        assert records[rank]["message"] == \
            f"poplar train: rank {rank} stopped because the job failed; the error is rank 2's record"
        assert int(records[rank]["extraInfo"]["timestamp"]) > int(records[2]["extraInfo"]["timestamp"])


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
