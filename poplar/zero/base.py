"""What every ZeRO stage provides to the engine.

The engine drives an iteration as: for each micro-step ``begin_micro_step`` → forward →
backward → ``end_micro_step`` (or ``empty_micro_step`` when this rank has no samples left but
the stage communicates inside micro-steps), then ``reduce_gradients`` → clipping on
``grad_tensors`` → ``optimizer_step`` → ``zero_grad``. A stage decides what each rank holds
and which collectives run where; under mixed precision (``StagePrecision``) it also keeps the
fp32 master apart from the low-precision copy the model computes with.

[Note: gradient hooks hold their stage weakly]
A hook registered with ``Tensor.register_post_accumulate_grad_hook`` is kept by the parameter's
C++ side, where Python's cycle collector cannot see it. A hook that refers to the ZeRO stage,
which refers to the module and so back to the parameter, therefore forms a cycle the collector
can never free: every engine ever built (each profiler trial builds one) would stay alive with
its model. The stages' hooks (``on_grad_accumulated``) reach their owner through a weak
reference and carry only plain values.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from poplar.comm import Communicator
from poplar.comm.routes import Routes
from poplar.types.compression import EXACT, CommPolicy
from poplar.types.plans import Offload
from poplar.zero.flat import FlatUnit
from poplar.zero.observers import CopyDirection
from poplar.zero.offload import OptimizerOffload
from poplar.zero.optim import optimizer_state_bytes
from poplar.zero.precision import ModelCast, StagePrecision, cast_inputs
from poplar.zero.shard_layout import Shards
from poplar.zero.state_parts import StatePart, StateSpec


def on_grad_accumulated(param: torch.Tensor, method: Callable[..., Any], *args: int) -> RemovableHandle:
    """Call ``method(*args, param)`` after ``param``'s gradient is accumulated, for as long as
    ``method``'s object lives (Note: gradient hooks hold their stage weakly). ``method`` must be
    a bound method; ``args`` plain indices (never the module or anything that refers to it)."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, p)

    return param.register_post_accumulate_grad_hook(hook)


class StageHooks(NamedTuple):
    """What a stage tells its runtime's observers as it happens (``poplar.zero.observers``): each
    transient buffer it allocates (a ZeRO-3 gathered block) and an offloading rank's host copies."""

    transient_allocated: Callable[[], None] | None = None
    host_copy: Callable[[CopyDirection, int], None] | None = None


