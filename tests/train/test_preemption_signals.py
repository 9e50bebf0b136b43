"""StopSignals in one process: a signal is recorded, not acted on; a repeat within the grace is
the same request; a later repeat gets the previous handler at once; uninstall restores it."""

from __future__ import annotations

import signal
import time

import pytest

import poplar.train.preemption as preemption
from poplar.comm import Communicator
from poplar.train.preemption import Preempted, StopSignals


def test_a_signal_is_recorded_and_agreed_and_a_late_repeat_is_not_deferred(monkeypatch) -> None:
    # start from Python's own handler, whatever an earlier test in this process left: once in CI
    # the late repeat raised nothing, most likely handed back to a handler that was not Python's
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.getsignal(signal.SIGINT)
    stop = StopSignals().install()
    try:
        comm = Communicator()
        assert stop.agreed(comm) is None
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # at once: Ctrl-C seen from the terminal and the launcher
        assert stop.received == signal.SIGINT and stop.agreed(comm) == signal.SIGINT
        monkeypatch.setattr(preemption, "REPEAT_GRACE_S", 0.0)
        time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):  # a real second Ctrl-C: Python's own handler
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.uninstall()
        restored = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, outer)
    assert restored is previous


def test_preempted_has_the_conventional_exit_status() -> None:
    e = Preempted(signal.SIGTERM, 7, "ckpt/step-00000007")
    assert e.exit_code == 143 and str(e) == ("stopped by SIGTERM at iteration 7: checkpoint ckpt/step-00000007 saved; "
                                             "run the same command again to resume from it")
    assert "nothing was saved" in str(Preempted(signal.SIGINT, 3, None)) and Preempted(2, 3, None).exit_code == 130
