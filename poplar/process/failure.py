"""One failure line per job: the ranks that survive a failed step meet on the launcher's
key-value store, and only the first of them prints, naming the ranks that never showed up.

When a peer dies, every survivor's collective fails with the same story, and printing it on every
rank gives N copies of a line that cannot say who died: a rank blocked in a collective sees only
that the collective broke. ``FailureBoard`` uses the rendezvous store that torchrun's agent keeps
(``MASTER_ADDR:MASTER_PORT``; it outlives the workers): each failing rank checks in under its
rank, the first to check in is the one that reports. Each rank also registers its machine and pid
at start, so the reporter knows a rank on its machine whose process has ended to be dead at once;
it waits a short grace for the others and names those that never checked in as not reporting. A
failure every rank raised together (a bad batch, a corrupt checkpoint) has every rank check in, so
the line is the error alone, printed once. Without a reachable store each rank prints its own
line.

``FailureReporting`` is one rank's part in it, shared by every door (``poplar train``,
``PoplarStrategy``, ``PoplarTrainer``): join the board when the job starts, check in on failure,
let the group go (so peers blocked on this rank fail now, not at a timeout), and print the line
if this rank reports. Under torchrun every failing rank also writes torchrun's error file
(``TORCHELASTIC_ERROR_FILE``, the file ``torch.distributed.elastic``'s ``record`` writes), so the
launcher's summary shows the error instead of ``error_file: <N/A>``, once: [Note: one record per
failure].

[Note: one record per failure]
torchrun's summary lists every worker that exited with a nonzero status, each with its error
file, and names the one with the earliest timestamp (whole seconds; a tie goes to the lowest rank)
as the root cause. Only the reporting rank writes the failure line there. Every other failing
rank writes a pointer to the reporter's record instead of repeating the line: with no error file,
torchrun would print "To enable traceback see ..." for it and stamp it with the second it saw the
exit, which can tie with the reporter's and win by a lower rank. The reporter's stamp is its
check-in time rounded down, the others' their own later time rounded up, so the reporter's record
is strictly earliest (on one clock: ranks on other machines may differ by their clocks' skew).
The other ranks still exit with status 1, not 0: a torchrun agent whose workers all exit 0 takes
its part of the job as done and leaves, and the job could then not restart
(``--max-restarts``) with every machine.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

FAILURE_GRACE_S = 10.0  # how long the reporting rank waits for failing ranks not known dead to check in
LOCAL_GRACE_S = 2.0  # after a peer died: how long for ranks alive on this machine (blocked on a rank still here)


class FailureBoard:
    """Check-ins of the failing ranks of one job attempt, on a key-value store (at ``address``,
    host and port, where it is a TCP store)."""

    def __init__(self, store: Any, rank: int, world_size: int, address: tuple[str, int] | None = None) -> None:
        self.store, self.rank, self.world_size, self.address = store, rank, world_size, address

    @classmethod
    def from_env(cls, rank: int, world_size: int, timeout_s: float = 5.0) -> "FailureBoard | None":
        """The board on torchrun's store (None outside torchrun or when it cannot be reached)."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        run = os.environ.get("TORCHELASTIC_RUN_ID")
        if not host or not port or run is None or world_size < 2:
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - no store: every rank reports for itself
            return None
        return cls(dist.PrefixStore(f"poplar/failure/{run}/{attempt}", store), rank, world_size, (host, int(port)))

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """Whether the store's host still takes connections, asked with a plain socket. torchrun
        keeps the store in one agent (group rank 0, also when the rendezvous runs apart), so it
        ends with that agent's machine; a store call to it then fails only after c10d has
        printed the broken connection with a C++ stack trace, in which the failure line would
        be buried."""
        if self.address is None:
            return True
        try:
            with socket.create_connection(self.address, timeout=timeout_s):
                return True
        except OSError:
            return False

    def register(self) -> None:
        """At start: where this rank's process runs, so that a peer on the same machine can tell
        a dead rank from a slow one."""
        self.store.set(f"process{self.rank}", f"{socket.gethostname()} {os.getpid()}")

    def check_in(self) -> bool:
        """Say this rank failed; True for the first rank to do so (the one that reports, whose
        rank the board keeps: ``reporter``)."""
        self.store.set(f"rank{self.rank}", "1")
        self.store.add("reporters", 1)
        # one atomic step decides and records the reporter: a later rank reads who it was
        return self.store.compare_set("reporter", "", str(self.rank)).decode() == str(self.rank)

    def reporter(self) -> int | None:
        """The rank that reports the job's failure (None before any rank checked in)."""
        if not self.store.check(["reporter"]):
            return None
        return int(self.store.get("reporter").decode())

    def absent(self, grace_s: float, local_grace_s: float | None = None) -> tuple[list[int], list[int]]:
        """(ranks known dead, ranks alive or unknown that did not check in), waiting up to
        ``grace_s`` for the ranks that may still check in; ``local_grace_s``: a shorter wait once
        every rank not accounted for is alive on this machine (after a peer died, such a rank is
        blocked in a collective with a rank that has not exited yet: waiting longer only holds
        it). Once a rank is known dead, a rank alive on this machine that has not checked in yet
        is not in the second list: it is blocked by the death (it checks in when its collective
        breaks), not at fault, and the line blames only ranks that failed or cannot be seen."""
        start = time.monotonic()
        deadline = start + grace_s
        while True:
            missing = [r for r in range(self.world_size) if not self._accounted(r)]
            # a rank checks in (or finishes) before its process ends, so ask again after seeing it
            # ended: one that checked in between the two looks exited normally, it did not die
            dead = [r for r in missing if self._gone(r) and not self._accounted(r)]
            missing = [r for r in missing if not self._accounted(r)]
            now = time.monotonic()
            local = local_grace_s is not None and now >= start + local_grace_s and \
                all(r in dead or self._alive_here(r) for r in missing)
            if len(dead) == len(missing) or now >= deadline or local:
                silent = [r for r in missing if r not in dead]
                return dead, [r for r in silent if not (dead and self._alive_here(r))]
            time.sleep(0.05)

    def reported(self) -> bool:
        """Whether some rank has checked in as failing: the job's one failure line is that rank's."""
        return int(self.store.add("reporters", 0)) > 0

    def beat(self) -> None:
        """After a SIGTERM: this rank is working, not blocked (``poplar.process.sigterm_watch``)."""
        self.store.add("beats", 1)

    def beats(self) -> int:
        """How many beats every rank has given so far."""
        return int(self.store.add("beats", 0))

    def finish(self) -> None:
        """Say that this rank ended normally (done, or stopped by a signal): never named as dead."""
        self.store.set(f"done{self.rank}", "1")

    def _accounted(self, rank: int) -> bool:
        """Whether ``rank`` checked in as failing or said it ended normally."""
        return self.store.check([f"rank{rank}"]) or self.store.check([f"done{rank}"])

    def _alive_here(self, rank: int) -> bool:
        """True if ``rank``'s process runs on this machine and has not ended."""
        return self._where(rank) == socket.gethostname() and not self._gone(rank)

    def _where(self, rank: int) -> str | None:
        if not self.store.check([f"process{rank}"]):
            return None
        return self.store.get(f"process{rank}").decode().split()[0]

    def _gone(self, rank: int) -> bool:
        """True if ``rank``'s process ran on this machine and has ended (or is a zombie)."""
        if not self.store.check([f"process{rank}"]):
            return False
        host, pid = self.store.get(f"process{rank}").decode().split()
        if host != socket.gethostname():
            return False
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
        except (OSError, IndexError):
            return False


