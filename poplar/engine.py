"""PoplarEngine: the front door. The ZeRO runtime (``poplar.zero.runtime``) on a plan that is
either given or planned automatically (``poplar.auto``: profile every rank's device, then plan).
The training loop sits above it (``poplar.fit`` / ``poplar.train.Trainer``).

Construction is in order and hands nothing half-built to anyone: auto mode (if asked for) runs
first on the communicator alone and returns a plan; the runtime is then built on that plan; the
device auto mode profiled is attached last, as an observer of the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any

import torch
from torch import nn

from poplar.auto import AutoOptions, AutoResult, auto_plan
from poplar.profiler.devices import Device
from poplar.types.plans import Plan
from poplar.types.precision import MixedPrecision, resolve_precision
from poplar.types.profiles import Profile
from poplar.zero.compile_note import CompileNote
from poplar.zero.config import ZeroConfig, communicator_for
from poplar.zero.observers import MicroStepTimeline
from poplar.zero.runtime import LossFn, ZeroRuntime


class PoplarEngine(ZeroRuntime):
    """ZeRO-0/1/2/3 data parallelism with a per-rank plan. Every rank builds it together.

    With a plan: ``PoplarEngine(model, optimizer, zero_stage=..., plan=...)``; the arguments are
    those of ``ZeroRuntime``: ``zero_stage`` (0-3, or a ``poplar.ZeroConfig`` with the bucket
    size, stage-3 wrapping, process group and non-finite policy), ``max_grad_norm``,
    ``loss_fn``, ``mixed_precision`` (None or "fp32", "bf16", "fp16" or a
    ``poplar.MixedPrecision``), ``activation_checkpointing``; ``engine.loss_scale``,
    ``engine.loss_scaler`` (fp16) and ``engine.skipped_steps`` tell how it goes.

    Auto mode (no ``plan``; see ``poplar.auto``): give ``global_batch_size``, ``loss_fn`` and
    ``auto=AutoOptions(profile_data=...)`` instead, and the engine profiles every rank's device
    (``AutoOptions.device``, default the model's GPU: largest micro-batch, speed curve), plans
    with ``auto.strategy`` and logs the plan. A given ``zero_stage`` is binding: the job runs at
    that stage, and a stage where batch 1 does not fit some rank is an error naming the lowest
    stage that would. ``zero_stage="auto"`` (the default in auto mode) lets auto mode choose: by
    default (``AutoOptions.choose="fastest"``) it tries every stage of ``AutoOptions.stages``,
    with activation checkpointing off and on (``activation_checkpointing=None`` or "auto"; a
    value given is binding too), and runs the configuration with the shortest predicted iteration
    that fits every rank; the candidate table is logged and kept in ``plan.choice.candidates``.
    With a plan, ``zero_stage`` defaults to 0.

        global_batch_size: samples per optimizer step.
        loss_fn: ``loss_fn(module, micro_batch)`` -> mean loss, or ``(loss_sum, count)`` for
            token-weighted losses (docs/design.md §2); also ``train_step``'s default.
        auto: ``AutoOptions`` (what to profile on, the device, the strategy, a saved profile to
            reuse, profiling knobs).
    The device auto mode profiled stays attached while the engine trains (``engine.device``):
    every micro-step's memory is read on it, and a device that emulates a GPU in software keeps
    its speed and memory cap there. ``engine.close()`` detaches it.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 zero_stage: int | str | ZeroConfig | None = None,
                 plan: Plan | None = None, global_batch_size: int | None = None, loss_fn: LossFn | None = None,
                 max_grad_norm: float | None = None, mixed_precision: MixedPrecision | str | None = None,
                 activation_checkpointing: Any = None, auto: AutoOptions | None = None) -> None:
        auto_mode = plan is None and global_batch_size is not None
        # the door: a stage's number or "auto", and a precision's name, become policies here, once
        zero = ZeroConfig.of(("auto" if auto_mode else 0) if zero_stage is None else zero_stage)
        mixed_precision = resolve_precision(mixed_precision)
        if not auto_mode and "auto" in (zero.stage, activation_checkpointing):
            raise ValueError('zero_stage="auto" and activation_checkpointing="auto" ask auto mode to choose: give '
                             "global_batch_size (and no plan), or a stage and a setting with the plan")
        comm = communicator_for(zero, next(model.parameters()).device)
        compile_note = CompileNote(model, comm.device.type == "cpu", comm.rank)
        compile_note.check()  # before profiling, which runs the compiled model too
        self.auto_result: AutoResult | None = None
        device: Device | None = None
        if auto_mode:
            self.auto_result = auto_plan(comm, model, optimizer, global_batch_size=global_batch_size,
                                         zero_stage=zero, loss_fn=loss_fn, options=auto,
                                         mixed_precision=mixed_precision,
                                         activation_checkpointing=activation_checkpointing)
            plan, device = self.auto_result.plan, self.auto_result.device
            zero = dataclasses.replace(zero, stage=plan.zero_stage)  # every other field as the caller gave it
            activation_checkpointing = self.auto_result.activation_checkpointing
        elif isinstance(plan, Plan) and global_batch_size is not None and global_batch_size != plan.global_batch_size:
            raise ValueError(f"global_batch_size={global_batch_size} but the plan's rows sum to "
                             f"{plan.global_batch_size}; give one of them")
        super().__init__(model, optimizer, plan=plan, zero_stage=zero, max_grad_norm=max_grad_norm,
                         communicator=comm, loss_fn=loss_fn, mixed_precision=mixed_precision,
                         activation_checkpointing=activation_checkpointing)
        self.device: Device | None = device
        self.timeline = MicroStepTimeline()
        self.add_observer(self.timeline)
        self.add_observer(compile_note)
        self._attached = contextlib.ExitStack()
        if device is not None:
            self._attached.enter_context(device.attach(self))

    @property
    def profile(self) -> Profile | None:
        """The profile auto mode measured or loaded (None with a given plan)."""
        return self.auto_result.profile if self.auto_result is not None else None

    def close(self) -> None:
        """Detach the device (the engine stays usable; an emulated device no longer paces it or
        caps its memory). Also collects the reference cycles profiling and training left behind,
        while ``torch.distributed`` is still up: freed later, during interpreter shutdown, their
        gloo resources can abort a finished process (SIGABRT, "terminate called without an active
        exception"). Call it before ``destroy_process_group()``."""
        self._attached.close()
        gc.collect()

    def __enter__(self) -> "PoplarEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
