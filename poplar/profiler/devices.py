"""What the profiler needs from a device, shared by the CUDA device and the virtual (CPU) one.

A device is *attached* to a ZeRO runtime for a while (``with device.attach(runtime): ...``).
It is a ``StepObserver`` of the runtime's step:

- ``forward_start`` opens the micro-step (the memory in use *before* the forward is read here);
- ``backward_start`` reads the memory in use *after* the forward (loss included), and
  ``backward_end`` closes the step once the runtime has completed the micro-step.

Each micro-step leaves a ``StepMemory`` (before forward, after forward, peak) in
``device.last_step``; the capacity search reads it for Algorithm 1's first loop.

Out of memory is one error type on every device: ``torch.OutOfMemoryError`` (the class that
``torch.cuda.OutOfMemoryError`` names; it can be raised on CPU-only builds too), recognised by
``is_oom`` even when wrapped (the runtime reports a failed micro-step as a ``DistributedError``
whose ``__cause__`` is the original error).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
import gc
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator

import torch

from poplar.types.batches import move_to_device
from poplar.zero.observers import MicroStep, StepObserver
from poplar.zero.runtime import ZeroRuntime

OOM_ERROR = torch.OutOfMemoryError  # == torch.cuda.OutOfMemoryError


def is_oom(exc: BaseException | None) -> bool:
    """True if ``exc`` or anything in its cause/context chain is an out-of-memory error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OOM_ERROR):
            return True
        if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower() and "CUDA" in str(exc):
            return True  # older builds raise a plain RuntimeError("CUDA out of memory ...")
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass
class StepMemory:
    """Memory of one micro-step, bytes: in use before the forward, in use when backward starts
    (the forward's saved activations, loss included), and the peak during the step."""

    batch: int
    before_forward: int
    after_forward: int
    peak: int


class DeviceKind(Enum):
    """What a profiler device is: a GPU measured for real, or a CPU emulating one."""

    CUDA = "cuda"
    VIRTUAL = "virtual"

    def __str__(self) -> str:
        return self.value


