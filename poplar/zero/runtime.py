"""The plan-driven ZeRO runtime: one rank's share of every training step, at stages 0-3.

``ZeroRuntime`` wraps a model and its optimizer in a ZeRO stage and runs this rank's plan row
with the math of one single-process step on the whole global batch: a mean loss over m samples
weighs m / gbs, a (loss_sum, count) pair is divided by the global count at step time, gradients
are summed over ranks (docs/design.md §2, ``poplar.zero.iteration_status``). It knows nothing
above it: the profiler drives it, and ``PoplarEngine`` adds auto mode and ``fit``.

Bad input never hangs: each rank reports at the iteration's status reduction (a failing rank
still joins the gradient collectives before it), and every rank raises the same error. Mixed
precision and non-finite steps: §3.7. Observers extend a step (``poplar.zero.observers``).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from enum import Enum
from typing import Any, Callable, Iterator

import torch
from torch import nn

from poplar.comm import CommLedger, Communicator, DistributedError, Phase
from poplar.zero.batches import batch_size_of, slice_batch
from poplar.logs import log
from poplar.types.plans import Plan, PlanError
from poplar.types.precision import MixedPrecision
from poplar.zero import activation_checkpointing as checkpointing
from poplar.zero.base import StageHooks, ZeroStage
from poplar.zero.config import ZeroConfig, communicator_for
from poplar.zero.failures import IterationFailed, failure_kind, release_frames
from poplar.zero.eager_hooks import eager_hook
from poplar.zero.iteration_status import (IterationStatus, LossAccumulator, check_batch, failure_message,
                                          left_out_batch_error, reduce_status, skip_empty_step, status_error)
from poplar.zero.loss_scaler import LossScaler
from poplar.zero.nonfinite import NonFiniteGuard, SkipReport, Verdict, local_detail, nonfinite_flag, where_nonfinite
from poplar.zero.observers import IterationStats, MicroStep, ObserverHandle, Observers, StepObserver
from poplar.zero.precision import StagePrecision
from poplar.zero.setup import (agree_setup, build_stage, check_arguments, check_policies, compression_problem,
                               plan_problem)
from poplar.zero.shard_layout import Shards
from poplar.zero.state_parts import StatePart, StateSpec

# returns the mean loss of the micro-batch, or a pair (loss_sum, count) (docs/design.md §2)
LossFn = Callable[[nn.Module, Any], Any]


class PlanCheck(Enum):
    """How ``set_plan`` checks a new plan."""

    AGREE = "agree"  # every rank together: valid, and the same on every rank (one object all-gather)
    LOCAL = "local"  # valid on this rank; the caller knows every rank switches to the same plan


class ZeroRuntime:
    """ZeRO-0/1/2/3 data parallelism with a per-rank plan.

    Args:
        model: the module, already on this rank's device, the same architecture on every rank.
        optimizer: any ``torch.optim`` optimizer built on ``model.parameters()`` (groups allowed).
            At stages 1-3 its groups are re-pointed at this rank's shard; settings are kept.
        plan: one ``RankPlan`` per rank (``Plan``); its global batch size defines loss scaling.
        zero_stage: a ``ZeroConfig`` (the stage with the bucket size, stage-3 wrapping, process
            group and non-finite policy). ``PoplarEngine``, the public door, also takes a plain stage.
        max_grad_norm: clip the global gradient norm (over all ranks) to this value.
        communicator: use this ``Communicator`` instead of one on the config's process group.
        loss_fn: ``loss_fn(module, micro_batch)`` -> the mean loss, or a pair ``(loss_sum, count)``
            (token-weighted, docs/design.md §2); ``train_step``'s default.
        mixed_precision: a ``MixedPrecision`` or None (plain fp32); ``PoplarEngine`` also takes its
            name. The model must be fp32: masters and optimizer state stay fp32.
        activation_checkpointing: None/False, True (the wrap policy's blocks) or a policy naming
            module classes: recompute their forward in backward (``poplar.zero.activation_checkpointing``).
    Every rank constructs it together (set-up is agreed: a bad argument on any rank is a
    ``DistributedError`` on every rank).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, plan: Plan | None,
                 zero_stage: ZeroConfig = ZeroConfig(), max_grad_norm: float | None = None,
                 communicator: Communicator | None = None, loss_fn: LossFn | None = None,
                 mixed_precision: MixedPrecision | None = None, activation_checkpointing: Any = None) -> None:
        # one type per argument here: the engine (PoplarEngine) is the door that takes a stage's
        # number or a precision's name and converts it, once
        if not isinstance(zero_stage, ZeroConfig):
            raise TypeError(f"ZeroRuntime takes zero_stage=poplar.ZeroConfig(stage, ...), got {zero_stage!r}; "
                            f"write ZeroConfig({zero_stage!r}), or build a PoplarEngine, which takes the stage")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"ZeroRuntime takes mixed_precision=poplar.MixedPrecision(...) or None, got "
                            f"{mixed_precision!r}; a PoplarEngine takes the names 'fp32', 'bf16' and 'fp16'")
        config = zero_stage
        zero_stage, bucket_size_mb, wrap_policy = config.stage, config.bucket_size_mb, config.wrap_policy
        model_device = next(model.parameters()).device
        self.comm = communicator if communicator is not None else communicator_for(config, model_device)
        self.zero_config = config
        self.comm_ledger: CommLedger = self.comm.ledger
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.module, self.optimizer = model, optimizer
        self.loss_fn = loss_fn
        self.max_grad_norm = max_grad_norm
        self.iteration = 0
        self._grad_norm: torch.Tensor | float | None = None  # the last step's (``last_grad_norm``)
        self.last_loss_count: float | None = None
        self.last_stats: IterationStats | None = None
        self.observers = Observers()

        error, groups = check_arguments(self.world_size, model, optimizer, zero_stage, plan, max_grad_norm,
                                        bucket_size_mb)
        checked = check_policies(model, mixed_precision, config.nonfinite, config.max_consecutive_skips)
        agree_setup(self.comm, error or checked.error, model, zero_stage, plan, checked.signature)
        assert plan is not None
        self.mixed_precision: MixedPrecision | None = checked.precision
        scale_config = checked.precision.loss_scale if checked.precision is not None else None
        self.loss_scaler: LossScaler | None = LossScaler(scale_config) if scale_config is not None else None
        self.nonfinite = NonFiniteGuard(checked.nonfinite, config.max_consecutive_skips)
        self.skip_report = SkipReport(config.skip_report)
        self.zero_stage = zero_stage
        self.shards = Shards(plan.shard_weights)  # how the sharded state is cut, as built
        self.plan: Plan | None = None  # set by set_plan below
        self._replicas_stale = False  # a step left ranks out since the whole parameters were last gathered
        self._step_scope = contextlib.ExitStack()  # the iteration's collectives run over the ranks in the step
        self._stepping = False
        self.stage: ZeroStage = build_stage(zero_stage, model, optimizer, self.comm, groups, bucket_size_mb,
                                            wrap_policy, StagePrecision.of(self.mixed_precision),
                                            StageHooks(self.observers.transient_allocated, self.observers.host_copy),
                                            self.shards)
        self.set_plan(plan, PlanCheck.LOCAL)  # and the optimizer where the plan's row keeps it
        # after the stage: its block hooks run around the checkpoint's (docs/design.md §3.8)
        self.activation_checkpointing = checkpointing.setup(
            self.comm, model, activation_checkpointing, wrap_policy, self.stage.block_names())
        self._micro_step: MicroStep | None = None
        self._user_forward = contextlib.ExitStack()  # the ledger scope of a user loop's forward
        self._losses = LossAccumulator(self.comm.device)
        # the first hook opens a micro-step of a loop of the user's own (and stamps the ZeRO-3 root
        # gather with it); the second tells observers the forward starts, after any root gather
        model.register_forward_pre_hook(eager_hook(self._open_user_micro_step), with_kwargs=True,
                                        prepend=True)
        model.register_forward_pre_hook(eager_hook(self._forward_pre_hook))
        model.register_forward_hook(eager_hook(self._forward_post_hook))
        self._reset_iteration()

    # ------------------------------------------------------------------ set-up
    def add_observer(self, observer: StepObserver) -> ObserverHandle:
        """Call ``observer`` at the step's points from now on; ``handle.remove()`` detaches it."""
        return self.observers.add(observer)

    # ------------------------------------------------------------------ plan
    def set_plan(self, plan: Plan, check: PlanCheck = PlanCheck.AGREE) -> None:
        """Use ``plan`` from the next iteration on. Every rank must call it, between iterations,
        with the same plan: checked by every rank together (``PlanCheck.AGREE``: a
        ``DistributedError`` on every rank otherwise), or on this rank alone (``PlanCheck.LOCAL``,
        no collective, for callers whose ranks derive the plan from data they already agreed on:
        the profiler switches plans every timing round; a ``PlanError`` if it is not valid).
        Other shard weights re-shard the state first (every rank together, ``ZeroStage.reshard``);
        this rank's row says where its optimizer steps (``ZeroStage.place_optimizer``)."""
        if check is PlanCheck.AGREE:
            error = (plan_problem(plan, self.world_size, self.zero_stage, bool(self._micro_steps))
                     or self._left_out_problem(plan))
            digest = hashlib.sha256(plan.to_json().encode()).hexdigest() if error is None else None
            self.comm.agree(error, "set_plan", digest,
                            mismatch="ranks were given different plans; pass the same plan to every rank")
        elif (problem := plan.problem(self.world_size) or self._left_out_problem(plan)
              or compression_problem(plan, self.zero_stage)) is not None:
            raise PlanError(problem)  # edited since it was built?
        previous = self.plan
        self._refresh_replicas()  # a rank that sat out steps: its whole parameters, before any re-cut
        if previous is not None and previous.left_out and previous.step_ranks != plan.step_ranks:
            with self.comm.ledger.scope(Phase.STATE):
                self.stage.share_step_agreements()
        shards = Shards(plan.shard_weights)
        if not shards.cuts_like(self.shards):
            if self._micro_steps:
                raise PlanError("set_plan() with other shard weights inside an iteration; call it between iterations")
            with self.comm.ledger.scope(Phase.STATE):  # every rank together: they have the same plan
                self.stage.reshard(shards)
            self.shards = shards
        self.plan, self.rank_plan, self.global_batch_size = plan, plan.ranks[self.rank], plan.global_batch_size
        self.stage.place_optimizer(self.rank_plan.offload)
        # every rank together: the route's objects built once per route, a step's groups once per set
        # of ranks; on one node the flat collectives, with ranks left out the step's own nodes' (§3.12)
        self.stage.use_route(self.comm.configure(plan.route))

    def _left_out_problem(self, plan: Plan) -> str | None:
        """Why this runtime cannot leave ``plan``'s ranks out of the step, or None (§3.12)."""
        if not plan.left_out:
            return None
        if self.loss_scaler is not None:
            return (f"the plan leaves ranks {list(plan.left_out)} out of the step under fp16 loss scaling, whose scale "
                    "a rank that sits out would not follow; use bf16 or fp32, or give every rank samples")
        return None

    def _refresh_replicas(self) -> None:
        """After steps that left ranks out, bring their whole parameters (stages 1/2) up to date: a
        state collective over the world, between iterations."""
        if self._replicas_stale:
            with self.comm.ledger.scope(Phase.STATE):
                self.stage.refresh_replicas()
            self._replicas_stale = False

    def restore_iteration(self, iteration: int) -> None:
        """Continue counting from ``iteration`` (a loaded checkpoint's), between iterations."""
        self.iteration = iteration
        self._reset_iteration()

    # ------------------------------------------------------------------ one iteration
    def train_step(self, batch: Any, loss_fn: LossFn | None = None) -> float:
        """Run this rank's micro-steps on ``batch`` (its n_i samples), reduce, clip, step.

        ``loss_fn(module, micro_batch)`` returns the mean loss over the micro-batch, or a pair
        ``(loss_sum, count)`` (default: the runtime's ``loss_fn``). Returns the global mean loss,
        per sample or per counted item (NaN if the global count is 0), the same float on every rank.
        """
        if not self.comm.in_step:
            return self._sit_out(batch)
        self._begin_iteration()
        loss_fn = loss_fn if loss_fn is not None else self.loss_fn
        error, cause = check_batch(batch, self.rank_plan, loss_fn)
        start, sizes = 0, self.rank_plan.micro_batch_sizes() if error is None else []
        for k, m in enumerate(sizes):
            if k == len(sizes) - 1:
                self.stage.last_micro_step()
            failure = self._run_micro_step(batch, start, m, k, loss_fn)
            if failure is not None:
                error, cause = f"micro-step {k}: {type(failure).__name__}: {failure}", failure
                release_frames(failure)  # its activations are freed now, not by a later gc
                break
            start += m
        return self._finish_iteration(error, cause)

    def _run_micro_step(self, batch: Any, start: int, m: int, k: int, loss_fn: LossFn) -> Exception | None:
        """Forward and backward of micro-step ``k`` (``m`` samples from ``start``); the error, if
        it raised (the stage's collectives of the micro-step are then completed with zeros)."""
        t0, comm0 = time.perf_counter(), self.comm_ledger.total_seconds
        step = self._open_micro_step(m)
        try:
            with self.comm_ledger.scope(Phase.FORWARD, micro_step=k):
                self.stage.begin_micro_step()
                loss = loss_fn(self.module, slice_batch(batch, start, m))
            self.backward(loss, m)
        except Exception as e:  # reported to every rank at the status reduction
            self._abort_micro_step(step, e, k)
            return e
        if self.comm.device.type == "cuda":  # the compute stream only: collectives still in flight are
            torch.cuda.current_stream(self.comm.device).synchronize()  # not compute (comm.ledger's Note)
        self._compute_s += time.perf_counter() - t0 - (self.comm_ledger.total_seconds - comm0)
        return None

    def _sit_out(self, batch: Any) -> float:
        """An iteration on a rank the plan leaves out (docs/design.md §3.12): no sample and no
        collective of the step, only the iteration's status reduction, which every rank joins, so
        an error on any rank (this one's: a batch that is not empty) is the same error on every
        rank, and the loss is the same float; the iteration is counted, so the ranks' counts
        agree at the next state collective."""
        return self._finish_iteration(left_out_batch_error(batch), None)

    def _begin_iteration(self) -> None:
        self._enter_step()
        if self._started is None:
            self._started = self.iteration
            self._iter_start = time.perf_counter()
            self.observers.iteration_start(self.iteration)

    def _open_micro_step(self, batch_size: int) -> MicroStep:
        self._begin_iteration()
        self._tell_last_lockstep()
        step = self._micro_step = MicroStep(self.iteration, self._micro_steps, batch_size)
        self.observers.micro_step_start(step)
        return step

    def _tell_last_lockstep(self) -> None:
        """The stage learns when the micro-step about to run (or be joined with zeros) is the
        iteration's last lock-step one (``ZeroStage.last_lockstep_micro_step``)."""
        if self.stage.communicates_in_micro_steps and self._micro_steps == self.plan.max_micro_steps - 1:
            self.stage.last_lockstep_micro_step()

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

    def backward(self, loss: torch.Tensor | tuple[torch.Tensor, Any], num_samples: int) -> None:
        """Backward of one micro-step of ``num_samples`` samples whose ``loss`` is their mean, or a
        pair ``(loss_sum, count)`` (one kind per iteration on every rank; docs/design.md §2).
        For your own loop: call it once per micro-step of this rank's plan row, then ``step()``.
        At stages 2/3 it runs the micro-step's collectives, so every rank must call it no more
        often than the plan's largest micro-step count; ``step()`` fills in the rest with zeros.
        """
        if self.stage.communicates_in_micro_steps and self._micro_steps >= self.plan.max_micro_steps:
            raise RuntimeError(
                f"backward called {self._micro_steps + 1} times in one iteration but the plan's largest "
                f"micro-step count is {self.plan.max_micro_steps}; call step() after this rank's micro-steps")
        # in fp32 even for a bf16/fp16 loss: the scaled loss of fp16 would overflow
        objective = self._losses.objective(loss, num_samples, self.global_batch_size)
        step = self._micro_step if self._micro_step is not None else self._open_micro_step(num_samples)
        self._user_forward.close()
        self.observers.backward_start(step, objective)
        with self.comm_ledger.scope(Phase.BACKWARD, micro_step=self._micro_steps):
            (objective * self.loss_scale).backward()
            self.observers.collectives_completing(step)
            self.stage.end_micro_step()
        # the micro-step's collectives are complete: counted now, so that an error raised by an
        # observer from here on (an out-of-memory error a device reports when backward returns)
        # does not make the clean-up issue them a second time, which no other rank would match
        self._micro_steps += 1
        self._micro_step = None
        self.observers.backward_end(step)
        self.observers.micro_step_end(step)

    def step(self) -> float:
        """End the iteration: reduce gradients, clip, step, zero. Returns the global mean loss
        (on a rank the plan leaves out too: it joins the status reduction alone, with no backward
        before it)."""
        if not self.comm.in_step:
            return self._sit_out(None)
        self._enter_step()
        return self._finish_iteration(None, None)

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None: the step was skipped). The
        step keeps it on the device (``clip_and_unscale``); the first read here waits for it."""
        if isinstance(self._grad_norm, torch.Tensor):
            self._grad_norm = float(self._grad_norm)
        return self._grad_norm

    def _enter_step(self) -> None:
        """From here to the iteration's end its collectives run over the ranks in the step."""
        if not self._stepping:
            self._step_scope.enter_context(self.comm.step_collectives())
            self._stepping = True

    def _finish_iteration(self, error: str | None, cause: BaseException | None) -> float:
        """The iteration's end on every rank: on a rank left out, the status reduction and the
        verdict alone (no collective of the step; nothing to step)."""
        in_step = self.comm.in_step
        if in_step and self.stage.communicates_in_micro_steps:
            while self._micro_steps < self.plan.max_micro_steps:  # join the others' micro-steps with zeros
                self._tell_last_lockstep()
                with self.comm_ledger.scope(Phase.BACKWARD, micro_step=self._micro_steps):
                    self.stage.empty_micro_step()
                self._micro_steps += 1
        with self.comm_ledger.scope(Phase.STEP, micro_step=-1):
            if in_step:
                self.stage.close_micro_steps()
            status = self._agree_status(error, cause)
            self._grad_norm = None  # a skipped step has none
            if status.nonfinite_ranks:
                self._skip_step(status)
            elif status.empty:
                self._skip_empty_step()
            elif in_step:
                self._take_step(self._losses.divisor(status))
            else:
                self.nonfinite.on_step()  # the others stepped: the guard's count of skips in a row ends
            self._losses.end_iteration(status)
        self._replicas_stale = self._replicas_stale or bool(self.plan.left_out)
        wall = time.perf_counter() - self._iter_start
        comm_s = self.comm_ledger.seconds(iteration=self.iteration)
        compute_s = (self._compute_s or max(0.0, wall - comm_s)) if in_step else 0.0
        self.last_stats = IterationStats(self.iteration, wall, compute_s, comm_s, self._losses.samples,
                                         self._micro_steps, status.rank_compute_s, status.rank_samples)
        self.last_loss_count = status.count if status.sum_ranks else None
        self.iteration += 1
        self._reset_iteration()
        if in_step:
            self.observers.iteration_end(self.last_stats)
        return status.mean_loss(self.global_batch_size)

    def _agree_status(self, error: str | None, cause: BaseException | None) -> IterationStatus:
        """The iteration's status reduction (``poplar.zero.iteration_status``): one all-reduce of
        every rank's loss sum, samples, count, loss kind and failed and non-finite flags. Any
        failure raises on every rank, with no optimizer step.

        [Note: the status is the world's] It runs over every rank, a rank the plan leaves out of
        the step included (with no samples, its loss sum and count 0), and so does the gather of
        the failing ranks' messages after it: a rank left out that ran no collective of the
        iteration would otherwise not learn that a rank in the step failed, and the ranks in the
        step would raise while it went on to the loop's next agreement over the world, where it
        waits for peers that left (a closed connection, or a timeout, instead of the error). The
        rank left out waits here for the step's forward and backward, no longer than an
        iteration, as the loop's own agreements hold it anyway (docs/design.md §3.12)."""
        error = error if error is not None else self._losses.error
        flag = nonfinite_flag(self.stage.held_grads(), self._losses.loss_sum, self.stage.held_grads_limit)
        said = None
        with self.comm.world_collectives():
            status = reduce_status(self.comm, self._losses, error is not None, flag, self._compute_s)
            if status.failed_ranks:  # before the iteration is abandoned: that leaves the step's scope
                said = self.comm.all_gather_object(None if error is None else (error, failure_kind(cause)),
                                                   tag="status")
        if said is not None:
            self._abandon_iteration()
            raise IterationFailed(failure_message(self.iteration, [m and m[0] for m in said]), self.iteration,
                                  {r: m[1] for r, m in enumerate(said) if m is not None}) from cause
        agreed_error = status_error(status, self.iteration, self.global_batch_size, self.world_size)
        if agreed_error is not None:
            self._abandon_iteration()
            raise DistributedError(agreed_error)
        return status

    def _take_step(self, divisor: float) -> None:
        self.stage.reduce_gradients()
        norm = clip_and_unscale(self.stage.grad_tensors(), self.comm, self.stage.grads_sharded, self.max_grad_norm,
                                self.loss_scale * divisor)
        self._grad_norm = norm
        self.stage.optimizer_step()
        self.stage.zero_grad()
        self.nonfinite.on_step()
        if self.loss_scaler is not None:
            self.loss_scaler.on_good_step()

    def _skip_step(self, status: IterationStatus) -> None:
        """Some rank saw an inf or NaN: every rank drops the gradients and takes no step, and the
        loss scale backs off; the policy may raise instead, on every rank alike."""
        scaler, old_scale = self.loss_scaler, self.loss_scale
        verdict = self.nonfinite.on_nonfinite(counted=scaler is None or scaler.at_minimum)
        details = None
        if verdict is not Verdict.SKIP:  # every rank takes this branch: name the ranks
            detail = local_detail(self.stage.held_grads(), self._losses.loss_sum, self.stage.held_grads_limit)
            with self.comm.world_collectives():  # as the status reduction: every rank, left out or not
                details = self.comm.all_gather_object(detail, tag="status")
        self.stage.zero_grad()
        if scaler is not None:
            scaler.on_overflow()
        if details is not None:
            message = self.nonfinite.message(verdict, self.iteration, details)
            self._reset_iteration()
            raise DistributedError(message)
        if self.rank == 0 and self.skip_report is SkipReport.LOG:
            where = where_nonfinite(status.loss_nonfinite_ranks, status.nonfinite_ranks, self.world_size,
                                    self.stage.grads_sharded)
            log.warning(self.nonfinite.warning(self.iteration, where,
                                               (old_scale, self.loss_scale) if scaler is not None else None))

    def _skip_empty_step(self) -> None:
        """Sum losses counting 0 items in all: 0/0, skipped as a non-finite step (§2) or raised."""
        self.stage.zero_grad()
        if (error := skip_empty_step(self.nonfinite, self.iteration, self.rank)) is not None:
            self._reset_iteration()
            raise DistributedError(error)

    def _abandon_iteration(self) -> None:
        self.stage.zero_grad()
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self._losses.reset()
        self._micro_steps = 0
        self._micro_step = None
        self._compute_s = 0.0
        self._started: int | None = None  # the iteration whose iteration_start observers saw
        self._iter_start = time.perf_counter()
        self._user_forward.close()
        self._step_scope.close()
        self._stepping = False
        self.comm_ledger.start_iteration(self.iteration)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale of the next iteration (1.0 without loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def shard_weights(self) -> tuple[float, ...]:
        """Each rank's shard weight the state is cut by now (``Plan.shard_weights``)."""
        return self.shards.weights

    @property
    def skipped_steps(self) -> int:
        """Iterations whose optimizer step was skipped for a non-finite loss or gradient."""
        return self.nonfinite.skipped_steps

    @property
    def in_iteration(self) -> bool:  # between an iteration's first micro-step and its step(): no save, load or set_plan
        return self._started is not None

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete unsharded model state (keys as ``model.state_dict()``), on every rank."""
        self._refresh_replicas()
        return self.stage.full_state_dict()

    def state_specs(self) -> dict[str, StateSpec]:
        """``full_state_dict``'s names, shapes and dtypes, with nothing gathered."""
        return self.stage.state_specs()

    def state_parts(self) -> Iterator[StatePart]:
        """``full_state_dict``'s values one part (at most one ZeRO-3 block) at a time: a collective
        every rank runs to its end, between iterations (``poplar.zero.state_parts``)."""
        self._refresh_replicas()
        return self.stage.state_parts()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params`` (the copy the model computes with), ``master_params``
        (fp32 masters kept apart under mixed precision), ``grads``, ``optimizer``, ``buffers`` and
        ``comm_buffers`` (peak of temporary communication buffers); stage 3: ``gathered_params``
        and ``secondary_params`` (the node-local secondary shards kept, ``Collectives.SECONDARY_SHARDS``)."""
        return self.stage.memory_report()


NORM_ROW = 1024  # elements per row of the gradient norm's pass (``square_sum``)


def clip_and_unscale(grads: list[torch.Tensor], comm: Communicator, sharded: bool, max_norm: float | None,
                     divisor: float = 1.0) -> torch.Tensor:
    """Divide ``grads`` by ``divisor`` and clip them to ``max_norm`` (None: no clipping), in place.
    Returns the global norm of the divided gradients before clipping: a float64 number on the
    device. Nothing here waits for the device: the clipping coefficient is computed and applied
    there, as ``torch.nn.utils.clip_grad_norm_`` does, so on a GPU the optimizer's kernels queue
    behind these at once instead of after a round trip to the host (``last_grad_norm`` reads the
    norm when asked).

    The gradients a rank holds after ``reduce_gradients`` are the full reduced gradients (stage 0)
    or its shards (stages 1-3, whose squared norms are summed over ranks in one all-reduce). They
    are ``divisor`` times the true gradients: the fp16 loss scale, times the global count when the
    losses were (loss_sum, count) pairs (docs/design.md §2). The norm is divided by the divisor, and
    the division and the clipping coefficient become one multiply of each buffer. The norm is
    measured with clipping off too (the run's records report it beside the loss): at stages 1-3
    that is the same one-scalar all-reduce; the status reduction cannot carry it, as it precedes
    the gradient reduction whose result the norm is of."""
    sq = square_sum(grads, comm.device)
    if sharded:
        sq = sq.reshape(1)
        comm.all_reduce(sq, tag="grad_norm")
    norm = sq.sum().sqrt() / divisor
    if max_norm is not None:  # float64 as the norm; a multiply by exactly 1 changes no gradient
        factor: torch.Tensor | float = torch.clamp(max_norm / (norm + 1e-6), max=1.0) / divisor
    elif divisor != 1.0:
        factor = 1.0 / divisor
    else:
        return norm
    # a gradient elsewhere (on the host) takes its own copy of the factor; on a GPU a 2-byte gradient
    # (a model kept in bf16 itself; mixed precision accumulates in fp32) takes it rounded to its dtype
    for g in grads:
        g.mul_(factor.to(g.device) if isinstance(factor, torch.Tensor) and factor.device != g.device else factor)
    return norm


def square_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of ``grads``: a float64 number on ``device``.

    [Note: the norm's pass] Every step reports its gradient norm, so this pass runs every step
    over every gradient this rank holds. Each buffer is read once, as rows of ``NORM_ROW``
    elements whose 2-norms are taken in the buffer's precision (fp32 for fp32 and 2-byte
    buffers), and only those row norms are squared and summed in float64. A row of 1 024 fp32
    numbers sums with a relative error near 1e-7 and the rows' errors do not add up, so the
    total agrees with a float64 pass to about 1e-9 (measured: 3.6e-10 on 25 M elements), while
    a float64 copy of every buffer (the plain way) costs two 8-byte temporaries per element and
    ran 90x slower on a CPU; a single fp32 reduction of a whole buffer was off by 1.4e-3 there."""
    rows: list[torch.Tensor] = []
    for g in grads:
        flat = g.detach().reshape(-1)
        dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        whole = flat.numel() // NORM_ROW * NORM_ROW
        if whole:
            rows.append(torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1, dtype=dtype).to(device))
        if whole < flat.numel():
            rows.append(torch.linalg.vector_norm(flat[whole:], dtype=dtype).reshape(1).to(device))
    if not rows:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.cat(rows).double().pow(2).sum()
