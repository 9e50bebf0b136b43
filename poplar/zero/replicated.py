"""ZeRO stages 0, 1 and 2: every rank holds the full parameters; gradients and optimizer state
are sharded progressively.

Parameters become views into per-unit flat buffers (a unit = a gradient bucket). Backward
hands each gradient over to its unit's flat gradient buffer through a post-accumulate hook.

- Stage 0: full flat gradients persist and are all-reduced (summed) once per iteration.
- Stage 1: full flat gradients persist, are reduce-scattered once per iteration; the optimizer
  steps this rank's shard, and updated shards are all-gathered.
- Stage 2: only the gradient shard persists. Each unit is reduce-scattered asynchronously as
  soon as its gradients (and those of every earlier unit) are ready in backward, so the
  collective order is the fixed unit order on every rank; what is not ready when backward
  returns (unused parameters) is sent as zeros. A rank with fewer micro-steps sends zeros.
  At most two reduce-scatters are left in flight (``poplar.zero.reduce_queue``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from poplar.zero.base import ZeroStage
from poplar.comm import Communicator
from poplar.zero.flat import FlatUnit
from poplar.zero.optim import repoint_optimizer
from poplar.zero.reduce_queue import ReduceHandle, ReduceQueue


class ReplicatedParams(ZeroStage):
    """Shared by stages 0-2: flat parameter buffers and the gradient hand-over hook."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                 units: list[FlatUnit]) -> None:
        super().__init__(model, optimizer, comm, units)
        self.flat_params = []
        for u in units:
            flat = u.new_flat()
            u.copy_params_into(flat)
            u.point_params_at(flat)
            self.flat_params.append(flat)
        self._hooks = []
        for ui, u in enumerate(units):
            for si, p in enumerate(u.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(ui, si)))

    def _make_hook(self, ui: int, si: int) -> Any:
        def hook(p: nn.Parameter) -> None:
            self._grad_ready(ui, si, p.grad)
            p.grad = None
        return hook

    @abstractmethod
    def _grad_ready(self, ui: int, si: int, grad: torch.Tensor) -> None:
        """Take parameter ``si`` of unit ``ui``'s fresh gradient from backward."""

    def param_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flat_params)

    def _shard_params(self) -> list[nn.Parameter]:
        """One optimizer parameter per unit: a view of this rank's slice of the flat buffer, so
        the optimizer's in-place update lands in the flat buffer."""
        shards = []
        for u, flat in zip(self.units, self.flat_params):
            shards.append(nn.Parameter(u.shard_of(flat), requires_grad=True))
        groups: list[list[nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        for u, s in zip(self.units, shards):
            groups[u.group_index].append(s)
        repoint_optimizer(self.optimizer, groups)
        return shards

    def sync_params(self) -> None:
        """Every rank takes each shard from its owner (after a step; at setup this also makes
        ranks that built different initial weights agree)."""
        for u, flat in zip(self.units, self.flat_params):
            local = u.shard_of(flat).detach().clone()  # the input must not alias the output
            self._hold(local.numel() * local.element_size())
            self.comm.all_gather(flat, local, tag=f"unit{u.index}")
            self._release(local.numel() * local.element_size())


class Stage0(ReplicatedParams):
    stage = 0
    grads_sharded = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.flat_grads = [u.new_flat() for u in self.units]

    def _grad_ready(self, ui: int, si: int, grad: torch.Tensor) -> None:
        self.units[ui].slot(self.flat_grads[ui], si).add_(grad)

    def reduce_gradients(self) -> None:
        for u, g in zip(self.units, self.flat_grads):
            self.comm.all_reduce(g, tag=f"unit{u.index}")

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.flat_grads

    def optimizer_step(self) -> None:
        for u, g in zip(self.units, self.flat_grads):
            for si, p in enumerate(u.params):
                p.grad = u.slot(g, si)
        self.optimizer.step()
        for u in self.units:
            for p in u.params:
                p.grad = None

    def zero_grad(self) -> None:
        for g in self.flat_grads:
            g.zero_()

    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.flat_grads)


class Stage1(Stage0):
    stage = 1
    grads_sharded = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.shard_params = self._shard_params()

    def reduce_gradients(self) -> None:
        for u, g, s in zip(self.units, self.flat_grads, self.shard_params):
            # the reduced shard lands in this rank's slice of the flat gradient (via a temporary:
            # the output of a reduce-scatter must not alias its input)
            out = u.new_shard()
            self._hold(out.numel() * out.element_size())
            self.comm.reduce_scatter(out, g, tag=f"unit{u.index}")
            shard = u.shard_of(g)
            shard.copy_(out)
            self._release(out.numel() * out.element_size())
            s.grad = shard

    def grad_tensors(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shard_params]

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.sync_params()

    def zero_grad(self) -> None:
        super().zero_grad()
        for s in self.shard_params:
            s.grad = None


class Stage2(ReplicatedParams):
    stage = 2
    communicates_in_micro_steps = True
    reduces_in_flight = 2  # reduce-scatters overlapping backward; each holds one full bucket

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.shard_params = self._shard_params()
        self.shard_grads = [u.new_shard() for u in self.units]
        self._reduces = ReduceQueue(self.reduces_in_flight, self._release)
        self._reset_micro_step()

    def _reset_micro_step(self) -> None:
        self._buckets: list[torch.Tensor | None] = [None] * len(self.units)
        self._ready = [0] * len(self.units)
        self._next = 0  # next unit to reduce-scatter: units go out in a fixed order

    def _bucket(self, ui: int) -> torch.Tensor:
        if self._buckets[ui] is None:
            u = self.units[ui]
            self._buckets[ui] = u.new_flat()
            self._hold(u.padded_numel * u.element_size)
        return self._buckets[ui]

    def _grad_ready(self, ui: int, si: int, grad: torch.Tensor) -> None:
        if ui < self._next:
            raise RuntimeError(
                f"a gradient of '{self.units[ui].names[si]}' arrived after its bucket was reduced; at ZeRO-2 "
                "call backward once per micro-step (through the engine)")
        u = self.units[ui]
        u.slot(self._bucket(ui), si).add_(grad)
        self._ready[ui] += 1
        while self._next < len(self.units) and self._ready[self._next] >= len(self.units[self._next].params):
            self._issue(self._next)

    def _issue(self, ui: int) -> None:
        """Reduce-scatter unit ``ui``'s bucket into its gradient shard (the handle keeps the bucket)."""
        u = self.units[ui]
        out = u.new_shard()
        out_bytes = out.numel() * out.element_size()
        self._hold(out_bytes)
        bucket = self._bucket(ui)
        work = self.comm.reduce_scatter(out, bucket, tag=f"unit{u.index}", async_op=True)
        self._buckets[ui] = None
        self._next = ui + 1
        self._reduces.push(ReduceHandle(work, out, bucket, self.shard_grads[ui],
                                        out_bytes + u.padded_numel * u.element_size))

    def end_micro_step(self) -> None:
        while self._next < len(self.units):  # unused parameters: their gradient is zero
            self._issue(self._next)
        self._reduces.drain()
        self._reset_micro_step()

    def empty_micro_step(self) -> None:
        self.end_micro_step()

    def reduce_gradients(self) -> None:
        for s, g in zip(self.shard_params, self.shard_grads):
            s.grad = g

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.shard_grads

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.sync_params()

    def zero_grad(self) -> None:
        for s, g in zip(self.shard_params, self.shard_grads):
            g.zero_()
            s.grad = None

    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.shard_grads)