class ZeroStage(ABC):
    stage: int = -1
    communicates_in_micro_steps: bool = False  # True for 2 and 3: every rank must join each micro-step
    grads_sharded: bool = True  # False when every rank holds the full reduced gradient (stage 0)
    gathered_bytes: int = 0  # stage 3: gathered parameter bytes alive now
    compression: CommPolicy = EXACT  # which collectives send quantized values (``use_route``)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                 units: list[FlatUnit], precision: StagePrecision = StagePrecision(),
                 hooks: StageHooks | None = None) -> None:
        self.model, self.optimizer, self.comm, self.units = model, optimizer, comm, units
        self.hooks = hooks or StageHooks()
        self.precision = precision
        self.peak_transient_bytes = 0  # largest communication buffers held at once, measured
        self._transient = 0
        self.model_cast: ModelCast | None = None  # frozen parameters and buffers in the compute dtype
        self.offload = OptimizerOffload(optimizer, comm.device, self.hooks.host_copy)  # where the optimizer steps (``place_optimizer``)
        if precision.compute is not None:
            self.model_cast = ModelCast(model, precision)
            model.register_forward_pre_hook(cast_inputs(precision.compute), with_kwargs=True)

    # -- bookkeeping of temporary communication buffers (reported by memory_report) --
    def _hold(self, nbytes: int) -> None:
        self._transient += nbytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._transient)

    def _release(self, nbytes: int) -> None:
        self._transient -= nbytes

    @property
    def transient_bytes(self) -> int:
        """Communication buffers held right now (stage-2 buckets, stage-1 temporaries, ...)."""
        return self._transient

    def block_names(self) -> list[str] | None:
        """Names of the modules gathered and released as one (ZeRO-3's blocks); None below it."""
        return None

    # -- the iteration, as the engine drives it --
    def begin_micro_step(self) -> None:
        pass

    def end_micro_step(self) -> None:
        pass

    def empty_micro_step(self) -> None:
        """Take part in a micro-step's collectives with a zero contribution."""

    def last_micro_step(self) -> None:
        """The micro-step about to run is this rank's last of the iteration (the engine's
        ``train_step`` knows it): a stage may start its closing reduction as backward produces
        the gradients."""

    def last_lockstep_micro_step(self) -> None:
        """The micro-step about to run on this rank, or the empty one it is about to join, is the
        iteration's last lock-step micro-step (the plan's largest count; the runtime knows it): a
        stage that crosses nodes once per iteration may start its exchange as that micro-step's
        reductions complete (``reduce_queue.NodeExchanges``)."""

    def close_micro_steps(self) -> None:
        """Every micro-step of this rank is over (or failed): send whatever of the closing
        reduction is still owed and complete it, before the iteration's status reduction, so every
        rank issues the same collectives in the same order whatever its micro-steps did."""

    @abstractmethod
    def reduce_gradients(self) -> None:
        ...

    @abstractmethod
    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients this rank holds after ``reduce_gradients`` (full or shard)."""
        ...

    @abstractmethod
    def held_grads(self) -> list[torch.Tensor]:
        """The gradients this rank holds before ``reduce_gradients`` (stages 0/1: local, not
        reduced; stages 2/3: reduced shards), which the non-finite check reads. Stage 0 sums its
        gradients in place before the check: it gives each one's summary taken before it was sent
        (``nonfinite.grad_summary``), which the check reads as the gradient itself."""
        ...

    @property
    def held_grads_limit(self) -> float | None:
        """The largest magnitude ``held_grads`` may have and still be reduced without overflow
        (None: being finite is enough)."""
        return None

    def reshard(self, shards: Shards) -> None:
        """Hold shares of the sharded state by new ``shards`` from the next iteration on (every rank
        together, between iterations); a stage that shards nothing keeps what it has. An
        offloaded optimizer (and fp32 master) comes back to the device for the re-cut and goes out
        again after, with the new shards."""
        placement = self.offload.placement
        self.place_optimizer(Offload.NONE)
        try:
            self._reshard(shards)
        finally:
            self.place_optimizer(placement)

    def _reshard(self, shards: Shards) -> None:
        """Re-cut this stage's shards by ``shards`` (the optimizer steps its device shards)."""

    def refresh_replicas(self) -> None:
        """Bring the whole parameters every rank keeps up to date from their owners' shards (every
        rank together, between iterations): a rank left out of some steps (docs/design.md §3.12)
        holds stale ones. Stage 3 keeps no whole parameters."""

    def share_step_agreements(self) -> None:
        """Give ranks that sat out the iterations where the ranks in the step agreed on something
        (ZeRO-3: the blocks' order) what was agreed (every rank together, between iterations)."""

    def use_route(self, routes: Routes) -> None:
        """Run the collectives as the plan's route from the next iteration on (between
        iterations). Its compression quantizes ZeRO-3's parameter gathers
        (``weight_quantization``) and ZeRO-2/3's gradient reduce-scatters
        (``gradient_quantization``); every other collective stays exact: ZeRO-1/2's all-gather of
        updated parameters, the state collectives, the master state. ZeRO-3 also keeps node-local
        secondary shards where the step's route does (``Routes.keeps_secondary``)."""
        self.compression = routes.route.compression

    def place_optimizer(self, offload: Offload) -> None:
        """Keep the optimizer state (and the fp32 master shard it steps) on the device or in host
        memory from the next step on (between iterations; ``poplar.zero.offload``)."""
        if offload is not Offload.NONE and self.stage == 0:
            raise ValueError("ZeRO-0 replicates the optimizer state and has no shard to offload; use "
                             "zero_stage=1, 2 or 3, or offload=Offload.NONE")
        if offload is self.offload.placement:
            return
        self.offload.place(offload, self.compute_copies() if offload is not Offload.NONE else None)
        if offload is Offload.NONE:
            self.drop_compute_copies()

    def compute_copies(self) -> dict[int, torch.Tensor] | None:
        """Mixed precision: by ``id`` of each optimizer parameter (an fp32 master shard), the
        device tensor in the compute dtype that holds its values while the master lives on the
        host; None where the device shard is itself what the stage computes with (it stays)."""
        return None

    def drop_compute_copies(self) -> None:
        """The master is back on the device: free what ``compute_copies`` allocated, if anything."""

    @abstractmethod
    def optimizer_step(self) -> None:
        ...

    @abstractmethod
    def zero_grad(self) -> None:
        ...

    # -- state --
    def optimizer_segments(self) -> list[tuple[torch.Tensor, list[tuple[str, int, int, int]]]]:
        """Where each optimizer parameter's elements live in the model, independent of sharding.

        For every parameter the optimizer holds: a list of (model parameter name, element
        offset in that parameter, length, element offset in the optimizer parameter). Padding
        belongs to no name. Checkpoints save optimizer state by these names and ranges, so
        they load on any world size, stage or plan.
        """
        shard_params = getattr(self, "shard_params", None)
        if shard_params is None:  # stage 0: the model's own parameters, or their fp32 masters
            held = getattr(self, "master_params", None) or [u.params for u in self.units]
            return [(p, [(u.names[i], 0, p.numel(), 0)]) for u, ps in zip(self.units, held) for i, p in enumerate(ps)]
        out = []
        for u, shard in zip(self.units, shard_params):
            lo, hi = u.shard_range
            segs = []
            for name, off, shape in zip(u.names, u.offsets, u.shapes):
                a, b = max(lo, off), min(hi, off + shape.numel())
                if a < b:
                    segs.append((name, a - off, b - a, a - lo))
            out.append((self.offload.stepped(shard), segs))
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_specs(self) -> dict[str, StateSpec]:
        """``full_state_dict``'s names, shapes and dtypes, with nothing gathered (``zero.state_parts``)."""
        return {k: StateSpec(tuple(v.shape), v.dtype) for k, v in self.model.state_dict().items()}

    def state_parts(self) -> Iterator[StatePart]:
        """``full_state_dict``'s values one part at a time (``zero.state_parts``): here every rank
        holds every tensor, so a part is one of them, not copied."""
        for k, v in self.model.state_dict().items():
            yield {k: v.detach()}

    def unsharded_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        """The dtype ``unsharded_value`` gives ``tensor``."""
        return tensor.dtype if self.model_cast is None else self.model_cast.original_dtype(tensor)

    def unsharded_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of a tensor of the model no stage holds (a buffer, a frozen parameter), in the
        model's own dtype."""
        return tensor.detach().clone() if self.model_cast is None else self.model_cast.original(tensor)

    def load_unsharded(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        if self.model_cast is None:
            tensor.detach().copy_(value)
        else:
            self.model_cast.load(tensor, value)

    @staticmethod
    def check_state_fits(state: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> None:
        """ValueError unless ``state`` has exactly the keys of ``shapes``, with those shapes."""
        missing = [k for k in shapes if k not in state]
        unexpected = [k for k in state if k not in shapes]
        wrong = [f"{k}: {tuple(state[k].shape)} vs {tuple(v)}" for k, v in shapes.items()
                 if k in state and state[k].shape != v]
        if missing or unexpected or wrong:
            raise ValueError(f"state does not fit the model: missing keys {missing[:5]}, unexpected keys "
                             f"{unexpected[:5]}, shapes (given vs model) {wrong[:5]}")

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the model from a complete, unsharded state (keys and shapes as ``full_state_dict``),
        in place, on every rank, without any collective (every rank is given the whole state).

        Raises ValueError, before changing anything, on missing or unexpected keys or shapes that
        differ. This default copies into the tensors of ``model.state_dict()``: right when every
        rank holds the full parameters as views into the stage's buffers (stages 0-2). A stage
        that keeps only shards (stage 3) must override it and copy each parameter's part of
        ``state`` into its shard.
        """
        targets = self.model.state_dict()
        self.check_state_fits(state, {k: v.shape for k, v in targets.items()})
        with torch.no_grad():
            for k, v in targets.items():
                v.copy_(state[k])
        self.offload.refresh()

    @abstractmethod
    def param_bytes(self) -> int:
        ...

    @abstractmethod
    def grad_bytes(self) -> int:
        ...

    def master_bytes(self) -> int:
        """Bytes of fp32 master weights kept apart from the compute copy (mixed precision)."""
        return 0

    # memory_report keys a rank holds a weighted share of, by stage (§3.1): the optimizer state
    # and any fp32 master from ZeRO-1, the gradients from ZeRO-2, the parameters at ZeRO-3
    SHARDED_KEYS = {0: (), 1: ("optimizer", "master_params"), 2: ("optimizer", "master_params", "grads"),
                    3: ("optimizer", "master_params", "grads", "params")}

    def sharded_bytes(self) -> int:
        """Bytes of this rank's share of the sharded state: what grows or shrinks with its shard
        weight (the rest of its memory does not depend on it)."""
        report = self.memory_report()
        return sum(report.get(key, 0) for key in self.SHARDED_KEYS[self.stage])

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: model states, module buffers, and the peak of the engine's
        temporary communication buffers (``comm_buffers``). ``params`` is the copy the model
        computes with; ``master_params`` the fp32 master kept apart from it (mixed precision).
        An offloading rank's optimizer state is host memory: ``optimizer`` is 0 and the
        ``host_*`` keys count the host bytes."""
        buffers = sum(b.numel() * b.element_size() for b in self.model.buffers())
        frozen = sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.requires_grad)
        cast = self.model_cast.master_bytes if self.model_cast is not None else 0
        return {
            "params": self.param_bytes() + frozen,
            "master_params": self.master_bytes() + cast,
            "grads": self.grad_bytes(),
            "optimizer": 0 if self.offload.active else optimizer_state_bytes(self.optimizer),
            "buffers": buffers,
            "comm_buffers": self.peak_transient_bytes,
            **self.offload.memory_report(),  # an offloading rank's host bytes (``HOST_KEYS``)
        }
