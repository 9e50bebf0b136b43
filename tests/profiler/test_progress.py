"""Profiling progress: a bar per phase, counting the phase's blocks against those expected, and a
line with the phase's seconds once they are done."""

from __future__ import annotations

import time

from poplar.profiler.phases import ProfileObserver, ProfilePhase, in_phase
from poplar.profiler.progress import PhaseProgress


def test_a_line_when_the_expected_blocks_of_a_phase_are_done() -> None:
    lines: list[str] = []
    progress = PhaseProgress(True, lines.append)
    assert isinstance(progress, ProfileObserver)  # heard as a device's observers are
    progress.expect(ProfilePhase.CAPACITY, 2)
    with in_phase([progress], ProfilePhase.CAPACITY, None):
        time.sleep(0.06)
    assert lines == []  # one of two
    with in_phase([progress], ProfilePhase.CAPACITY, None):
        time.sleep(0.06)
    assert len(lines) == 1 and lines[0].startswith("capacity search: 2 blocks done")
    assert float(lines[0].split(", ")[1].split(" s")[0]) >= 0.1  # the blocks' own seconds
    with in_phase([progress], ProfilePhase.COMM, None):  # not announced: a line per block
        pass
    assert lines[-1].startswith("collectives: 1 block done")


def test_silent_off_rank_zero() -> None:
    lines: list[str] = []
    progress = PhaseProgress(False, lines.append)
    progress.expect(ProfilePhase.TIMING, 1)
    with in_phase([progress], ProfilePhase.TIMING, None):
        pass
    assert lines == []
