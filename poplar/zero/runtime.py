"""The plan-driven ZeRO runtime: one rank's share of every training step, at stages 0-3.

``ZeroRuntime`` wraps a model and its optimizer in a ZeRO stage and runs this rank's plan row
(micro-batch size, accumulation steps, last batch) with the math of one single-process step on
the whole global batch. It knows nothing above it: the profiler drives it directly, and
``PoplarEngine`` is it plus auto mode and the training loop.

Loss scaling: a micro-batch of m samples whose loss is a per-sample mean is scaled by
m / global_batch_size before backward, and gradients are summed over ranks (never averaged by
world size), so any plan gives the same step (docs/design.md, "the one invariant").

No hang on bad input: each rank checks its own input and reports at the iteration's status
reduction, which comes before any gradient collective of stages 0/1; at stages 2/3 a rank with a
problem still joins every micro-step's collectives with zeros. Every rank then raises the same
error, naming the failing ranks, and no optimizer step is taken.

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
from poplar.types.plans import Plan
from poplar.zero.base import ZeroStage
from poplar.zero.flat import split_into_units
from poplar.zero.observers import IterationStats, MicroStep, ObserverHandle, Observers, StepObserver
from poplar.zero.optim import named_param_groups

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
    Every rank constructs it together (set-up is agreed: a bad argument on any rank is a
    ``DistributedError`` on every rank).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, plan: Plan | None,
                 zero_stage: int = 0, process_group: Any = None, max_grad_norm: float | None = None,
                 bucket_size_mb: float = 25.0, wrap_policy: Any = None, communicator: Communicator | None = None,
                 loss_fn: LossFn | None = None) -> None:
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

        error, groups = self._check_setup(model, optimizer, zero_stage, plan, max_grad_norm, bucket_size_mb)
        self._agree_setup(error, model, zero_stage, plan)
        assert plan is not None
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
        self.comm.agree(error, "PoplarEngine setup", signature, mismatch=(
            "ranks disagree on zero_stage, plan or model parameters; pass the same to every rank"))

    def _build_stage(self, groups: list, bucket_size_mb: float, wrap_policy: Any) -> ZeroStage:
        with self.comm_ledger.scope(Phase.SETUP):
            if self.zero_stage == 3:
                from poplar.zero.sharded import Stage3
                return Stage3(self.module, self.optimizer, self.comm, groups, wrap_policy,
                              on_transient=self.observers.transient_allocated)
            from poplar.zero.replicated import Stage0, Stage1, Stage2

            element = next(self.module.parameters()).element_size()
            max_numel = max(1, int(bucket_size_mb * 2**20 / element))
            units = split_into_units(groups, self.world_size, self.rank, max_numel)
            order = {id(p): i for i, p in enumerate(self.module.parameters())}
            units.sort(key=lambda u: -max(order[id(p)] for p in u.params))  # backward order, roughly
            for i, u in enumerate(units):
                u.index = i
            stage_class = {0: Stage0, 1: Stage1, 2: Stage2}[self.zero_stage]
            stage = stage_class(self.module, self.optimizer, self.comm, units)
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
        with self.comm_ledger.scope(Phase.BACKWARD, micro_step=self._micro_steps):
            (loss * (num_samples / self.global_batch_size)).backward()
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
            loss_sum = self._agree_status(error, cause)
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
        self.observers.iteration_end(self.last_stats)
        return loss_sum / self.global_batch_size

    def _agree_status(self, error: str | None, cause: BaseException | None) -> float:
        """The iteration's status reduction: every rank's loss sum, sample count and verdict in
        one all-reduce. Any failure raises on every rank, with no optimizer step."""
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
        return loss_sum

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

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete unsharded model state (keys as ``model.state_dict()``), on every rank."""
        return self.stage.full_state_dict()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer``, ``buffers`` (module
        buffers) and ``comm_buffers`` (peak of the runtime's temporary communication buffers)."""
        return self.stage.memory_report()
