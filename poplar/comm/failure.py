"""One failure line per job: the ranks that survive a failed step meet on the launcher's
key-value store, and only the first of them prints, naming the ranks that never showed up.

When a peer dies, every survivor's collective fails with the same story, and printing it on every
rank gives N copies of a line that cannot say who died: a rank blocked in a collective sees only
that the collective broke. ``FailureBoard`` uses the rendezvous store that torchrun's agent keeps
(``MASTER_ADDR:MASTER_PORT``; it outlives the workers): each failing rank checks in under its
rank, the first to check in is the one that reports. Each rank also registers its machine and pid
at start, so the reporter knows a rank on its machine whose process has ended to be dead at once;
it waits a short grace for the others and names those that never checked in as not reporting. A failure every rank raised together (a bad batch, a
corrupt checkpoint) has every rank check in, so the line is the error alone, printed once.
Without a reachable store each rank prints its own line, as before.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist


class FailureBoard:
    """Check-ins of the failing ranks of one job attempt, on a key-value store."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

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
        return cls(dist.PrefixStore(f"poplar/failure/{run}/{attempt}", store), rank, world_size)

    def register(self) -> None:
        """At start: where this rank's process runs, so that a peer on the same machine can tell
        a dead rank from a slow one."""
        self.store.set(f"process{self.rank}", f"{socket.gethostname()} {os.getpid()}")

    def check_in(self) -> bool:
        """Say this rank failed; True for the first rank to do so (the one that reports)."""
        self.store.set(f"rank{self.rank}", "1")
        return int(self.store.add("reporters", 1)) == 1

    def absent(self, grace_s: float, local_grace_s: float | None = None) -> tuple[list[int], list[int]]:
        """(ranks known dead, ranks alive or unknown that did not check in), waiting up to
        ``grace_s`` for the ranks that may still check in; ``local_grace_s``: a shorter wait once
        every rank not accounted for is alive on this machine (after a peer died, such a rank is
        blocked in a collective with a rank that has not exited yet: waiting longer only holds
        it)."""
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
                return dead, [r for r in missing if r not in dead]
            time.sleep(0.05)

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
