"""A rank blocked in a collective still answers SIGTERM: within seconds when no peer is working.

A Python signal handler runs only between bytecodes of the main thread, so a rank blocked in a
collective (gloo's wait, in C++) does not even see the SIGTERM that torchrun sends when a worker
dies or the job is preempted: it sits there until the collective fails (the collective timeout)
or torchrun kills it 30 s later, and a restart waits for it. ``SigtermWatch`` hears the signal
at once through the interpreter's wakeup file descriptor (``signal.set_wakeup_fd``: the C-level
handler writes the signal's number there, whatever the main thread is doing) on a daemon thread.

What it does then follows from what the rank can still finish. A preemption stops every rank at
the next step boundary and saves a checkpoint (``poplar.train.preemption``); a rank waiting there
for a peer that is still computing or writing its part of the checkpoint must go on waiting. A
rank waiting for a peer that died or hangs never gets anywhere. So after a SIGTERM each rank
beats on the job's failure board (``poplar.process.failure``) while it is not blocked in a
collective (it computes, writes, or is about to reach the next collective), and a rank blocked
in one (``Communicator`` marks each one, ``BLOCKED``) for ``grace_s`` with no beat from any peer
and no data moving meanwhile (this process used almost no CPU: a collective that transfers, on a
slow link, keeps gloo's threads busy; one waiting for a peer that is gone leaves them idle) is
waiting for nobody: it says so in one line (none where a failing rank has already checked in:
the job's one failure line is that rank's and names this one), marks itself as stopped (not dead) on
the board and exits with 128 + SIGTERM, as the signal's default action would have. Beats cost
nothing before a SIGTERM. Outside torchrun there is no board and no watch: the signal waits for
the collective, as before.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import sys
import threading
import time
from typing import Any

POLL_S = 0.2
GRACE_S = 3.0  # blocked this long after a SIGTERM, with no peer beating: nobody is coming
BUSY = 0.1  # a share of one core used while blocked that means data is moving


class BlockedCollective:
    """The collective this process's main thread is blocked in, if any (set by ``Communicator``)."""

    def __init__(self) -> None:
        self.since: float | None = None  # time.monotonic() when it started
        self.what = ""

    def enter(self, what: str) -> None:
        if threading.current_thread() is threading.main_thread():
            self.what, self.since = what, time.monotonic()

    def leave(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.since = None


BLOCKED = BlockedCollective()


class SigtermWatch:
    """Watches for SIGTERM from a daemon thread (``start``, from the main thread; ``stop``)."""

    def __init__(self, door: str, grace_s: float = GRACE_S, poll_s: float = POLL_S) -> None:
        self.door, self.grace_s, self.poll_s = door, grace_s, poll_s
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._stopped = threading.Event()

    def start(self) -> "SigtermWatch":
        """Take the wakeup fd and start watching; nothing where it cannot (not the main thread,
        outside torchrun, a world of one, or another user of the wakeup fd, such as asyncio)."""
        if threading.current_thread() is not threading.main_thread() or self.world_size < 2 or \
                "TORCHELASTIC_RUN_ID" not in os.environ:
            return self
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # someone else's: give it back and do without
            signal.set_wakeup_fd(previous)
            self._close()
            return self
        threading.Thread(target=self._watch, name="poplar-sigterm-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        """Give the wakeup fd back; the watching thread ends (its socket closes)."""
        self._stopped.set()
        if self._writer is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            self._writer.close()  # the reader sees the end and the thread returns
            self._writer = None

    def _close(self) -> None:
        for s in (self._reader, self._writer):
            if s is not None:
                s.close()
        self._reader = self._writer = None

    def _watch(self) -> None:
        reader = self._reader
        assert reader is not None
        try:
            while not self._stopped.is_set():
                data = reader.recv(64)
                if not data:  # stopped
                    return
                if signal.SIGTERM in data:
                    self._after_sigterm()
                    return
        except OSError:
            return
        finally:
            reader.close()

    def _after_sigterm(self) -> None:
        from poplar.process.failure import FailureBoard

        board = FailureBoard.from_env(self.rank, self.world_size)
        if board is None:
            return
        signalled = time.monotonic()
        progress, beats, cpu = signalled, None, _cpu_s()
        while not self._stopped.wait(self.poll_s):
            since = BLOCKED.since
            try:
                if since is None:  # not blocked: this rank is working towards the next collective
                    board.beat()
                    progress, cpu = time.monotonic(), _cpu_s()
                    continue
                seen = board.beats()
            except Exception:  # noqa: BLE001 - the store is gone: the launcher is gone too
                seen = beats
            used = _cpu_s()
            if seen != beats or used - cpu > BUSY * self.poll_s:  # a peer is working, or data is moving
                progress = time.monotonic()
            beats, cpu = seen, used
            waited = time.monotonic() - max(since, signalled, progress)
            if waited >= self.grace_s:
                self._leave(board, time.monotonic() - since)

    def _leave(self, board: Any, blocked_s: float) -> None:
        # the job has one failure line: where a failing rank has checked in, its line names this
        # rank (one that did not report), so this rank leaves without a line of its own
        try:
            explained = board.reported()
        except Exception:  # noqa: BLE001 - the store is gone: nobody else can have said it
            explained = False
        if not explained:
            print(f"{self.door}: rank {self.rank}: SIGTERM while blocked {blocked_s:.1f} s in collective "
                  f"{BLOCKED.what}, with no peer working for {self.grace_s:g} s; exiting", file=sys.stderr,
                  flush=True)
        try:
            board.finish()  # stopped by the signal: not to be named as dead
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to ask
            pass
        sys.stdout.flush()
        os._exit(128 + signal.SIGTERM)


def _cpu_s() -> float:
    """CPU seconds this process has used, every thread together."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
