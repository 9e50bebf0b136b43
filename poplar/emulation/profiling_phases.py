"""How a virtual device takes part in a profiling run (the product's ``ProfileObserver`` points):
capacity trials run at the machine's own speed (they are not timed), lock-step timing rounds
record memory overflows instead of raising them mid-collective (the profiler agrees on them
after the rounds), and the collectives probed for the bandwidth fit ride the device's emulated
link, as the runtime's own do while the device is attached. A mixin of ``VirtualDevice``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from poplar.comm import Communicator
from poplar.profiler.phases import PhaseRecord, ProfilePhase
from poplar.types.profiles import Emulated


class ProfilingPhases:
    """The profiling half of ``VirtualDevice``: needs ``pad``, ``raise_oom``, ``overflows``,
    ``link``, ``cluster``, ``memory_scale`` and ``time_scale``."""

    pad: bool
    raise_oom: bool
    overflows: list[dict[str, Any]]
    link: Any
    cluster: Any
    memory_scale: float | None
    time_scale: float | None

    def prepare_profiling(self, comm: Communicator, job: Any, reused: Any) -> None:
        """Nothing to prepare: this device's memory and curve are fixed (a cluster's device whose
        scales are calibrated for the workload does it here: ``emulate.ClusterDevice``)."""

    @contextlib.contextmanager
    def profile_phase(self, phase: ProfilePhase, comm: Communicator | None) -> Iterator[PhaseRecord]:
        """Capacity trials run at the machine's own speed (they are not timed); timing rounds
        record memory overflows instead of raising them mid-collective; the collectives probed
        ride the emulated link, as the timing rounds' do (``attach``)."""
        record = PhaseRecord()
        if phase is ProfilePhase.CAPACITY:
            with self.unpadded():
                yield record
        elif phase is ProfilePhase.TIMING:
            with self.recording_overflows() as overflows:
                yield record
            record.overflows += [o["message"] for o in overflows]
        else:
            with self.pacing(comm):
                yield record

    def emulation(self) -> Emulated:
        return Emulated(memory_scale=self.memory_scale, time_scale=self.time_scale,
                        cluster=self.cluster.name if self.cluster is not None else "")

    # ------------------------------------------------------------------ temporary switches
    @contextlib.contextmanager
    def unpadded(self) -> Iterator[None]:
        """Run steps at the machine's own speed until the block ends."""
        pad, self.pad = self.pad, False
        try:
            yield
        finally:
            self.pad = pad

    @contextlib.contextmanager
    def recording_overflows(self) -> Iterator[list[dict[str, Any]]]:
        """Until the block ends, record memory overflows in the yielded list instead of raising
        them (a lock-step round must not raise inside a collective)."""
        raise_oom, self.raise_oom = self.raise_oom, False
        self.overflows.clear()
        try:
            yield self.overflows
        finally:
            self.raise_oom = raise_oom

    def pacing(self, comm: Communicator | None) -> contextlib.AbstractContextManager:
        """``comm``'s tensor collectives ride this device's emulated link while the block runs
        (nothing changes without a link)."""
        return comm.observed(self.link) if comm is not None else contextlib.nullcontext()

