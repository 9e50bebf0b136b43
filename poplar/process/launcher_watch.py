"""Workers never outlive their launcher: a worker whose torchrun is gone stops by itself.

torchrun starts each worker in a session of its own, so a SIGKILL of the launcher (or of its
process group) reaches none of them: re-parented to init, they would train on and write
checkpoints with nobody left to stop them. ``LauncherWatch`` notices this process's parent change
(polled by a daemon thread) and sends this process SIGTERM once, which a training loop treats as
preemption: every rank agrees on it at the next step boundary, saves a checkpoint if its peers
are alive (a dead peer fails the save's collectives instead, leaving the previous checkpoint),
and exits. Should the process still run ``hard_stop_s`` later (blocked, or SIGTERM ignored), it
ends itself with exit status 1, so no worker outlives its job by more than that.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

POLL_S = 0.25


class LauncherWatch:
    """Watches this process's parent from a daemon thread (``start``; ``stop`` ends the watch)."""

    def __init__(self, hard_stop_s: float, poll_s: float = POLL_S) -> None:
        self.hard_stop_s, self.poll_s = hard_stop_s, poll_s
        self.parent = os.getppid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LauncherWatch":
        self._thread = threading.Thread(target=self._watch, name="poplar-launcher-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if os.getppid() != self.parent:
                break
        else:
            return
        if os.environ.get("RANK", "0") == "0":  # one line for the job
            print(f"poplar train: the launcher (pid {self.parent}) is gone; every rank stops at the next step "
                  "boundary", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + self.hard_stop_s
        while time.monotonic() < deadline:
            if self._stop.wait(self.poll_s):
                return
        print(f"poplar train: rank {os.environ.get('RANK', '0')}: still running {self.hard_stop_s:g} s after its "
              "launcher ended; exiting", file=sys.stderr, flush=True)
        os._exit(1)
