"""PoplarEngine: the front door. The ZeRO runtime (``poplar.zero.runtime``) on a plan that is
either given or planned automatically (``poplar.auto``: profile every rank's device, then plan).
The training loop sits above it, in ``poplar.train`` (``poplar.fit(engine, data, iterations)``).

Construction is in order and hands nothing half-built to anyone: auto mode (if asked for) runs
first on the communicator alone and returns a plan; the runtime is then built on that plan; a
virtual device found by auto mode is attached last, as an observer of the step.
"""

from __future__ import annotations

import gc

from typing import Any

import torch
from torch import nn

from poplar.auto import AutoOptions, AutoResult, auto_plan
from poplar.comm import Communicator
from poplar.profiler.devices import Device, DeviceKind
from poplar.types.plans import Plan
from poplar.types.precision import MixedPrecision
from poplar.types.profiles import Profile
from poplar.zero.nonfinite import NonFinitePolicy
from poplar.zero.runtime import LossFn, ZeroRuntime
from poplar.zero.timeline import MicroStepTimeline

class PoplarEngine(ZeroRuntime):
    """ZeRO-0/1/2/3 data parallelism with a per-rank plan. Every rank builds it together.

    With a plan: ``PoplarEngine(model, optimizer, zero_stage=..., plan=...)``; the arguments are
    those of ``ZeroRuntime`` (``max_grad_norm``, ``bucket_size_mb``, ``wrap_policy``,
    ``process_group``, ``communicator``, ``loss_fn``, ``mixed_precision``, ``nonfinite``,
    ``max_consecutive_skips``). ``mixed_precision``: None or "fp32", "bf16", "fp16" or a
    ``poplar.MixedPrecision``; ``engine.loss_scale``, ``engine.loss_scaler`` (fp16) and
    ``engine.skipped_steps`` tell how it goes.

    Auto mode (no ``plan``; see ``poplar.auto``): give ``global_batch_size`` and ``loss_fn``
    instead, and the engine profiles every rank's device (largest micro-batch, speed curve),
    plans with ``auto.strategy`` and logs the plan; ``zero_stage`` is raised if the model does
    not fit batch 1 somewhere.
    By default (``AutoOptions.choose="fastest"``) auto mode tries every ZeRO stage with activation
    checkpointing off and on (``activation_checkpointing=None``; a value given fixes it) and
    runs the configuration with the shortest predicted iteration that fits every rank; the
    candidate table is logged and kept in ``plan.meta["candidates"]``.

        global_batch_size: samples per optimizer step.
        loss_fn: ``loss_fn(module, micro_batch)`` -> mean loss, or ``(loss_sum, count)`` for
            token-weighted losses (docs/design.md §2); also ``train_step``'s default.
        profile_data: what profiling trains on: a map-style dataset or ``sample_fn(b)``
            (a batch of ``b`` samples).
        cluster: on CPU, emulate this cluster (a ``ClusterSpec``, a built-in name or a cluster
            JSON file): rank r runs as its r-th device (a ``VirtualDevice``: memory cap, speed).
        device: this rank's device instead (a ``VirtualDevice`` or ``CudaDevice``); on CUDA it
            defaults to the model's GPU.
        auto: ``AutoOptions`` (strategy, a saved profile to reuse, profiling knobs).
    With a virtual device the engine keeps it attached while training: compute is stretched to
    the device's speed and its memory cap is enforced (``engine.close()`` detaches it).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, zero_stage: int = 0,
                 plan: Plan | None = None, process_group: Any = None, max_grad_norm: float | None = None,
                 bucket_size_mb: float = 25.0, wrap_policy: Any = None, communicator: Communicator | None = None,
                 global_batch_size: int | None = None, loss_fn: LossFn | None = None, profile_data: Any = None,
                 cluster: Any = None, device: Device | None = None, auto: AutoOptions | None = None,
                 mixed_precision: MixedPrecision | str | None = None,
                 nonfinite: NonFinitePolicy | str = NonFinitePolicy.SKIP,
                 max_consecutive_skips: int = 5, activation_checkpointing: Any = None) -> None:
        comm = communicator if communicator is not None else Communicator(process_group,
                                                                           next(model.parameters()).device)
        self.auto_result: AutoResult | None = None
        if plan is None and global_batch_size is not None:
            self.auto_result = auto_plan(comm, model, optimizer, global_batch_size=global_batch_size,
                                         zero_stage=zero_stage, loss_fn=loss_fn, profile_data=profile_data,
                                         cluster=cluster, device=device, options=auto, bucket_size_mb=bucket_size_mb,
                                         wrap_policy=wrap_policy, mixed_precision=mixed_precision,
                                         activation_checkpointing=activation_checkpointing)
            plan, zero_stage, device = self.auto_result.plan, self.auto_result.plan.zero_stage, \
                self.auto_result.device
            activation_checkpointing = self.auto_result.activation_checkpointing
        elif isinstance(plan, Plan) and global_batch_size is not None and global_batch_size != plan.global_batch_size:
            raise ValueError(f"global_batch_size={global_batch_size} but the plan's rows sum to "
                             f"{plan.global_batch_size}; give one of them")
        super().__init__(model, optimizer, plan=plan, zero_stage=zero_stage, max_grad_norm=max_grad_norm,
                         bucket_size_mb=bucket_size_mb, wrap_policy=wrap_policy, communicator=comm, loss_fn=loss_fn,
                         mixed_precision=mixed_precision, nonfinite=nonfinite,
                         max_consecutive_skips=max_consecutive_skips, activation_checkpointing=activation_checkpointing)
        self.device: Device | None = device
        self.timeline = MicroStepTimeline()
        self.add_observer(self.timeline)
        self._device_ctx: Any = None
        if device is not None and device.kind is DeviceKind.VIRTUAL:
            self._device_ctx = device.attach(self)
            self._device_ctx.__enter__()

    @property
    def profile(self) -> Profile | None:
        """The profile auto mode measured or loaded (None with a given plan)."""
        return self.auto_result.profile if self.auto_result is not None else None

    def close(self) -> None:
        """Detach the virtual device (auto mode on an emulated cluster); the engine stays usable
        at CPU speed without a memory cap. Also collects the reference cycles profiling and training
        left behind, while ``torch.distributed`` is still up: freed later, during interpreter
        shutdown, their gloo resources can abort a finished process (SIGABRT, "terminate called
        without an active exception"). Call it before ``destroy_process_group()``."""
        if self._device_ctx is not None:
            ctx, self._device_ctx = self._device_ctx, None
            ctx.__exit__(None, None, None)
        gc.collect()

    def __enter__(self) -> "PoplarEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