class Device(StepObserver, ABC):
    """Base class: the probes the profiler reads and the micro-step hooks both devices share.

    Subclasses define ``memory_in_use``, ``capacity_bytes``, ``reset_peak``/``peak`` and may
    override ``_forward_start`` / ``_forward_end`` / ``_backward_end`` (the virtual device pads
    compute time there).

    What only some devices can do is declared here with a neutral default, so the profiler never
    asks which device it has: ``static_bytes`` (None: model states are not counted apart),
    ``supports`` (True: every precision),
    ``unpadded`` and ``recording_overflows`` (no-ops: compute is never stretched, and an
    out-of-memory error is always raised), ``late_steps`` and ``last_failure`` (never set), and
    ``profile_meta`` (nothing to record).
    """

    kind: DeviceKind

    def __init__(self, name: str, device_type: str, torch_device: torch.device,
                 nominal_tflops: float | None = None) -> None:
        self.name, self.device_type, self.torch_device = name, device_type, torch.device(torch_device)
        self.nominal_tflops = nominal_tflops
        self.last_step: StepMemory | None = None
        self.runtime: ZeroRuntime | None = None
        self.late_steps = 0  # micro-steps whose real compute overshot the device's speed curve
        self.last_failure: dict[str, Any] | None = None  # what the device saw at the last OOM it raised itself
        self.overflows: list[dict[str, Any]] = []  # memory overflows recorded instead of raised
        self._open: dict[str, Any] | None = None  # the micro-step in progress
        self.link: Any = None  # an emulated interconnect (``comm.LinkPacing``) pacing its collectives

    # ---- probes (subclasses) ----
    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        ...

    @abstractmethod
    def memory_in_use(self) -> int:
        ...

    @abstractmethod
    def reset_peak(self) -> None:
        ...

    @abstractmethod
    def peak(self) -> int:
        ...

    def synchronize(self) -> None:
        """Wait for queued work (a no-op on CPU), so wall-clock timing is honest."""

    def release(self) -> None:
        """Give memory back after an out-of-memory error (the failed step's tensors are gone by
        now; collect reference cycles)."""
        gc.collect()

    def static_bytes(self) -> int | None:
        """Bytes of model states the device counts for the attached runtime (params, grads,
        optimizer state as after the first step, buffers), or None where it sees only the
        allocator's total."""
        return None

    def supports(self, precision: Any) -> bool:
        """Whether the device computes in ``precision`` (a ``Precision``); True unless a
        subclass knows better (a CUDA device without bf16, a preset that lacks it)."""
        return True

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "device_type": self.device_type, "kind": self.kind.value,
                "capacity_bytes": self.capacity_bytes, "nominal_tflops": self.nominal_tflops}

    def profile_meta(self) -> dict[str, Any]:
        """What a profile measured on this device records about it in ``Profile.meta``."""
        return {}

    # ---- temporary switches ----
    @contextlib.contextmanager
    def unpadded(self) -> Iterator[None]:
        """Run steps at the hardware's own speed until the block ends (steps that are not timed,
        like the capacity search's trials)."""
        yield

    @contextlib.contextmanager
    def recording_overflows(self) -> Iterator[list[dict[str, Any]]]:
        """Until the block ends, record memory overflows in the yielded list instead of raising
        them (a lock-step round must not raise inside a collective). A device whose allocator
        raises by itself records nothing: its OOM fails the round on every rank instead."""
        self.overflows.clear()
        yield self.overflows

    def pacing(self, comm: Any) -> contextlib.AbstractContextManager:
        """Pace ``comm``'s tensor collectives by this device's emulated link while the block
        runs (``Communicator.paced``; nothing for a device without one)."""
        return comm.paced(self.link)

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
    def forward_start(self, step: MicroStep) -> None:
        if self._open is not None:  # the model is called again inside the same micro-step
            return
        self.reset_peak()
        self._open = {"batch": step.batch_size, "before": self.memory_in_use(), "t0": time.perf_counter(),
                      "c0": self.runtime.comm_ledger.total_seconds}
        self._forward_start()

    def forward_end(self, step: MicroStep) -> None:
        if self._open is not None and not self._open.get("forward_done"):
            self._open["forward_done"] = True
            self._forward_end()

    def backward_start(self, step: MicroStep, loss: torch.Tensor) -> None:
        self._backward_start(loss)

    def backward_end(self, step: MicroStep) -> None:
        self._backward_end()

    def micro_step_abort(self, step: MicroStep, error: BaseException) -> None:
        self._open = None

    def _backward_start(self, loss: torch.Tensor) -> None:
        if self._open is None:
            return
        self._open["after"] = self.memory_in_use()

    def _backward_end(self) -> None:
        step = self._open
        if step is None:
            return
        self.last_step = StepMemory(step["batch"], step["before"], step.get("after", step["before"]), self.peak())
        self._open = None

    def _forward_start(self) -> None:
        pass

    def _forward_end(self) -> None:
        pass

    # ---- helpers for subclasses ----
    def _compute_s(self, step: dict[str, Any], now: float | None = None) -> float:
        """Seconds of the open micro-step so far, less the seconds spent in collectives."""
        now = time.perf_counter() if now is None else now
        return now - step["t0"] - (self.runtime.comm_ledger.total_seconds - step["c0"])


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor moved to ``device`` (asynchronously where the copy allows)."""
    return move_to_device(batch, device, non_blocking=True)


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter() >= deadline``: a coarse sleep, then a short spin for the
    last ~0.2 ms (a bare ``time.sleep`` overshoots by ~0.1 ms, 2-3 % of a 5 ms step)."""
    remaining = deadline - time.perf_counter()
    if remaining > 3e-4:
        time.sleep(remaining - 2e-4)
    while time.perf_counter() < deadline:
        pass


TimeFn = Callable[[int], float]
