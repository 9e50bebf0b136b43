"""The plan-driven ZeRO runtime: one rank's share of every training step, at stages 0-3.

``ZeroRuntime`` wraps a model and its optimizer in a ZeRO stage and runs this rank's plan row
with the math of one single-process step on the whole global batch: a micro-batch of m samples
is scaled by m / global_batch_size and gradients are summed over ranks (docs/design.md §2). It
knows nothing above it: the profiler drives it, and ``PoplarEngine`` adds auto mode and ``fit``.

Bad input never hangs: each rank reports at the iteration's status reduction (before any gradient
collective of stages 0/1; at stages 2/3 a failing rank still joins every micro-step's collectives
with zeros), and every rank raises the same error. Mixed precision and non-finite steps: §3.7.
A step is extended through observers (``poplar.zero.observers``), never by replacing methods.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any, Callable

import torch
from torch import nn

from poplar.comm import CommLedger, Communicator, DistributedError, Phase
from poplar.types.batches import batch_size_of, slice_batch
from poplar.types.logs import log
from poplar.types.plans import Plan
from poplar.types.precision import MixedPrecision
from poplar.zero.base import ZeroStage
from poplar.zero.flat import gradient_buckets
from poplar.zero.grad_norm import clip_and_unscale
from poplar.zero.loss_scaler import LossScaler
from poplar.zero.nonfinite import NonFiniteGuard, NonFinitePolicy, Verdict, local_detail, nonfinite_flag
from poplar.zero.observers import IterationStats, MicroStep, ObserverHandle, Observers, StepObserver
from poplar.zero.precision import StagePrecision
from poplar.zero.setup import agree_setup, check_arguments, check_policies

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class ZeroRuntime:
    """ZeRO-0/1/2/3 data parallelism with a per-rank plan.

    Args:
        model: the module, already on this rank's device, the same architecture on every rank.
        optimizer: any ``torch.optim`` optimizer built on ``model.parameters()`` (groups allowed).
            At stages 1-3 its groups are re-pointed at this rank's shard; settings are kept.
        plan: one ``RankPlan`` per rank (``Plan``); its global batch size defines loss scaling.
        zero_stage: 0, 1, 2 or 3.
        process_group: defaults to the world group; without ``torch.distributed`` initialised
            the runtime runs as a world of one.
        max_grad_norm: clip the global gradient norm (over all ranks) to this value.
        bucket_size_mb: gradient bucket size of stages 0-2 (each bucket is one collective).
        wrap_policy: stage 3 only: which modules form a gather/release block.
        communicator: use this ``Communicator`` instead of one on ``process_group``.
        loss_fn: ``loss_fn(module, micro_batch)`` -> mean loss, ``train_step``'s default.
        mixed_precision: None or "fp32" (plain fp32), "bf16", "fp16" or a ``MixedPrecision``.
            The model must be fp32: masters and optimizer state stay fp32.
        nonfinite: ``NonFinitePolicy`` (or "skip" / "raise"): what every rank does when a loss or
            gradient on some rank is inf or NaN.
        max_consecutive_skips: with "skip", more non-finite steps in a row than this raise (under
            fp16 dynamic loss scaling only those at the minimum scale count).
    Every rank constructs it together (set-up is agreed: a bad argument on any rank is a
    ``DistributedError`` on every rank).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, plan: Plan | None,
                 zero_stage: int = 0, process_group: Any = None, max_grad_norm: float | None = None,
                 bucket_size_mb: float = 25.0, wrap_policy: Any = None, communicator: Communicator | None = None,
                 loss_fn: LossFn | None = None, mixed_precision: MixedPrecision | str | None = None,
                 nonfinite: NonFinitePolicy | str = NonFinitePolicy.SKIP, max_consecutive_skips: int = 5) -> None:
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
        self.observers = Observers()

        error, groups = check_arguments(self.world_size, model, optimizer, zero_stage, plan, max_grad_norm,
                                        bucket_size_mb)
        checked = check_policies(model, mixed_precision, nonfinite, max_consecutive_skips)
        agree_setup(self.comm, error or checked.error, model, zero_stage, plan, checked.signature)
        assert plan is not None
        self.mixed_precision: MixedPrecision | None = checked.precision
        scale_config = checked.precision.loss_scale if checked.precision is not None else None
        self.loss_scaler: LossScaler | None = LossScaler(scale_config) if scale_config is not None else None
        self.nonfinite = NonFiniteGuard(checked.nonfinite, max_consecutive_skips)
        self.zero_stage = zero_stage
        self.use_plan(plan)
        self.stage: ZeroStage = self._build_stage(groups, bucket_size_mb, wrap_policy)
        self._micro_step: MicroStep | None = None
        self._user_forward = contextlib.ExitStack()  # the ledger scope of a user loop's forward
        # the first hook opens a micro-step of a loop of the user's own (and stamps the ZeRO-3 root
        # gather with it); the second tells observers the forward starts, after any root gather
        model.register_forward_pre_hook(self._open_user_micro_step, with_kwargs=True, prepend=True)
        model.register_forward_pre_hook(self._forward_pre_hook)
        model.register_forward_hook(self._forward_post_hook)
        self._reset_iteration()

    # ------------------------------------------------------------------ set-up
    def _build_stage(self, groups: list, bucket_size_mb: float, wrap_policy: Any) -> ZeroStage:
        precision = StagePrecision.of(self.mixed_precision)
        with self.comm_ledger.scope(Phase.SETUP):
            if self.zero_stage == 3:
                from poplar.zero.sharded import Stage3
                return Stage3(self.module, self.optimizer, self.comm, groups, wrap_policy,
                              on_transient=self.observers.transient_allocated, precision=precision)
            from poplar.zero.replicated import Stage0, Stage1, Stage2

            units = gradient_buckets(self.module, groups, self.world_size, self.rank, bucket_size_mb)
            stage_class = {0: Stage0, 1: Stage1, 2: Stage2}[self.zero_stage]
            stage = stage_class(self.module, self.optimizer, self.comm, units, precision=precision)
            stage.sync_params()
            return stage

    def add_observer(self, observer: StepObserver) -> ObserverHandle:
        """Call ``observer`` at the step's points from now on; ``handle.remove()`` detaches it."""
        return self.observers.add(observer)

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
        self.comm.agree(error, "set_plan", digest,
                        mismatch="ranks were given different plans; pass the same plan to every rank")
        self.use_plan(plan)

    def use_plan(self, plan: Plan) -> None:
        """``set_plan`` without its agreement collective, for callers whose ranks derive the plan
        from data they already agreed on (the profiler switches plans every timing round)."""
        if plan.world_size != self.world_size:
            raise ValueError(f"plan has {plan.world_size} rows but the runtime's world has {self.world_size} ranks")
        self.plan, self.rank_plan, self.global_batch_size = plan, plan.ranks[self.rank], plan.global_batch_size

    def restore_iteration(self, iteration: int) -> None:
        """Continue counting from ``iteration`` (a loaded checkpoint's), between iterations."""
        self.iteration = iteration
        self._reset_iteration()

    # ------------------------------------------------------------------ one iteration
    def train_step(self, batch: Any, loss_fn: LossFn | None = None) -> float:
        """Run this rank's micro-steps on ``batch`` (its n_i samples), reduce, clip, step.

        ``loss_fn(module, micro_batch)`` returns the mean loss over the micro-batch (default: the
        runtime's ``loss_fn``). Returns the per-sample mean loss over the whole global batch (the
        same float on every rank).
        """
        self._begin_iteration()
        loss_fn = loss_fn if loss_fn is not None else self.loss_fn
        error, cause = self._check_batch(batch, loss_fn)
        start = 0
        for k, m in enumerate(self.rank_plan.micro_batch_sizes() if error is None else []):
            failure = self._run_micro_step(batch, start, m, k, loss_fn)
            if failure is not None:
                error, cause = f"micro-step {k}: {type(failure).__name__}: {failure}", failure
                break
            start += m
        return self._finish_iteration(error, cause)

    def _check_batch(self, batch: Any, loss_fn: LossFn | None) -> tuple[str | None, BaseException | None]:
        try:
            n = batch_size_of(batch)
        except ValueError as e:
            return str(e), e
        if n != self.rank_plan.num_samples:
            row = self.rank_plan
            return (f"batch has {n} samples but this rank's plan row (micro_batch_size={row.micro_batch_size}, "
                    f"accum_steps={row.accum_steps}, last_batch_size={row.last_batch_size}) needs "
                    f"{row.num_samples}; give each rank its slice of the global batch (poplar's sampler does "
                    "this)"), None
        if loss_fn is None:
            return "no loss_fn: pass train_step(batch, loss_fn) or PoplarEngine(..., loss_fn=...)", None
        return None, None

    def _run_micro_step(self, batch: Any, start: int, m: int, k: int, loss_fn: LossFn) -> Exception | None:
        """Forward and backward of micro-step ``k`` (``m`` samples from ``start``); the error, if
        it raised (the stage's collectives of the micro-step are then completed with zeros)."""
        t0, comm0 = time.perf_counter(), self.comm_ledger.total_seconds
        step = self._open_micro_step(m)
        try:
            with self.comm_ledger.scope(Phase.FORWARD, micro_step=k):
                self.stage.begin_micro_step()
                loss = loss_fn(self.module, slice_batch(batch, start, m))
            if not (torch.is_tensor(loss) and loss.numel() == 1):
                raise TypeError(f"loss_fn must return a one-element tensor (the mean loss), got {loss!r}")
            self.backward(loss, m)
        except Exception as e:  # reported to every rank at the status reduction
            self._abort_micro_step(step, e, k)
            return e
        if self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)
        self._compute_s += time.perf_counter() - t0 - (self.comm_ledger.total_seconds - comm0)
        return None

    def _begin_iteration(self) -> None:
        if self._started is None:
            self._started = self.iteration
            self._iter_start = time.perf_counter()
            self.observers.iteration_start(self.iteration)

    def _open_micro_step(self, batch_size: int) -> MicroStep:
        self._begin_iteration()
        step = self._micro_step = MicroStep(self.iteration, self._micro_steps, batch_size)
        self.observers.micro_step_start(step)
        return step

    def _abort_micro_step(self, step: MicroStep, error: BaseException, k: int) -> None:
        self._micro_step = None
        self.observers.micro_step_abort(step, error)
        if self.stage.communicates_in_micro_steps and self._micro_steps == k:
            with self.comm_ledger.scope(Phase.BACKWARD, micro_step=k):
                self.stage.end_micro_step()  # finish this micro-step's collectives with zeros
            self._micro_steps += 1

    # forward hooks on the model: the micro-step's forward points, also for a loop of the user's own
    def _open_user_micro_step(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._micro_step is None and torch.is_grad_enabled():
            try:
                batch = batch_size_of((args, kwargs))
            except ValueError:
                batch = 0
            self._open_micro_step(batch)
            self._user_forward.enter_context(self.comm_ledger.scope(Phase.FORWARD, micro_step=self._micro_steps))

    def _forward_pre_hook(self, module: nn.Module, args: Any) -> None:
        step = self._micro_step
        if step is not None and not step.forward_started and torch.is_grad_enabled():
            step.forward_started = True
            self.observers.forward_start(step)

    def _forward_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        step = self._micro_step
        if step is not None and step.forward_started and not step.forward_ended:
            step.forward_ended = True
            self.observers.forward_end(step)

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
        step = self._micro_step if self._micro_step is not None else self._open_micro_step(num_samples)
        self._user_forward.close()
        self.observers.backward_start(step, loss)
        weight = num_samples / self.global_batch_size * (1 if self.loss_scaler is None else self.loss_scaler.scale)
        with self.comm_ledger.scope(Phase.BACKWARD, micro_step=self._micro_steps):
            # in fp32 even for a bf16/fp16 loss: the scaled loss of fp16 would overflow
            (loss.float() * weight).backward()
            self.stage.end_micro_step()
        self.observers.backward_end(step)
        self._loss_sum += loss.detach().double().reshape(()) * num_samples
        self._samples += num_samples
        self._micro_steps += 1
        self._micro_step = None
        self.observers.micro_step_end(step)

    def step(self) -> float:
        """End the iteration: reduce gradients, clip, step, zero. Returns the global mean loss."""
        return self._finish_iteration(None, None)

    def _finish_iteration(self, error: str | None, cause: BaseException | None) -> float:
        if self.stage.communicates_in_micro_steps:
            while self._micro_steps < self.plan.max_micro_steps:  # join the others' micro-steps with zeros
                with self.comm_ledger.scope(Phase.BACKWARD, micro_step=self._micro_steps):
                    self.stage.empty_micro_step()
                self._micro_steps += 1
        with self.comm_ledger.scope(Phase.STEP, micro_step=-1):
            loss_sum, nonfinite_ranks = self._agree_status(error, cause)
            if nonfinite_ranks:
                self._skip_step(nonfinite_ranks)
            else:
                self._take_step()
        wall = time.perf_counter() - self._iter_start
        comm_s = self.comm_ledger.seconds(iteration=self.iteration)
        self.last_stats = IterationStats(self.iteration, wall, self._compute_s or max(0.0, wall - comm_s), comm_s,
                                         self._samples, self._micro_steps)
        self.iteration += 1
        self._reset_iteration()
        self.observers.iteration_end(self.last_stats)
        return loss_sum / self.global_batch_size

    def _agree_status(self, error: str | None, cause: BaseException | None) -> tuple[float, int]:
        """The iteration's status reduction: every rank's loss sum, sample count and verdict in
        one all-reduce of three numbers. The verdict packs two counts: ranks that failed, plus
        (world size + 1) x ranks that saw a non-finite loss or gradient (exact in float64). Any
        failure raises on every rank, with no optimizer step. Returns the global loss sum and the
        number of ranks that saw a non-finite value."""
        dev = self.comm.device
        base = self.world_size + 1
        verdict = nonfinite_flag(self.stage.held_grads(), self._loss_sum, self.stage.held_grads_limit) * base
        if error is not None:
            verdict = verdict + 1.0
        status = torch.stack([self._loss_sum, torch.tensor(float(self._samples), dtype=torch.float64, device=dev),
                              verdict.reshape(())])
        self.comm.all_reduce(status, tag="status")
        loss_sum, samples, packed = status.tolist()
        nonfinite_ranks, failed = divmod(round(packed), base)
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
        return loss_sum, nonfinite_ranks

    def _take_step(self) -> None:
        self.stage.reduce_gradients()
        norm = clip_and_unscale(self.stage.grad_tensors(), self.comm, self.stage.grads_sharded, self.max_grad_norm,
                                self.loss_scale)
        self.last_grad_norm = norm if self.max_grad_norm is not None else self.last_grad_norm
        self.stage.optimizer_step()
        self.stage.zero_grad()
        self.nonfinite.on_step()
        if self.loss_scaler is not None:
            self.loss_scaler.on_good_step()

    def _skip_step(self, nonfinite_ranks: int) -> None:
        """Some rank saw an inf or NaN: every rank drops the gradients and takes no step, and the
        loss scale backs off; the policy may raise instead, on every rank alike."""
        scaler, old_scale = self.loss_scaler, self.loss_scale
        verdict = self.nonfinite.on_nonfinite(counted=scaler is None or scaler.at_minimum)
        details = None
        if verdict is not Verdict.SKIP:  # every rank takes this branch: name the ranks
            detail = local_detail(self.stage.held_grads(), self._loss_sum, self.stage.held_grads_limit)
            details = self.comm.all_gather_object(detail, tag="status")
        self.stage.zero_grad()
        if scaler is not None:
            scaler.on_overflow()
        if details is not None:
            message = self.nonfinite.message(verdict, self.iteration, details)
            self._reset_iteration()
            raise DistributedError(message)
        if self.rank == 0:
            log.warning(self.nonfinite.warning(self.iteration, nonfinite_ranks, self.world_size,
                                               (old_scale, self.loss_scale) if scaler is not None else None))

    def _abandon_iteration(self) -> None:
        self.stage.zero_grad()
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.comm.device)
        self._samples = 0
        self._micro_steps = 0
        self._micro_step = None
        self._compute_s = 0.0
        self._started: int | None = None  # the iteration whose iteration_start observers saw
        self._iter_start = time.perf_counter()
        self._user_forward.close()
        self.comm_ledger.start_iteration(self.iteration)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale of the next iteration (1.0 without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Iterations whose optimizer step was skipped for a non-finite loss or gradient."""
        return self.nonfinite.skipped_steps

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete unsharded model state (keys as ``model.state_dict()``), on every rank."""
        return self.stage.full_state_dict()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params`` (the copy the model computes with), ``master_params``
        (fp32 masters kept apart from it under mixed precision), ``grads``, ``optimizer``,
        ``buffers`` (module buffers) and ``comm_buffers`` (peak of the runtime's temporary
        communication buffers); stage 3 adds ``gathered_params``."""
        return self.stage.memory_report()
