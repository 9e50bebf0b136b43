"""The phases of a profiling run, and the observers that hear of them.

A profiling run (``profile_run.ProfileRun``, its phases on a ``rank_phases.RankPhases``) goes
through three kinds of work, each with its own rule about failure and time:

- ``CAPACITY``: capacity-search trial steps, one rank alone on a ``LocalCommunicator`` runtime.
  Running out of memory is expected there and recovered from; the steps are not timed.
- ``TIMING``: lock-step timing rounds with the real collectives. Every rank must reach every
  collective of a round, so nothing may raise inside one: a memory overflow a device notices in
  software is recorded, and the ranks agree on the records after the rounds (a GPU's allocator
  raises instead, which fails the round on every rank through the collectives' timeout path).
- ``COMM``: the collectives probed for the bandwidth fit.

A ``ProfileObserver`` hears of them. A real GPU needs none: its speed and memory are its own. A
device that emulates a GPU in software implements the protocol (``poplar.emulation``): it fixes
its scales for the workload when profiling starts, runs the untimed capacity trials at the
machine's own speed, records overflows instead of raising them in timing rounds, and carries the
run's collectives on its emulated link. The profiler finds observers among the devices it is
given (``observers_of``), so the product never asks which kind of device it has.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ContextManager, Iterator, Protocol, runtime_checkable

from poplar.comm import Communicator
from poplar.types.profiles import Emulated, Profile


class ProfilePhase(Enum):
    """A kind of work in a profiling run (see the module doc)."""

    CAPACITY = "capacity"
    TIMING = "timing"
    COMM = "comm"


@dataclass
class PhaseRecord:
    """What observers noticed during a phase without raising: memory overflows (messages)."""

    overflows: list[str] = field(default_factory=list)


@runtime_checkable
class ProfileObserver(Protocol):
    """What hears of a profiling run's start and phases (every rank calls the same, in order)."""

    def prepare_profiling(self, comm: Communicator, job: Any, reused: Profile | None) -> None:
        """Every rank, together, before a profile is measured (``job``: the ``ProfileJob``) or
        reused (``reused``: the profile loaded instead, and ``job`` what it would have measured)."""

    def profile_phase(self, phase: ProfilePhase, comm: Communicator) -> ContextManager[PhaseRecord]:
        """The phase runs while the returned block does (``comm``: the run's communicator)."""

    def emulation(self) -> Emulated | None:
        """The emulator's scales a profile measured with this observer records in its
        ``Provenance`` (None: a real device)."""


def observers_of(*candidates: Any) -> list[ProfileObserver]:
    """The candidates that observe profiling runs (a device may; a real GPU does not)."""
    return [c for c in candidates if isinstance(c, ProfileObserver)]


@contextlib.contextmanager
def in_phase(observers: list[ProfileObserver], phase: ProfilePhase, comm: Communicator) -> Iterator[PhaseRecord]:
    """Run a phase under every observer's block; the yielded record gathers what they noticed."""
    record = PhaseRecord()
    with contextlib.ExitStack() as stack:  # each observer's own record is merged as its block ends
        for observer in observers:
            mine = stack.enter_context(observer.profile_phase(phase, comm))
            stack.callback(lambda mine=mine: record.overflows.extend(mine.overflows))
        yield record

