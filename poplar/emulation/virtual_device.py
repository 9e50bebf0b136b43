"""A virtual device: a GPU emulated on CPU, with a memory capacity and a known speed curve.

Memory. While attached to a runtime, the device's usage is

    model states (params + grads + optimizer state as after the first step + module buffers,
                  and under mixed precision the fp32 master weights: every key of the
                  runtime's ``memory_report`` but its communication buffers; an offloading
                  rank's host copies, ``host_*`` keys, are host memory: ``host_bytes``)
  + saved activations (every tensor autograd saves for backward, counted once per storage
    through ``torch.autograd.graph.saved_tensors_hooks``; parameters are not activations)
  + communication buffers the stage holds right now (stage-2 buckets, ...)
  + parameters gathered right now (stage 3: ``stage.gathered_bytes``)

checked whenever it can grow: when a tensor is saved, when stage 3 allocates a gathered block
(the runtime's ``transient_allocated`` point), when a gradient lands, and at the start and end
of forward and backward. Usage above the capacity raises ``torch.OutOfMemoryError``, the error
CUDA raises, so the profiler has one recovery path. (An overflow seen when a gradient lands is
raised when backward returns: an exception inside autograd's post-accumulate-grad hooks leaves
the rest of the graph, and its saved activations, alive until the next backward — measured on
torch 2.13.) With ``raise_oom=False`` (``with device.recording_overflows():``) the device only
records overflows (used in lock-step rounds, where raising could leave other ranks waiting; the
profiler checks the record at an agreement point). Usage grows linearly with the batch, so the
largest fitting batch is well defined: the batch whose peak is the last below the capacity.

Speed (``speed_padding.SpeedPadding``): each micro-step's compute is stretched by sleeping so
that it takes the device's curve ``time_s(b)`` (or ``slowdown`` times the real compute); the
backward is padded before autograd runs, so collectives come when a GPU's would; at ZeRO-3 both
passes are paced block by block instead (``block_pacing``). The real CPU
compute must stay below the curve (calibration picks the time scale so); ``late_steps`` of
``padded_steps`` overshot it. An offloading rank's copies of its optimizer shard (the runtime's
``host_copy`` point) take as long as the preset's host link would (``host_link_bytes_per_s``);
its host optimizer step is real CPU work. Attached to a runtime with activation checkpointing, a micro-step
takes ``1 + forward_fraction`` times the curve (the forward runs again in backward), and the
recomputation's saved tensors are counted while they live (``SavedTensors.recomputed``).

Precision. A device made from a preset (``PresetCurve``) pads to the preset's curve at the
precision it computes in: fp16 / bf16 divide the curve's throughput part by the preset's dtype
factor. By default the device follows the runtime it is attached to (its ``mixed_precision``
policy; fp32 when detached); ``precision=`` fixes it instead (auto mode and ``emulate`` do), and
attaching to a runtime of another precision is then an error. A preset without bf16 (V100, T4)
refuses bf16 either way. Memory needs nothing: saved activations and the runtime's model
states (the fp32 master included) are counted at their real dtypes.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

from poplar.emulation.block_pacing import BlockHooks
from poplar.profiler.devices import OOM_ERROR, Device
from poplar.emulation.faults import FaultSchedule
from poplar.emulation.memory import (gathered_bytes, host_state_bytes, model_state_bytes, predicted_optimizer_bytes,
                                     transient_bytes)
from poplar.profiler.precision import runtime_precision
from poplar.emulation.saved_tensors import SavedTensors
from poplar.emulation.profiling_phases import ProfilingPhases
from poplar.emulation.speed_padding import PaddedStep, SpeedPadding, sleep_until
from poplar.emulation.speed_curves import PresetCurve, SaturatingCurve
from poplar.emulation.cluster import ClusterSpec
from poplar.types.precision import Precision
from poplar.zero.observers import CopyDirection
from poplar.emulation.presets import PresetError, get_preset
from poplar.types.precision import precision_of, precision_unsupported_message

__all__ = ["PresetCurve", "SaturatingCurve", "VirtualDevice"]

MIB = 2 ** 20


class VirtualDevice(ProfilingPhases, SpeedPadding, Device):
    """An emulated GPU on CPU.

    Args:
        name: device name (e.g. a preset name).
        capacity_bytes: memory the device offers.
        time_fn: seconds of compute for a micro-step of ``b`` samples (the device pads to it).
        slowdown: instead of ``time_fn``: compute takes this many times the real compute.
        forward_fraction: share of ``time_fn(b)`` spent in the forward.
        device_type: type name shared by ranks with the same curve (default: ``name``).
        nominal_tflops: spec-sheet rating, for the ``flops`` baseline only.
        precision: the precision it emulates (see the module doc); None: the attached runtime's.
        backward_room: share of ``time_fn(b)`` left for the real backward after its pad, at
            least (``speed_padding``; calibration sets its margin).
    """

    def __init__(self, name: str, capacity_bytes: int, *, time_fn: Callable[[int], float] | None = None,
                 slowdown: float | None = None, forward_fraction: float = 1 / 3, device_type: str | None = None,
                 nominal_tflops: float | None = None, raise_oom: bool = True, precision: Any = None,
                 backward_room: float = 0.0) -> None:
        super().__init__(name, device_type or name, torch.device("cpu"), nominal_tflops)
        if not (isinstance(capacity_bytes, (int, float)) and capacity_bytes > 0):
            raise ValueError(f"virtual device {name}: capacity_bytes must be > 0, got {capacity_bytes!r}")
        if time_fn is not None and slowdown is not None:
            raise ValueError(f"virtual device {name}: give time_fn or slowdown, not both")
        if slowdown is not None and not slowdown >= 1:
            raise ValueError(f"virtual device {name}: slowdown must be >= 1, got {slowdown}")
        if not 0 < forward_fraction < 1:
            raise ValueError(f"virtual device {name}: forward_fraction must be in (0, 1), got {forward_fraction}")
        self._capacity = int(capacity_bytes)
        self.time_fn, self.slowdown, self.forward_fraction = time_fn, slowdown, forward_fraction
        self.raise_oom = raise_oom  # off: record overflows in ``overflows`` instead
        self.overflows: list[dict[str, Any]] = []  # memory overflows recorded instead of raised
        self.late_steps = 0  # micro-steps whose real compute overshot the device's speed curve
        self.link: Any = None  # the emulated interconnect its collectives ride (``VirtualLink``, ``VirtualNetwork``)
        self.pad = True  # stretch compute to the speed model (off: run at CPU speed)
        self.memory_scale: float | None = None
        self.time_scale: float | None = None
        self.cluster: ClusterSpec | None = None  # the emulated cluster this device is a rank of
        # memory state
        self._static = 0
        self._host = 0  # an offloading rank's optimizer state and fp32 master copies: host memory, not counted
        self._predicted_optimizer: int | None = None
        self._saved = SavedTensors(on_saved=self._tensor_saved,  # (bound methods: the device pickles)
                                   on_recomputed=self._tensor_recomputed)
        # activation checkpointing recomputes the forward in backward: one more forward's time
        self._recompute_factor = 1.0
        self._static_iteration: int | None = None
        self._deferred: dict[str, Any] | None = None  # an OOM seen inside backward, raised when it returns
        self._failed = False  # an OOM was raised in this micro-step: the runtime's clean-up must not raise again
        self._peak = 0
        self._checks = 0
        self._injections: list[dict[str, Any]] = []
        self.faults: FaultSchedule | None = None  # injected drift (poplar.emulation.faults)
        self._init_padding(backward_room)
        # precision: fixed at construction (None: the attached runtime's, fp32 when detached)
        self.fixed_precision: Precision | None = None if precision is None else precision_of(precision)
        self._use_precision(self.fixed_precision or Precision.FP32)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_preset(cls, preset: Any, memory_scale: float, time_scale: float, **kwargs: Any) -> "VirtualDevice":
        """A device with ``preset``'s memory times ``memory_scale`` and its speed curve with times
        multiplied by ``time_scale`` (``poplar.emulation.presets.DevicePreset``, or its name);
        ``precision=`` (keyword) fixes the precision it emulates."""
        if isinstance(preset, str):
            preset = get_preset(preset)
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        scale = float(time_scale)
        dev = cls(preset.name, preset.capacity_bytes(memory_scale), time_fn=PresetCurve(preset.name, scale),
                  device_type=preset.name, nominal_tflops=preset.nominal_tflops, **kwargs)
        dev.memory_scale, dev.time_scale = memory_scale, scale
        return dev

    # ------------------------------------------------------------------ precision
    @property
    def precision(self) -> Precision:
        """The precision the device emulates now (its curve's)."""
        return self._precision

    @property
    def preset_name(self) -> str | None:
        return self.time_fn.preset if isinstance(self.time_fn, PresetCurve) else None

    def supports(self, precision: Any) -> bool:
        name = self.preset_name
        return name is None or get_preset(name).supports(precision)

    def _use_precision(self, precision: Precision) -> None:
        if not self.supports(precision):
            raise PresetError(f"virtual device {self.name}: "
                              + precision_unsupported_message(precision, {self.name: []}))
        self._precision = precision
        if isinstance(self.time_fn, PresetCurve):
            self.time_fn = self.time_fn.at(precision)

    # ------------------------------------------------------------------ probes
    @property
    def capacity_bytes(self) -> int:
        return self._capacity if self.faults is None else self.faults.capacity(self._capacity, self.runtime)

    def time_s(self, batch: int) -> float:
        """The device's true compute seconds for a micro-step of ``batch`` samples."""
        if self.time_fn is None:
            raise ValueError(f"virtual device {self.name} has a slowdown factor, not a time curve")
        return float(self.time_fn(batch)) * (1.0 if self.faults is None else self.faults.time_factor(self.runtime)) \
            * self._recompute_factor

    @property
    def pads(self) -> bool:
        """Whether compute is being stretched now (a speed model is set and padding is on)."""
        return self.pad and (self.time_fn is not None or self.slowdown is not None)

    @property
    def saved_bytes(self) -> int:
        return self._saved.bytes

    def gathered_bytes(self) -> int:
        return gathered_bytes(self.runtime.stage) if self.runtime is not None else 0

    def static_bytes(self) -> int:
        return self._static

    def host_link_bytes_per_s(self) -> float | None:
        """The preset's nominal host link at the emulation's scales (a byte here stands for
        1 / memory_scale bytes of the real model, a second of the real card for time_scale
        seconds here); None for a device not made from a preset."""
        name = self.preset_name
        if name is None or self.memory_scale is None or self.time_scale is None:
            return None
        return get_preset(name).host_link_bytes_per_s * self.memory_scale / self.time_scale

    def host_copy(self, direction: CopyDirection, nbytes: int) -> None:
        """An offloading rank's copies take as long as the preset's host link takes (the CPU's own
        copy is a memory copy, far faster); off a preset, or with padding off, at CPU speed."""
        link = self.host_link_bytes_per_s()
        if self.pad and link:
            sleep_until(time.perf_counter() + nbytes / link)

    def host_bytes(self) -> int:
        """Host memory the attached runtime keeps for this rank (its offloaded optimizer state,
        fp32 master and gradient copies), outside the device's memory count."""
        return self._host

    def memory_in_use(self) -> int:
        if self.runtime is None:
            return self._saved.bytes
        stage = self.runtime.stage
        return self._static + self._saved.bytes + transient_bytes(stage) + gathered_bytes(stage)

    def reset_peak(self) -> None:
        self._peak = self.memory_in_use()

    def peak(self) -> int:
        return self._peak

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"memory_scale": self.memory_scale, "time_scale": self.time_scale,
                  "slowdown": self.slowdown, "precision": str(self.precision), "emulated": True})
        return d

    # ------------------------------------------------------------------ memory checks
    def inject_oom(self, batch: int | None = None, *, min_batch: int | None = None, after_checks: int = 1,
                   where: str | None = None) -> None:
        """Test hook: in the next micro-step of ``batch`` samples (or of at least ``min_batch``; any if
        neither), raise an OOM at the ``after_checks``-th memory check, counting only checks at
        ``where`` if given ('saved', 'gather', 'grad', 'forward start', ...). Fires once."""
        self._injections.append({"batch": batch, "min_batch": min_batch, "after": after_checks, "where": where,
                                 "seen": 0})

    def check(self, where: str) -> None:
        usage = self.memory_in_use()
        if usage > self._peak:
            self._peak = usage
        self._checks += 1
        step = self._open
        batch = step.batch if step else None
        for inj in list(self._injections):
            if step and (inj["batch"] is None or inj["batch"] == batch) and (
                    inj["min_batch"] is None or batch >= inj["min_batch"]) and inj["where"] in (None, where):
                inj["seen"] += 1
                if inj["seen"] >= inj["after"]:
                    self._injections.remove(inj)
                    self._fail(where, f"injected out-of-memory at {where} (batch {batch}, usage "
                                      f"{usage / MIB:.3f} MiB)", force=True)
        if usage > self.capacity_bytes:
            self._fail(where, f"virtual device {self.name}: out of memory at {where}: usage {usage / MIB:.3f} MiB > "
                              f"capacity {self.capacity_bytes / MIB:.3f} MiB (batch {batch}; model states "
                              f"{self._static / MIB:.3f}, activations {self._saved.bytes / MIB:.3f}, gathered "
                              f"{self.gathered_bytes() / MIB:.3f} MiB)")

    def _fail(self, where: str, message: str, force: bool = False) -> None:
        batch = self._open.batch if self._open else None
        if not (self.raise_oom or force):
            self.overflows.append({"message": message, "batch": batch, "where": where})
            return
        if self._failed or self._deferred is not None:
            return  # the failed micro-step is being cleaned up (its activations are still referenced)
        failure = {"where": where, "batch": batch, "usage": self.memory_in_use(), "saved": self._saved.bytes,
                   "gathered": self.gathered_bytes(), "message": message}
        if where in ("grad", "recompute"):  # inside autograd: raised when backward returns
            # Inside autograd's post-accumulate-grad hooks an exception leaks the rest of the graph
            # (its saved tensors stay alive until the next backward; seen on torch 2.13), so the OOM
            # is raised when backward returns: the step still fails, and its memory is released.
            self._deferred = failure
            return
        self._raise(failure)

    def _raise(self, failure: dict[str, Any]) -> None:
        self._failed = True
        self._open = None
        self.last_failure = failure
        raise OOM_ERROR(failure["message"])

    def _tensor_recomputed(self) -> None:
        self.check("recompute")

    def _tensor_saved(self) -> None:
        self.check("saved")

    def collectives_completing(self, step: Any) -> None:
        if self._open is not None:
            self._open.compute_over = True

    def transient_allocated(self) -> None:
        """A gathered block's memory is checked while the micro-step computes; once its compute
        is over, or outside a micro-step, the gathers only keep the ranks' collectives matched and
        an out-of-memory error raised there would leave the other ranks inside them."""
        if self._open is not None and not self._open.compute_over:
            self.check("gather")

    def refresh_static(self, force: bool = False) -> None:
        """Re-read the runtime's model-state bytes (optimizer state as after the first step); they
        change only between iterations."""
        if not force and self._static_iteration == self.runtime.iteration:
            return
        self._static_iteration = self.runtime.iteration
        if self._predicted_optimizer is None:
            self._predicted_optimizer = predicted_optimizer_bytes(self.runtime.optimizer)
        states = model_state_bytes(self.runtime, self._predicted_optimizer)
        self._static = sum(states.values())
        self._host = sum(host_state_bytes(self.runtime, self._predicted_optimizer).values())

    @contextlib.contextmanager
    def _attached(self, runtime: Any) -> Iterator[None]:
        running = runtime_precision(runtime)
        if self.fixed_precision is not None and running is not self.fixed_precision:
            raise ValueError(f"virtual device {self.name} emulates {self.fixed_precision} but the runtime computes "
                             f"in {running}: build the runtime with mixed_precision=\"{self.fixed_precision}\" or "
                             f"the device with precision=\"{running}\"")
        self._use_precision(running)
        try:
            with self._attached_hooks(runtime), self.pacing(runtime.comm):
                yield
        finally:
            self._use_precision(self.fixed_precision or Precision.FP32)

    @contextlib.contextmanager
    def _attached_hooks(self, runtime: Any) -> Iterator[None]:
        self._predicted_optimizer = None
        self.refresh_static(force=True)
        grad_hooks = [p.register_post_accumulate_grad_hook(lambda p: self.check("grad"))
                      for p in runtime.module.parameters() if p.requires_grad]
        hooks = self._saved.hooks()
        checkpointing = runtime.activation_checkpointing
        recompute = checkpointing.add_recompute_context(self._saved.recomputed)
        self._recompute_factor = 1.0 + self.forward_fraction if checkpointing.enabled else 1.0
        names = runtime.stage.block_names()
        self._blocks = BlockHooks(runtime.module, names, self) if names else None  # per-block padding
        hooks.__enter__()
        try:
            yield
        finally:
            hooks.__exit__(None, None, None)
            if self._blocks is not None:
                self._blocks.remove()
                self._blocks = None
            recompute.remove()
            self._recompute_factor = 1.0
            for h in grad_hooks:
                h.remove()

    # ------------------------------------------------------------------ micro-step hooks
    def _open_step(self, batch: int) -> PaddedStep:
        return PaddedStep(batch, self.memory_in_use(), t0=time.perf_counter(),
                          c0=self.runtime.comm_ledger.total_seconds)

    def _forward_start(self) -> None:
        self._failed, self._deferred = False, None
        self.refresh_static()
        # storages parameters live in now (stage 0-2 flat buffers, the stage-3 root unit); the
        # stage-3 blocks gathered later are recognised as parameters by type (SavedTensors.pack)
        self._saved.param_keys = {k for k in (p.untyped_storage().data_ptr() for p in self.runtime.module.parameters())
                            if k}
        self.check("forward start")

    def _forward_end(self) -> None:
        self.check("forward end")
        if self._open is not None and self.pads:
            self._pad_forward(self._open)

    def _backward_start(self, loss: torch.Tensor) -> None:
        super()._backward_start(loss)
        self.check("backward start")
        step = self._open
        if step is not None and self.pads and torch.is_tensor(loss) and loss.requires_grad:
            self._pad_backward_start(step, loss)

    def _backward_end(self) -> None:
        if self._deferred is not None:
            failure, self._deferred = self._deferred, None
            self._raise(failure)
        step = self._open
        if step is not None and self.pads and self.slowdown is None:
            self._top_up(step)
        if step is not None:
            self.check("backward end")
        super()._backward_end()
