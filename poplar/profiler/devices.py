"""What the profiler needs from a device: the probes a GPU really has, and the micro-step hooks.

A device is *attached* to a ZeRO runtime for a while (``with device.attach(runtime): ...``).
It is a ``StepObserver`` of the runtime's step:

- ``forward_start`` opens the micro-step (the memory in use *before* the forward is read here);
- ``backward_start`` reads the memory in use *after* the forward (loss included), and
  ``backward_end`` closes the step once the runtime has completed the micro-step.

Each micro-step leaves a ``StepMemory`` (before forward, after forward, peak) in
``device.last_step``; the capacity search reads it for Algorithm 1's first loop.

Out of memory is one error type on every device: ``torch.OutOfMemoryError`` (the class that
``torch.cuda.OutOfMemoryError`` names; it can be raised on CPU-only builds too), recognised by
``poplar.zero.failures.is_oom`` even when wrapped (the runtime reports a failed micro-step as a
``DistributedError`` whose ``__cause__`` is the original error).

A device that also wants to hear the profiler's phases (an emulated GPU that calibrates itself
for the workload, or must not raise inside a lock-step round) implements
``poplar.profiler.phases.ProfileObserver`` besides this interface.
"""

from __future__ import annotations

import contextlib
import gc
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from poplar.zero.batches import move_to_device
from poplar.zero.observers import MicroStep, StepObserver
from poplar.zero.runtime import ZeroRuntime

OOM_ERROR = torch.OutOfMemoryError  # == torch.cuda.OutOfMemoryError


@dataclass
class StepMemory:
    """Memory of one micro-step, bytes: in use before the forward, in use when backward starts
    (the forward's saved activations, loss included), and the peak during the step."""

    batch: int
    before_forward: int
    after_forward: int
    peak: int


@dataclass
class OpenStep:
    """The micro-step a device is observing: its batch, the memory in use before its forward and
    when its backward started, and whether its forward has ended (a model called again inside
    the same micro-step does not open another)."""

    batch: int
    before: int
    after: int | None = None
    forward_done: bool = False


class Device(StepObserver, ABC):
    """Base class: the probes the profiler reads and the micro-step hooks every device shares.

    Subclasses define ``capacity_bytes``, ``memory_in_use``, ``reset_peak`` / ``peak``,
    ``supports`` and ``static_bytes``, and may override ``_forward_start`` / ``_forward_end`` /
    ``_backward_start`` / ``_backward_end`` and ``_open_step`` (to keep more of a micro-step).
    """

    def __init__(self, name: str, device_type: str, torch_device: torch.device,
                 nominal_tflops: float | None = None) -> None:
        self.name, self.device_type, self.torch_device = name, device_type, torch.device(torch_device)
        self.nominal_tflops = nominal_tflops
        self.last_step: StepMemory | None = None
        self.runtime: ZeroRuntime | None = None
        # what the device measured at the last out-of-memory error it raised itself (usage, where);
        # a GPU's allocator raises before anything is read, so it stays None there
        self.last_failure: dict[str, Any] | None = None
        self._open: OpenStep | None = None  # the micro-step in progress

    # ---- probes (subclasses) ----
    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        ...

    @abstractmethod
    def memory_in_use(self) -> int:
        ...

    def identity(self) -> str:
        """Its name and capacity: a stored profile is reused only on a device of the same
        (``profiler.store``). Stable from run to run: no memory that other processes hold."""
        return f"{self.name}, {self.capacity_bytes} bytes"

    @abstractmethod
    def reset_peak(self) -> None:
        ...

    @abstractmethod
    def peak(self) -> int:
        ...

    @abstractmethod
    def supports(self, precision: Any) -> bool:
        """Whether the device computes in ``precision`` (a ``Precision``, its name or a policy)."""

    @abstractmethod
    def static_bytes(self) -> int | None:
        """Bytes of model states the device counts for the attached runtime (params, grads,
        optimizer state as after the first step, buffers), or None where it sees only the
        allocator's total."""

    def host_link_bytes_per_s(self) -> float | None:
        """The bandwidth of the device's link to host memory where the device states it (an
        emulated GPU: its preset's), else None: the profiler times real copies."""
        return None

    def synchronize(self) -> None:
        """Wait for queued work (a no-op on CPU), so wall-clock timing is honest."""

    def release(self) -> None:
        """Give memory back after an out-of-memory error (the failed step's tensors are gone by
        now; collect reference cycles)."""
        gc.collect()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "device_type": self.device_type, "class": type(self).__name__,
                "capacity_bytes": self.capacity_bytes, "nominal_tflops": self.nominal_tflops}

    # ---- attaching to a runtime ----
    @contextlib.contextmanager
    def attach(self, runtime: ZeroRuntime) -> Iterator["Device"]:
        """Observe ``runtime``'s micro-steps until the block ends."""
        if self.runtime is not None:
            raise RuntimeError(f"device {self.name} is already attached to a runtime")
        self.runtime = runtime
        handle = runtime.add_observer(self)
        try:
            with self._attached(runtime):
                yield self
        finally:
            handle.remove()
            self.runtime = None
            self._open = None

    @contextlib.contextmanager
    def _attached(self, runtime: ZeroRuntime) -> Iterator[None]:
        """Extra set-up of a subclass while attached."""
        yield

    def abort_step(self) -> None:
        """Forget the micro-step in progress (after an error in it)."""
        self._open = None

    # ---- the step's points (StepObserver) ----
    def _open_step(self, batch: int) -> OpenStep:
        """The record of a micro-step that opens now (a subclass may keep more of it)."""
        return OpenStep(batch, self.memory_in_use())

    def forward_start(self, step: MicroStep) -> None:
        if self._open is not None:  # the model is called again inside the same micro-step
            return
        self.reset_peak()
        self._open = self._open_step(step.batch_size)
        self._forward_start()

    def forward_end(self, step: MicroStep) -> None:
        if self._open is not None and not self._open.forward_done:
            self._open.forward_done = True
            self._forward_end()

    def backward_start(self, step: MicroStep, loss: torch.Tensor) -> None:
        self._backward_start(loss)

    def backward_end(self, step: MicroStep) -> None:
        self._backward_end()

    def micro_step_abort(self, step: MicroStep, error: BaseException) -> None:
        self._open = None

    def _backward_start(self, loss: torch.Tensor) -> None:
        if self._open is not None:
            self._open.after = self.memory_in_use()

    def _backward_end(self) -> None:
        step = self._open
        if step is None:
            return
        after = step.after if step.after is not None else step.before
        self.last_step = StepMemory(step.batch, step.before, after, self.peak())
        self._open = None

    def _forward_start(self) -> None:
        pass

    def _forward_end(self) -> None:
        pass


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor moved to ``device`` (asynchronously where the copy allows)."""
    return move_to_device(batch, device, non_blocking=True)