def failure_line(message: str, dead: list[int], silent: list[int]) -> str:
    """The message, led by the ranks whose process ended and those that never reported."""
    def ranks(rs: list[int]) -> str:
        return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))

    lead = []
    if dead:
        lead.append(f"{ranks(dead)} died (its process ended)" if len(dead) == 1 else f"{ranks(dead)} died")
    if silent:
        lead.append(f"{ranks(silent)} did not report (died on another machine, or still blocked)")
    return "; ".join(lead + [message])


class FailureReporting:
    """This process's part in the job's one failure line: the board it joins once the job has
    started (or when it fails, if that is earlier), its check-in when it fails, and the line the
    first failing rank prints, led by ``door`` (``"poplar train"``, ``"PoplarStrategy"``)."""

    def __init__(self, door: str = "poplar train") -> None:
        self.door = door
        self.board: Any = None  # a FailureBoard, once joined (None outside torchrun)
        self.joined = False
        self.failed_at = 0.0  # when this rank checked in (seconds since the epoch): its error record's time
        self.reporter: int | None = None  # the rank that reports the job's failure, once known

    def join(self) -> None:
        if self.joined:
            return
        self.joined = True
        board = FailureBoard.from_env(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
        if board is not None:
            board.register()
            self.board = board

    def finished(self) -> None:
        """Say on the board that this rank ended normally (it is not to be named as dead)."""
        if self.board is not None:
            try:
                self.board.finish()
            except Exception:  # noqa: BLE001 - the store is gone: nobody is left to ask
                pass

    def check_in(self) -> bool:
        """Say on the board that this rank failed; True if this rank is the one to print the
        job's failure line (the first to check in, or any rank without a board). Ignores SIGTERM
        from here on: torchrun SIGTERMs the survivors once it sees a rank die (it waits 30 s
        before it kills), and the line must come out first."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.failed_at = time.time()
        try:
            self.join()  # a failure before the job started (a bad config) checks in too
        except Exception:  # noqa: BLE001 - no store: report for this rank alone
            self.board = None
        if self.board is None or not self.board.reachable():
            self.board = None  # the store went with its machine: report for this rank alone
            return True
        try:
            if self.board.check_in():
                return True
            self.reporter = self.board.reporter()
        except Exception:  # noqa: BLE001 - the store is gone too: report for this rank alone
            self.board = None
            return True
        return False

    def report(self, error: BaseException | str, reporter: bool, wait: bool, peer: bool = False) -> None:
        """The reporter prints the failure once for the whole job, led by the ranks that died or
        never checked in; it waits (up to the grace) for the others to check in or be known dead
        first. ``wait`` on a rank that does not report: the same wait, for an input error that
        every rank meets while starting, so that none is still exposed to torchrun's SIGTERM
        (which would end it with 143) when the first of them exits. After a peer died a
        non-reporter leaves at once: its exit is what frees ranks still blocked on it. Every
        rank writes torchrun's error file: the reporter its line, the others a pointer to it
        ([Note: one record per failure])."""
        dead: list[int] = []
        silent: list[int] = []
        try:
            if self.board is not None and (reporter or wait):
                dead, silent = self.board.absent(FAILURE_GRACE_S, LOCAL_GRACE_S if peer else None)
        except Exception:  # noqa: BLE001 - the store is gone too: report for this rank alone
            pass
        if reporter:
            line = f"{self.door}: {failure_line(str(error), dead, silent)}"
            print(line, file=sys.stderr, flush=True)
            write_error_file(line, math.floor(self.failed_at or time.time()))
            return
        whose = f"rank {self.reporter}'s" if self.reporter is not None else "another rank's"
        write_error_file(f"{self.door}: rank {os.environ.get('RANK', '?')} stopped because the job failed; the "
                         f"error is {whose} record", math.ceil(time.time()))

    def end(self, error: BaseException | str, peer: bool) -> None:
        """This rank failed (``peer``: because a peer did): check in, let the process group go,
        and report. Only the text of the error is kept: an exception's frames hold the engine
        and, through it, the group, whose connections must close for peers blocked on this rank
        to go on."""
        # check in before the group goes: destroying a gloo group whose peer died can abort
        # this process (SIGABRT), and a rank gone without checking in would be named as dead
        reporter = self.check_in()
        gc.collect()  # the failed run's engine, and with it the group's last references
        if dist.is_available() and dist.is_initialized():
            try:  # then: peers blocked in a collective with this rank fail now, not at a timeout
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may be gone
                pass
        self.report(error, reporter, wait=reporter or not peer, peer=peer)


def write_error_file(line: str, timestamp: int) -> None:
    """Write ``line`` to torchrun's error file for this worker (``TORCHELASTIC_ERROR_FILE``, in
    the format ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler`` writes), so the
    launcher's failure summary carries it; nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(timestamp)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the summary then says <N/A>, as without it; the line is on stderr already
        pass
