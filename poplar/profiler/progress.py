"""Progress of a profiling run on rank 0: a ``ProfileObserver`` that draws one tqdm bar per
phase (``ProfilePhase``), counting the phase's blocks (a capacity search per configuration or
stage, a configuration's timing, the collectives' probe) against the total the run expects
(``expect``), so tqdm shows an ETA once one block is done; and a log line when a phase's
expected blocks are done, with its seconds, so a log without a terminal still hears of it.
Timing rounds have their own bar inside a timing block (``timing.run_rounds``), and auto mode a
bar of the candidates it decides on (``poplar.auto.choice``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from poplar.comm import Communicator
from poplar.profiler.phases import PhaseRecord, ProfilePhase
from poplar.logs import progress_bar
from poplar.types.profiles import Profile

WHAT = {ProfilePhase.CAPACITY: "capacity search", ProfilePhase.TIMING: "timing", ProfilePhase.COMM: "collectives"}


class PhaseProgress:
    """Bars and closing lines of a run's phases; draws and says nothing unless ``enabled``."""

    def __init__(self, enabled: bool, log: Callable[[str], None] = lambda m: None) -> None:
        self.enabled, self.log = enabled, log
        self.expected: dict[ProfilePhase, int] = {}
        self.done: dict[ProfilePhase, int] = {}
        self.seconds: dict[ProfilePhase, float] = {}
        self._bars: dict[ProfilePhase, Any] = {}

    def expect(self, phase: ProfilePhase, blocks: int) -> None:
        """The run will go through ``blocks`` more blocks of ``phase``."""
        self.expected[phase] = self.expected.get(phase, 0) + blocks
        bar = self._bars.get(phase)
        if bar is not None:
            bar.total = self.expected[phase]

    def prepare_profiling(self, comm: Communicator, job: Any, reused: Profile | None) -> None:
        pass

    @contextlib.contextmanager
    def profile_phase(self, phase: ProfilePhase, comm: Communicator | None) -> Iterator[PhaseRecord]:
        if phase not in self._bars:
            total = max(self.expected.get(phase, 1), 1)
            self._bars[phase] = progress_bar(total, f"profiling: {WHAT[phase]}", self.enabled)
        t0 = time.perf_counter()
        try:
            yield PhaseRecord()
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            self.done[phase] = self.done.get(phase, 0) + 1
            self._bars[phase].update(1)
            if self.done[phase] >= self.expected.get(phase, self.done[phase]):  # unexpected blocks: one each
                self.close(phase)

    def close(self, phase: ProfilePhase) -> None:
        """End ``phase``'s bar and say how long its blocks took."""
        bar = self._bars.pop(phase, None)
        if bar is not None:
            bar.close()
            if self.enabled:
                n = self.done.get(phase, 0)
                self.log(f"{WHAT[phase]}: {n} block{'s' * (n != 1)} done, {self.seconds.get(phase, 0.0):.1f} s so far")

    def emulation(self) -> None:
        return None
