"""Graceful preemption: SIGTERM or SIGINT on any rank stops every rank at the same iteration.

A scheduler that preempts a job sends SIGTERM (torchrun forwards it to every worker and kills
them about 30 s later); Ctrl-C sends SIGINT. ``StopSignals`` replaces the handlers of those
signals while ``fit`` runs: a signal only records its number. After every iteration the ranks
agree on the records in one all-reduce of a few numbers (``StopSignals.agreed``), so all of them
see the request after the same iteration, even when the signal reached one rank only or reached
them at different times. ``fit`` then saves a checkpoint at that iteration, writes its reports and raises ``Preempted`` on every rank; ``poplar train`` turns it into one
line and the conventional exit status 128 + signal number.

A signal that arrives in a collective, a save or the iteration itself waits for it to end: an
iteration is always finished, never cut, so parameters and optimizer state stay consistent, and a
save is completed rather than left half-written. A second signal of the same kind restores the
previous handler and re-delivers itself: pressing Ctrl-C twice (or a second SIGTERM) stops the
process at once, as it would have without Poplar (the kept checkpoints survive that too). A
repeat within ``REPEAT_GRACE_S`` of the first is not a second request: under torchrun, Ctrl-C
reaches each worker from the terminal and again from the launcher.

Handlers can only be installed from the main thread; elsewhere ``StopSignals`` does nothing (a
``fit`` in a worker thread is never asked to stop).
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import torch

from poplar.comm import Phase

HANDLED = (signal.SIGTERM, signal.SIGINT)
# Ctrl-C under torchrun reaches a worker twice, from the terminal and forwarded by the launcher: a
# repeat this soon after the first is the same request, not a second one
REPEAT_GRACE_S = 2.0


class Preempted(Exception):
    """``fit`` stopped early because a rank received a stop signal; raised on every rank after
    the checkpoint (if any) and the reports were written."""

    def __init__(self, signum: int, iteration: int, checkpoint: str | None) -> None:
        self.signum, self.iteration, self.checkpoint = signum, iteration, checkpoint
        name = signal.Signals(signum).name
        where = (f"checkpoint {checkpoint} saved; run the same command again to resume from it"
                 if checkpoint is not None else "no checkpoint directory was given, so nothing was saved")
        super().__init__(f"stopped by {name} at iteration {iteration}: {where}")

    @property
    def exit_code(self) -> int:
        """The conventional status of a process ended by this signal (143 for SIGTERM)."""
        return 128 + self.signum


class StopSignals:
    """Records SIGTERM / SIGINT between ``install()`` and ``uninstall()``; ``agreed(comm)``
    tells every rank, identically, whether some rank received one and which."""

    def __init__(self, signals: tuple[signal.Signals, ...] = HANDLED) -> None:
        self.signals = signals
        self._received: list[int] = []
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0

    @property
    def received(self) -> int | None:
        """The first stop signal this process received, if any."""
        return self._received[0] if self._received else None

    def install(self) -> "StopSignals":
        """Record the signals from now on (from the main thread; elsewhere a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before ``install``."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if signum in self._received:
            if now - self._first_at < REPEAT_GRACE_S:  # the same request delivered twice
                return
            self.uninstall()  # a second request: behave as if we had never been here
            signal.raise_signal(signum)
            return
        if not self._received:
            self._first_at = now
        self._received.append(signum)

    def agreed(self, comm: Any) -> int | None:
        """Collective, between iterations: the stop signal every rank acts on, or None. One
        all-reduce of one count per handled signal; the first handled signal any rank received
        wins (SIGTERM before SIGINT), so every rank returns the same."""
        counts = torch.zeros(len(self.signals), dtype=torch.float64, device=comm.device)
        for sig in set(self._received):
            counts[self.signals.index(sig)] = 1.0
        with comm.ledger.scope(Phase.STEP):
            comm.all_reduce(counts, tag="stop signal")
        for sig, count in zip(self.signals, counts.tolist()):
            if count > 0:
                return int(sig)
        return None
