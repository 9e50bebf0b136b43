"""A scripted fake device for the profiler and the planner: its memory and compute time per
micro-step are given by a formula, so a test feeds known numbers in and checks what comes out.

- memory: ``base_bytes`` of model states (``static_bytes``) and, while a micro-step's forward
  has run, ``activation_bytes(b) = bytes_per_sample * b + bytes_per_sample_squared * b * b`` of
  activations; a forward whose activations pass ``capacity_bytes`` raises the one out-of-memory
  error every device raises. The largest batch that fits is ``Script.mbs`` (linear memory:
  ``(capacity_bytes - base_bytes) // bytes_per_sample``; a square term makes batch 1's estimate
  too large, so the search meets out-of-memory errors and must recover from them).
- time: a micro-step of ``b`` samples takes ``seconds(b) = fixed_s + per_sample_s * b``. No
  sleep: the device moves the process's ``time.perf_counter`` on by that much when the step's
  backward ends (``ScriptedClock``), so every clock of the profiler and the runtime reads the
  scripted compute, plus the real (tiny) compute of the model, which is at most ``noise_s``.

- communication: with a ``ScriptedLink``, every tensor collective of the attached runtime takes
  ``latency_s + bus bytes / bandwidth`` more on the clock (the ring's bus bytes,
  ``poplar.planner.cost_model.bus_bytes``), inside the collective: what the comm ledger records
  and a micro-step's wall time both include it, so the profiler must subtract it from compute.

It plugs into the profiler like a real GPU (``poplar.profiler.devices.Device``, no profiling
observer) beside the emulator's ``VirtualDevice``, which instead counts real tensors and sleeps.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from poplar.planner.cost_model import bus_bytes
from poplar.profiler.devices import OOM_ERROR, Device
from poplar.types.topology import Link, Wire


@dataclass(frozen=True)
class Script:
    """One device type's numbers: memory in bytes, compute seconds of a micro-step."""

    device_type: str
    capacity_bytes: int
    base_bytes: int
    bytes_per_sample: int
    fixed_s: float
    per_sample_s: float
    bytes_per_sample_squared: int = 0

    def activation_bytes(self, batch: int) -> int:
        return self.bytes_per_sample * batch + self.bytes_per_sample_squared * batch * batch

    @property
    def mbs(self) -> int:
        batch = 0
        while self.base_bytes + self.activation_bytes(batch + 1) <= self.capacity_bytes:
            batch += 1
        return batch

    def seconds(self, batch: int) -> float:
        return self.fixed_s + self.per_sample_s * batch


class ScriptedClock:
    """``time.perf_counter`` moved on by scripted seconds (``advance``): installed over the
    ``time`` module's function while the block of ``installed`` runs, so every module that reads
    ``time.perf_counter()`` (the profiler's timers, the runtime's iteration clock, the comm
    ledger) sees the scripted compute. Nothing in the product sets a deadline on this clock."""

    def __init__(self) -> None:
        self.offset = 0.0
        self._real = time.perf_counter

    def perf_counter(self) -> float:
        return self._real() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    @contextlib.contextmanager
    def installed(self) -> Iterator["ScriptedClock"]:
        time.perf_counter = self.perf_counter
        try:
            yield self
        finally:
            time.perf_counter = self._real


@dataclass(frozen=True)
class LinkScript:
    """A link's numbers: a collective of ``bus`` bytes takes ``latency_s + bus / bandwidth``."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def seconds(self, op: str, nbytes: int, ranks: int) -> float:
        return self.latency_s + bus_bytes(op, nbytes, ranks) / self.bandwidth_bytes_per_s


class ScriptedLink:
    """A ``CollectiveObserver`` that moves ``clock`` on by the scripted seconds of each tensor
    collective when it is done. ``links``: the script of each ``Link`` a collective may run on,
    or of a link and the exact ranks on it (``(Link.INTRA, (0, 1))``: one node's own), which comes
    first; a link with no script costs nothing. ``heard`` keeps (op, bytes, link, seconds)."""

    def __init__(self, clock: ScriptedClock, links: dict[Any, LinkScript]) -> None:
        self.clock, self.links = clock, links
        self.heard: list[tuple[str, int, Link, float]] = []

    def issued(self, op: str, nbytes: int, wire: Wire) -> tuple[str, int, Wire]:
        return op, nbytes, wire

    def done(self, ticket: tuple[str, int, Wire]) -> None:
        op, nbytes, wire = ticket
        script = self.links.get((wire.link, tuple(wire.ranks)), self.links.get(wire.link))
        seconds = script.seconds(op, nbytes, len(wire.ranks)) if script is not None else 0.0
        self.heard.append((op, nbytes, wire.link, seconds))
        self.clock.advance(seconds)


class ScriptedDevice(Device):
    """A device whose memory and compute time follow ``script`` (see the module doc), and whose
    runtime's collectives ride ``link`` while attached (None: they cost their real time)."""

    def __init__(self, script: Script, clock: ScriptedClock, name: str | None = None,
                 link: ScriptedLink | None = None) -> None:
        super().__init__(name or script.device_type, script.device_type, torch.device("cpu"))
        self.script, self.clock, self.link = script, clock, link
        self._activations = 0
        self._peak = script.base_bytes
        self.started: list[int] = []  # batch of every micro-step whose forward ran
        self.steps: list[int] = []  # batch of every micro-step that ran to its end

    @property
    def capacity_bytes(self) -> int:
        return self.script.capacity_bytes

    def memory_in_use(self) -> int:
        return self.script.base_bytes + self._activations

    def reset_peak(self) -> None:
        self._peak = self.memory_in_use()

    def peak(self) -> int:
        return self._peak

    def supports(self, precision: Any) -> bool:
        return True

    def static_bytes(self) -> int | None:
        return self.script.base_bytes

    @contextlib.contextmanager
    def _attached(self, runtime: Any) -> Iterator[None]:
        with runtime.comm.observed(self.link):
            yield

    def abort_step(self) -> None:
        super().abort_step()
        self._activations = 0

    def micro_step_abort(self, step: Any, error: BaseException) -> None:
        super().micro_step_abort(step, error)
        self._activations = 0

    def _forward_end(self) -> None:
        batch = self._open.batch if self._open is not None else 0
        self.started.append(batch)
        self._activations = self.script.activation_bytes(batch)
        self._peak = max(self._peak, self.memory_in_use())
        if self.memory_in_use() > self.capacity_bytes:
            self._open, self._activations = None, 0
            self.last_failure = {"where": "forward end", "batch": batch,
                                 "usage": self.script.base_bytes + self.script.activation_bytes(batch)}
            raise OOM_ERROR(f"scripted device {self.name}: batch {batch} needs "
                            f"{self.last_failure['usage']} bytes > capacity {self.capacity_bytes}")

    def _backward_end(self) -> None:
        step = self._open
        if step is not None:
            self.clock.advance(self.script.seconds(step.batch))
            self.steps.append(step.batch)
        super()._backward_end()
        self._activations = 0
