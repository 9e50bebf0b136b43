"""PoplarEngine: the front door. Wraps a model and its optimizer in a ZeRO stage and runs each
rank's own share of the global batch, as its plan row says, with the math of one
single-process step on the whole global batch.

Loss scaling: a micro-batch of m samples whose loss is a per-sample mean is scaled by
m / global_batch_size before backward, and gradients are summed over ranks (never averaged by
world size), so any plan gives the same step.

No hang on bad input: each rank checks its own input and reports at the iteration's status
reduction, which comes before any gradient collective of stages 0/1; at stages 2/3 a rank
with a problem still joins every micro-step's collectives with zeros. Every rank then raises
the same error, naming the failing ranks, and no optimizer step is taken.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from poplar.batches import batch_size_of, slice_batch
from poplar.plans import Plan
from poplar.zero.base import ZeroStage
from poplar.zero.comm import CommLedger, Communicator, DistributedError
from poplar.zero.flat import split_into_units
from poplar.zero.optim import named_param_groups

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class IterationStats:
    """What one iteration cost this rank, measured: ``compute_s`` is forward+backward time with
    the seconds spent blocked in collectives taken out; ``comm_s`` is all the iteration's
    blocked collective time (waiting for slower ranks included)."""

    iteration: int
    wall_s: float
    compute_s: float
    comm_s: float
    samples: int
    micro_steps: int


class PoplarEngine:
    """ZeRO-0/1/2/3 data parallelism with a per-rank plan.

    Args:
        model: the module, already on this rank's device, the same architecture on every rank.
        optimizer: any ``torch.optim`` optimizer built on ``model.parameters()`` (groups allowed).
            At stages 1-3 its groups are re-pointed at this rank's shard; settings are kept.
        zero_stage: 0, 1, 2 or 3.
        plan: one ``RankPlan`` per rank (``Plan``); its global batch size defines loss scaling.
        process_group: defaults to the world group; without ``torch.distributed`` initialised
            the engine runs as a world of one.
        max_grad_norm: clip the global gradient norm (over all ranks) to this value.
        bucket_size_mb: gradient bucket size of stages 0-2 (each bucket is one collective).
        wrap_policy: stage 3 only: which modules form a gather/release block.
        communicator: use this ``Communicator`` instead of one on ``process_group``.

    Auto mode (no ``plan``; see ``poplar.auto``): give ``global_batch_size`` and ``loss_fn``
    instead, and the engine profiles every rank's device (largest micro-batch, speed curve),
    plans with ``auto.strategy`` and logs the plan; ``zero_stage`` is raised if the model does
    not fit batch 1 somewhere. Every rank builds the engine together.

        global_batch_size: samples per optimizer step.
        loss_fn: ``loss_fn(module, micro_batch)`` -> mean loss; also ``train_step``'s default.
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
                 cluster: Any = None, device: Any = None, auto: Any = None) -> None:
        model_device = next(model.parameters()).device
        self.comm = communicator if communicator is not None else Communicator(process_group, model_device)
        self.comm_ledger: CommLedger = self.comm.ledger
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.module, self.optimizer = model, optimizer
        self.loss_fn = loss_fn
        self.max_grad_norm = max_grad_norm
        self.iteration = 0
        self.last_grad_norm: float | None = None
        self.last_stats: IterationStats | None = None
        # (iteration, micro-step, wall-clock start, seconds) of recent micro-steps, for timelines
        self.timeline: deque[tuple[int, int, float, float]] = deque(maxlen=50_000)
        self.profile: Any = None  # the Profile auto mode measured
        self.device: Any = device  # the profiler Device of this rank, if any
        self._device_ctx: Any = None

        if plan is None and global_batch_size is not None:
            from poplar.auto import auto_plan

            result = auto_plan(self, model, optimizer, global_batch_size=global_batch_size, zero_stage=zero_stage,
                               loss_fn=loss_fn, profile_data=profile_data, cluster=cluster, device=device,
                               options=auto, bucket_size_mb=bucket_size_mb, wrap_policy=wrap_policy)
            plan, zero_stage, self.profile, self.device = result.plan, result.plan.zero_stage, result.profile, \
                result.device
        elif plan is not None and global_batch_size is not None and global_batch_size != getattr(
                plan, "global_batch_size", global_batch_size):
            raise ValueError(f"global_batch_size={global_batch_size} but the plan's rows sum to "
                             f"{plan.global_batch_size}; give one of them")
        self.plan, self.zero_stage = plan, zero_stage

        error, groups = self._check_setup(model, optimizer, zero_stage, plan, max_grad_norm, bucket_size_mb)
        self._agree_setup(error, model, zero_stage, plan)
        assert plan is not None
        self.global_batch_size = plan.global_batch_size
        self.rank_plan = plan.ranks[self.rank]
        self.stage: ZeroStage = self._build_stage(groups, bucket_size_mb, wrap_policy)
        self._reset_iteration()
        if self.device is not None and getattr(self.device, "kind", "") == "virtual":
            self._device_ctx = self.device.attach(self)
            self._device_ctx.__enter__()

    # ------------------------------------------------------------------ setup
    def _check_setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, zero_stage: Any, plan: Any,
                     max_grad_norm: Any, bucket_size_mb: float) -> tuple[str | None, list]:
        """This rank's verdict on its arguments (a message naming the fix), without raising:
        every rank must reach the agreement point."""
        if zero_stage not in (0, 1, 2, 3):
            return f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}", []
        if not isinstance(plan, Plan):
            return (f"plan must be a poplar.Plan with one RankPlan per rank, got {type(plan).__name__}; "
                    f"e.g. Plan.even(world_size={self.world_size}, global_batch_size=..., micro_batch_size=...) "
                    "or poplar.plan(profile, ...); or give global_batch_size= and loss_fn= for auto mode"), []
        if plan.world_size != self.world_size:
            return (f"plan has {plan.world_size} rows but the world has {self.world_size} ranks; "
                    "give one RankPlan per rank"), []
        if max_grad_norm is not None and not max_grad_norm > 0:
            return f"max_grad_norm must be > 0 or None, got {max_grad_norm}", []
        if not bucket_size_mb > 0:
            return f"bucket_size_mb must be > 0, got {bucket_size_mb}", []
        devices = {p.device for p in model.parameters()}
        if len(devices) > 1:
            return f"model parameters are on several devices {sorted(map(str, devices))}; put the model on one", []
        groups, error = named_param_groups(model, optimizer)
        return error, groups

    def _agree_setup(self, error: str | None, model: nn.Module, zero_stage: Any, plan: Any) -> None:
        """All ranks must have valid arguments, the same plan and stage and the same parameter shapes."""
        shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
        plan_json = plan.to_json() if isinstance(plan, Plan) else repr(plan)
        signature = hashlib.sha256(repr((zero_stage, plan_json, shapes)).encode()).hexdigest()
        self.comm.gather_verdicts(error, signature, "PoplarEngine setup", mismatch=(
            "ranks disagree on zero_stage, plan or model parameters; pass the same to every rank"))

    def _build_stage(self, groups: list, bucket_size_mb: float, wrap_policy: Any) -> ZeroStage:
        self.comm_ledger.phase = "setup"
        if self.zero_stage == 3:
            from poplar.zero.sharded import Stage3
            return Stage3(self.module, self.optimizer, self.comm, groups, wrap_policy)
        from poplar.zero.replicated import Stage0, Stage1, Stage2

        element = next(self.module.parameters()).element_size()
        max_numel = max(1, int(bucket_size_mb * 2**20 / element))
        units = split_into_units(groups, self.world_size, self.rank, max_numel)
        order = {id(p): i for i, p in enumerate(self.module.parameters())}
        units.sort(key=lambda u: -max(order[id(p)] for p in u.params))  # backward order, roughly
        for i, u in enumerate(units):
            u.index = i
        stage = {0: Stage0, 1: Stage1, 2: Stage2}[self.zero_stage](self.module, self.optimizer, self.comm, units)
        stage.sync_params()
        return stage

    # ------------------------------------------------------------------ plan
    def set_plan(self, plan: Plan) -> None:
        """Use ``plan`` from the next iteration on. Every rank must call it, between iterations,
        with the same plan (checked: a ``DistributedError`` on every rank otherwise)."""
        error = None
        if self._micro_steps:
            error = "set_plan() inside an iteration; call it between iterations"
        elif not isinstance(plan, Plan):
            error = f"plan must be a poplar.Plan, got {type(plan).__name__}"
        elif plan.world_size != self.world_size:
            error = f"plan has {plan.world_size} rows but the world has {self.world_size} ranks"
        digest = hashlib.sha256(plan.to_json().encode()).hexdigest() if error is None else None
        self.comm.gather_verdicts(error, digest, "set_plan",
                                  mismatch="ranks were given different plans; pass the same plan to every rank")
        self.use_plan(plan)

    def use_plan(self, plan: Plan) -> None:
        """``set_plan`` without its agreement collective, for callers whose ranks derive the plan
        from data they already agreed on (the profiler switches plans every timing round)."""
        if plan.world_size != self.world_size:
            raise ValueError(f"plan has {plan.world_size} rows but the engine's world has {self.world_size} ranks")
        self.plan, self.rank_plan, self.global_batch_size = plan, plan.ranks[self.rank], plan.global_batch_size

    def close(self) -> None:
        """Detach the virtual device (auto mode on an emulated cluster); the engine stays usable
        at CPU speed without a memory cap."""
        if self._device_ctx is not None:
            ctx, self._device_ctx = self._device_ctx, None
            ctx.__exit__(None, None, None)

    def __enter__(self) -> "PoplarEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ one iteration
    def train_step(self, batch: Any, loss_fn: LossFn | None = None) -> float:
        """Run this rank's micro-steps on ``batch`` (its n_i samples), reduce, clip, step.

        ``loss_fn(module, micro_batch)`` returns the mean loss over the micro-batch (default: the
        engine's ``loss_fn``). Returns the per-sample mean loss over the whole global batch (the
        same float on every rank).
        """
        self._iter_start = time.perf_counter()
        loss_fn = loss_fn if loss_fn is not None else self.loss_fn
        sizes = self.rank_plan.micro_batch_sizes()
        error: str | None = None
        cause: BaseException | None = None
        try:
            n = batch_size_of(batch)
            if n != self.rank_plan.num_samples:
                error = (f"batch has {n} samples but this rank's plan row (micro_batch_size="
                         f"{self.rank_plan.micro_batch_size}, accum_steps={self.rank_plan.accum_steps}, "
                         f"last_batch_size={self.rank_plan.last_batch_size}) needs {self.rank_plan.num_samples}; "
                         "give each rank its slice of the global batch (poplar's sampler does this)")
        except ValueError as e:
            error, cause = str(e), e
        if error is None and loss_fn is None:
            error = "no loss_fn: pass train_step(batch, loss_fn) or PoplarEngine(..., loss_fn=...)"
        if error is not None:
            sizes = []
        start = 0
        for k, m in enumerate(sizes):
            self.comm_ledger.micro_step = self._micro_steps
            t0, comm0 = time.perf_counter(), self.comm_ledger.total_seconds
            try:
                self.comm_ledger.phase = "forward"
                self.stage.begin_micro_step()
                loss = loss_fn(self.module, slice_batch(batch, start, m))
                if not (torch.is_tensor(loss) and loss.numel() == 1):
                    raise TypeError(f"loss_fn must return a one-element tensor (the mean loss), got {loss!r}")
                self.backward(loss, m)
            except Exception as e:  # reported to every rank at the status reduction
                error, cause = f"micro-step {k}: {type(e).__name__}: {e}", e
                if self.stage.communicates_in_micro_steps and self._micro_steps == k:
                    self.stage.end_micro_step()  # finish this micro-step's collectives with zeros
                    self._micro_steps += 1
                break
            start += m
            if self.comm.device.type == "cuda":
                torch.cuda.synchronize(self.comm.device)
            dt = time.perf_counter() - t0
            self._compute_s += dt - (self.comm_ledger.total_seconds - comm0)
            self.timeline.append((self.iteration, k, time.time() - dt, dt))
        return self._finish_iteration(error, cause)

    def backward(self, loss: torch.Tensor, num_samples: int) -> None:
        """Backward of one micro-step whose ``loss`` is the mean over ``num_samples`` samples.

        For your own loop: call it once per micro-step of this rank's plan row, then ``step()``.
        At stages 2/3 it runs the micro-step's collectives, so every rank must call it no more
        often than the plan's largest micro-step count; ``step()`` fills in the rest with zeros.
        """
        if self.stage.communicates_in_micro_steps and self._micro_steps >= self.plan.max_micro_steps:
            raise RuntimeError(
                f"backward called {self._micro_steps + 1} times in one iteration but the plan's largest "
                f"micro-step count is {self.plan.max_micro_steps}; call step() after this rank's micro-steps")
        self.comm_ledger.micro_step = self._micro_steps
        self.comm_ledger.phase = "backward"
        (loss * (num_samples / self.global_batch_size)).backward()
        self.stage.end_micro_step()
        self._loss_sum += loss.detach().double().reshape(()) * num_samples
        self._samples += num_samples
        self._micro_steps += 1
        self.comm_ledger.micro_step = self._micro_steps

    def step(self) -> float:
        """End the iteration: reduce gradients, clip, step, zero. Returns the global mean loss."""
        return self._finish_iteration(None, None)

    def _finish_iteration(self, error: str | None, cause: BaseException | None) -> float:
        if self.stage.communicates_in_micro_steps:
            while self._micro_steps < self.plan.max_micro_steps:  # join the others' micro-steps with zeros
                self.comm_ledger.micro_step, self.comm_ledger.phase = self._micro_steps, "backward"
                self.stage.empty_micro_step()
                self._micro_steps += 1
        self.comm_ledger.phase, self.comm_ledger.micro_step = "step", -1
        dev = self.comm.device
        status = torch.stack([self._loss_sum, torch.tensor(float(self._samples), dtype=torch.float64, device=dev),
                              torch.tensor(0.0 if error is None else 1.0, dtype=torch.float64, device=dev)])
        self.comm.all_reduce(status, tag="status")
        loss_sum, samples, failed = status.tolist()
        if failed:
            self._abandon_iteration()
            messages = self.comm.all_gather_object(error, tag="status")
            lines = [f"  rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
            raise DistributedError(f"iteration {self.iteration} failed on {len(lines)} of {self.world_size} "
                                   "ranks; no optimizer step was taken:\n" + "\n".join(lines)) from cause
        if round(samples) != self.global_batch_size:
            self._abandon_iteration()
            raise DistributedError(
                f"iteration {self.iteration}: ranks processed {round(samples)} samples in all but the plan's global "
                f"batch is {self.global_batch_size}; each rank must backward exactly its plan row's samples")
        self.stage.reduce_gradients()
        if self.max_grad_norm is not None:
            self.last_grad_norm = self._clip_grad_norm(self.max_grad_norm)
        self.stage.optimizer_step()
        self.stage.zero_grad()
        wall = time.perf_counter() - self._iter_start
        comm_s = self.comm_ledger.seconds(iteration=self.iteration)
        self.last_stats = IterationStats(self.iteration, wall, self._compute_s or max(0.0, wall - comm_s), comm_s,
                                         self._samples, self._micro_steps)
        self.iteration += 1
        self._reset_iteration()
        return loss_sum / self.global_batch_size

    def _abandon_iteration(self) -> None:
        self.stage.zero_grad()
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.comm.device)
        self._samples = 0
        self._micro_steps = 0
        self._compute_s = 0.0
        self._iter_start = time.perf_counter()
        self.comm_ledger.iteration = self.iteration
        self.comm_ledger.micro_step = 0

    def _clip_grad_norm(self, max_norm: float) -> float:
        grads = self.stage.grad_tensors()
        sq = torch.zeros((), dtype=torch.float64, device=self.comm.device)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        if self.stage.grads_sharded:
            sq = sq.reshape(1)
            self.comm.all_reduce(sq, tag="grad_norm")
        norm = float(sq.sum().sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def fit(self, data: Any, iterations: int, **kwargs: Any) -> Any:
        """Train until the engine's iteration count reaches ``iterations``, on ``data`` (a map-style
        dataset, cut per the plan), logging measured vs predicted times; checkpoints, resume and
        reports on request. Returns a ``FitResult``; see ``poplar.trainer.fit`` for the options."""
        from poplar.trainer import fit

        return fit(self, data, iterations, **kwargs)

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete unsharded model state (keys as ``model.state_dict()``), on every rank."""
        return self.stage.full_state_dict()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer``, ``buffers`` (module
        buffers) and ``comm_buffers`` (peak of the engine's temporary communication buffers)."""
        return self.stage.memory_report()
