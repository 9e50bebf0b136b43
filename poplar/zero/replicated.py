"""ZeRO stages 0, 1 and 2: every rank holds the full parameters; gradients and optimizer state
are sharded progressively.

Parameters become views into per-unit flat buffers (a unit = a gradient bucket). Backward
hands each gradient over to its unit's flat gradient buffer through a post-accumulate hook.

- Stage 0: full flat gradients persist and are all-reduced (summed) in place once per
  iteration, each unit as the rank's last backward fills it (``Stage0``).
- Stage 1 (``poplar.zero.stage1``): full flat gradients persist, are reduce-scattered once per
  iteration; the optimizer steps this rank's shard, and updated shards are all-gathered.
- Stage 2: only the gradient shard persists. Each unit is reduce-scattered asynchronously as
  soon as its gradients (and those of every earlier unit) are ready in backward, so the
  collective order is the fixed unit order on every rank; what is not ready when backward
  returns (unused parameters) is sent as zeros. A rank with fewer micro-steps sends zeros.
  At most two reduce-scatters are left in flight (``poplar.zero.reduce_queue``). Across nodes
  once per iteration (``Collectives.ONCE_PER_ITERATION``), each reduce-scatter runs inside the
  node into the unit's node accumulator (fp32) and the exchange across nodes runs once, when the
  rank's micro-steps are over (``close_micro_steps``); a rank with fewer micro-steps sends zeros
  inside its node only. A plan that holds this for a share of the parameters (``Route``'s Note:
  a share held) gives the units of that share accumulators; the others cross per micro-step.

Mixed precision (``StagePrecision.compute`` set): the flat buffers the model's parameters view
hold the low-precision copy; the fp32 master is kept apart (``masters``): whole at stage 0, where
every rank steps it identically and casts it into the copy; only this rank's shard at stages 1/2,
where the optimizer steps the shard and the post-step all-gather moves low-precision bytes
straight into the copy. Gradients arrive in the compute dtype and are accumulated into the fp32
flat gradients (or buckets); a lower ``reduce`` dtype is cast for the collective only. A rank that
offloads its optimizer (``poplar.zero.offload``) keeps the master shard on the host only: the
host step's values are cast into this rank's slice of the compute copy, which the all-gather sends.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Iterator, NamedTuple

import torch
from torch import nn

from poplar.zero.base import StageHooks, ZeroStage, on_grad_accumulated
from poplar.comm import Communicator, PendingChain, PendingCollective, Phase
from poplar.comm.hierarchical import ACCUMULATOR_DTYPE
from poplar.comm.routes import Routes
from poplar.zero.flat import FlatUnit
from poplar.zero.nonfinite import grad_summary
from poplar.zero.optim import repoint_optimizer
from poplar.zero.precision import StagePrecision
from poplar.zero.reduce_queue import NodeExchanges, ReduceHandle, ReduceQueue
from poplar.zero.reshard import cut_state, gather_state, shard_from
from poplar.zero.shard_layout import Shards
from poplar.zero.state_parts import StatePart, StateSpec, unsharded_parts, unsharded_specs


class ReplicatedParams(ZeroStage):
    """Shared by stages 0-2: flat parameter buffers and the gradient hand-over hook."""

    master_sharded = True  # mixed precision: each rank keeps only its shard of the fp32 master

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                 units: list[FlatUnit], precision: StagePrecision = StagePrecision(),
                 hooks: StageHooks | None = None) -> None:
        super().__init__(model, optimizer, comm, units, precision, hooks)
        self.flat_params = []  # what the model's parameters view (the low-precision copy, if any)
        self.masters: list[torch.Tensor] = []  # mixed precision: per unit, the fp32 master (or its shard)
        for u in units:
            flat = u.new_flat()
            u.copy_params_into(flat)
            if precision.compute is not None:
                self.masters.append(u.shard_of(flat).clone() if self.master_sharded else flat)
                flat = flat.to(precision.compute)
            u.point_params_at(flat)
            self.flat_params.append(flat)
        self._hooks = []
        for ui, u in enumerate(units):
            for si, p in enumerate(u.params):
                self._hooks.append(on_grad_accumulated(p, self._take_grad, ui, si))

    def _take_grad(self, ui: int, si: int, p: nn.Parameter) -> None:
        self._grad_ready(ui, si, p.grad)
        p.grad = None

    @abstractmethod
    def _grad_ready(self, ui: int, si: int, grad: torch.Tensor) -> None:
        """Take parameter ``si`` of unit ``ui``'s fresh gradient from backward."""

    def param_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flat_params)

    def master_bytes(self) -> int:
        return 0 if self.offload.master_on_host else sum(m.numel() * m.element_size() for m in self.masters)

    def compute_copies(self) -> dict[int, torch.Tensor] | None:
        """Each master shard's slice of the compute copy (the model's low-precision parameters)."""
        if not (self.masters and self.master_sharded):
            return None
        return {id(s): u.shard_of(flat) for u, flat, s in zip(self.units, self.flat_params, self.shard_params)}

    def _master_shard(self, ui: int) -> torch.Tensor:
        """Where unit ``ui``'s fp32 master shard lives: on the device, or its host copy (offloaded)."""
        return self.offload.master(self.shard_params[ui]) if self.offload.master_on_host else self.masters[ui]

    def _shard_params(self) -> list[nn.Parameter]:
        """One optimizer parameter per unit: a view of this rank's slice of the flat buffer (or
        its fp32 master shard), so the optimizer's in-place update lands there."""
        shards = []
        for ui, (u, flat) in enumerate(zip(self.units, self.flat_params)):
            data = self.masters[ui] if self.masters else u.shard_of(flat)
            shards.append(nn.Parameter(data, requires_grad=True))
        groups: list[list[nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        for u, s in zip(self.units, shards):
            groups[u.group_index].append(s)
        repoint_optimizer(self.optimizer, groups)
        return shards

    def _reshard(self, shards: Shards) -> None:
        """Cut every unit by new ``shards``, between iterations (every rank together): the
        parameters are whole on every rank already; the optimizer state (and a sharded fp32
        master) is gathered over the old cut and cut again (``poplar.zero.reshard``)."""
        if not self.master_sharded:  # stage 0 shards nothing
            return
        states = gather_state(self.comm, self.optimizer, self.units, self.shard_params)
        old = self.shard_params
        for ui, u in enumerate(self.units):
            master = self._whole_master(ui) if self.masters else None
            previous = self.flat_params[ui]
            u.set_shards(shards)
            flat = u.new_flat(dtype=previous.dtype)
            flat[:u.numel].copy_(previous[:u.numel])
            u.point_params_at(flat)
            self.flat_params[ui] = flat
            if master is not None:
                self.masters[ui] = shard_from(master, u)
                self._release(master.numel() * master.element_size())
        self._new_grad_buffers()
        self.shard_params = self._shard_params()
        cut_state(self.optimizer, self.units, old, self.shard_params, states)

    def _new_grad_buffers(self) -> None:
        """Gradient buffers of the units' current layout (between iterations: they are zero)."""

    def refresh_replicas(self) -> None:
        self.sync_params()

    def sync_params(self) -> None:
        """Every rank takes each shard from its owner (after a step; at setup this also makes
        ranks that built different initial weights agree). With a master shard the owner sends
        it cast to the compute dtype; with a whole master (stage 0) the master is gathered and
        every rank casts it."""
        for ui, (u, flat) in enumerate(zip(self.units, self.flat_params)):
            whole_master = bool(self.masters) and not self.master_sharded
            target = self.masters[ui] if whole_master else flat
            if self.masters and self.master_sharded and not self.offload.master_on_host:
                local = self.masters[ui].to(flat.dtype)
            elif self.comm.gathers_in_place:  # this rank's part is sent from where it is
                local = u.shard_of(target).detach()
            else:
                local = u.shard_of(target).detach().clone()  # the input must not alias the output
            held = 0 if local.data_ptr() == u.shard_of(target).data_ptr() else local.numel() * local.element_size()
            held += self.comm.staging_bytes("all_gather", u.part_sizes, u.shard_numel, target.element_size())
            self._hold(held)
            self.comm.all_gather(target, local, tag=f"unit{u.index}", sizes=u.part_sizes)
            self._release(held)
            if whole_master:
                flat.copy_(target)

    # -- mixed precision: the state is the fp32 master's --
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Under mixed precision the fp32 master (stages 1/2: gathered, a collective every rank
        calls between iterations), with buffers and frozen parameters in the model's dtypes."""
        if not self.masters:
            return super().full_state_dict()
        values: dict[int, torch.Tensor] = {}
        with self.comm.ledger.scope(Phase.STATE):
            for ui, u in enumerate(self.units):
                full = self._whole_master(ui)
                values.update({id(p): u.slot(full, i).clone() for i, p in enumerate(u.params)})
                if full is not self.masters[ui]:
                    self._release(full.numel() * full.element_size())
        return {k: values[id(v)] if id(v) in values else self.unsharded_value(v)
                for k, v in self.model.state_dict(keep_vars=True).items()}

    def state_specs(self) -> dict[str, StateSpec]:
        """Under mixed precision the parameters' dtype is the master's (``zero.state_parts``)."""
        if not self.masters:
            return super().state_specs()
        dtype = {id(p): m.dtype for u, m in zip(self.units, self.masters) for p in u.params}
        rest = unsharded_specs(self, set(dtype))
        return {k: StateSpec(tuple(v.shape), dtype[id(v)]) if id(v) in dtype else rest[k]
                for k, v in self.model.state_dict(keep_vars=True).items()}

    def state_parts(self) -> Iterator[StatePart]:
        """Under mixed precision one unit's whole fp32 master per part (stages 1/2: gathered, a
        collective every rank runs to its end between iterations), then buffers and frozen
        parameters one at a time."""
        if not self.masters:
            yield from super().state_parts()
            return
        sd = self.model.state_dict(keep_vars=True)
        for ui, u in enumerate(self.units):
            with self.comm.ledger.scope(Phase.STATE):
                full = self._whole_master(ui)
            value = {id(p): u.slot(full, i) for i, p in enumerate(u.params)}
            yield {k: value[id(v)] for k, v in sd.items() if id(v) in value}
            del value
            if full is not self.masters[ui]:
                self._release(full.numel() * full.element_size())
            del full
        yield from unsharded_parts(self, {id(p) for u in self.units for p in u.params})

    def _whole_master(self, ui: int) -> torch.Tensor:
        if not self.master_sharded:
            return self.masters[ui]
        u = self.units[ui]
        full = u.new_flat(zero=False)
        self._hold(full.numel() * full.element_size())
        shard = self.masters[ui]
        if self.offload.master_on_host:  # a device copy of the host master for the collective
            shard = torch.empty_like(shard).copy_(self._master_shard(ui).detach())
        self.comm.all_gather(full, shard, tag=f"unit{u.index}", sizes=u.part_sizes)
        return full

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """As ``ZeroStage``'s; under mixed precision each value goes into the master (this rank's
        part of it) and, cast, into the compute copy."""
        if not self.masters:
            return super().load_full_state_dict(state)
        sd = self.model.state_dict(keep_vars=True)
        self.check_state_fits(state, {k: v.shape for k, v in sd.items()})
        key_of = {id(v): k for k, v in sd.items()}
        with torch.no_grad():
            for ui, u in enumerate(self.units):
                lo, hi = u.shard_range if self.master_sharded else (0, u.padded_numel)
                master = self._master_shard(ui)
                for i, p in enumerate(u.params):
                    value = state[key_of[id(p)]].detach().reshape(-1).to(master.dtype)
                    u.slot(self.flat_params[ui], i).copy_(value.view(u.shapes[i]))
                    off = u.offsets[i]
                    a, b = max(lo, off), min(hi, off + value.numel())
                    if a < b:
                        master[a - lo:b - lo].copy_(value[a - off:b - off])
            trained = {id(p) for u in self.units for p in u.params}
            for k, v in sd.items():
                if id(v) not in trained:
                    self.load_unsharded(v, state[k])
        self.offload.refresh()


class LocalGrads(ReplicatedParams):
    """Stages 0 and 1: every rank accumulates the full flat gradients of its micro-steps, and
    reduces them once per iteration."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._new_grad_buffers()

    def _new_grad_buffers(self) -> None:
        self.flat_grads = [u.new_flat() for u in self.units]
        self._written = [[False] * len(u.params) for u in self.units]

    # [Note: gradient slots are written, not zeroed]
    # A parameter's first gradient of the iteration is copied into its slot and later ones are
    # added, so ``zero_grad`` marks the slots unwritten instead of zeroing the whole buffer (one
    # pass over the gradients fewer per iteration, as DDP's buckets). A slot no gradient reached
    # is zeroed when its unit is first read (``_settle``): before it is reduced, checked or
    # stepped. Padding is never written and stays zero.
    def _grad_ready(self, ui: int, si: int, grad: torch.Tensor) -> None:
        slot = self.units[ui].slot(self.flat_grads[ui], si)
        if self._written[ui][si]:
            slot.add_(grad)
        else:
            slot.copy_(grad)
            self._written[ui][si] = True

    def _settle(self, ui: int) -> None:
        """Unit ``ui``'s slots that no gradient reached this iteration hold zeros."""
        written = self._written[ui]
        for si in range(len(written)):
            if not written[si]:
                self.units[ui].slot(self.flat_grads[ui], si).zero_()
                written[si] = True

    def held_grads(self) -> list[torch.Tensor]:
        for ui in range(len(self.units)):
            self._settle(ui)
        return self.flat_grads

    @property
    def held_grads_limit(self) -> float | None:
        # the local gradients are checked before the reduction: in a narrower reduce dtype (fp16)
        # they must leave room for the sum of every rank's, or it could overflow unseen
        wire = self.precision.reduce
        if wire is None or torch.finfo(wire).max >= torch.finfo(self.units[0].dtype).max:
            return None
        return torch.finfo(wire).max / self.comm.world_size

    def zero_grad(self) -> None:
        for written in self._written:  # Note: gradient slots are written, not zeroed
            written[:] = [False] * len(written)

    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.flat_grads)


class SentSum(NamedTuple):
    """A unit's all-reduce in flight (None: already complete): its gradient, and the copy in the
    reduce dtype that travels (the gradient itself when there is none)."""

    work: PendingCollective | None
    grad: torch.Tensor
    wire: torch.Tensor


class Stage0(LocalGrads):
    """Stage 0: the full flat gradients are all-reduced (summed) in place once per iteration, and
    every rank steps all of them.

    [Note: ZeRO-0's all-reduce overlaps the last backward]
    As ZeRO-1's reduce-scatter (``poplar.zero.stage1``, Note: the closing reduction overlaps the
    last backward) and DDP's buckets: in the rank's last micro-step of ``train_step`` each unit is
    all-reduced, asynchronously and in the fixed unit order, as soon as backward has filled it and
    every earlier unit, so the sum travels while backward computes the earlier layers; the rest (a
    rank with no micro-step, a failed one, a loop of the user's own) is sent in
    ``close_micro_steps``, before the iteration's status reduction, so every rank sends each unit
    once, in the same order. The sum lands in the gradient itself, as DDP's does, not in a
    second full buffer. The non-finite check must still see this rank's own gradient, not the sum
    (it names the ranks where an inf arose, and under fp16 reduction it checks that the sum has
    room): each unit's summary for the check (``nonfinite.grad_summary``) is taken just before it
    is sent, and ``held_grads`` returns those summaries.
    """

    stage = 0
    grads_sharded = False
    master_sharded = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # mixed precision: the optimizer steps one fp32 master view per model parameter
        self.master_params: list[list[nn.Parameter]] | None = None
        if self.masters:
            self.master_params = [[nn.Parameter(u.slot(m, i)) for i in range(len(u.params))]
                                  for u, m in zip(self.units, self.masters)]
            master_of = {id(p): mp for u, mps in zip(self.units, self.master_params) for p, mp in zip(u.params, mps)}
            repoint_optimizer(self.optimizer, [[master_of.get(id(p), p) for p in g["params"]]
                                               for g in self.optimizer.param_groups])
        self._reset_reduction()

    def _reset_reduction(self) -> None:
        self._overlapping = False  # in this rank's last micro-step: units go out as backward fills them
        self._ready = [0] * len(self.units)
        self._next = 0  # the next unit to all-reduce
        self._in_flight: list[SentSum] = []
        self._summaries: list[torch.Tensor] = []  # what the non-finite check reads of each sent unit

    def last_micro_step(self) -> None:
        self._overlapping = True

    def _grad_ready(self, ui: int, si: int, grad: torch.Tensor) -> None:
        if ui < self._next:
            raise RuntimeError(
                f"a gradient of '{self.units[ui].names[si]}' arrived after its unit was reduced; at ZeRO-0 "
                "train_step runs one backward per micro-step of the plan's row")
        super()._grad_ready(ui, si, grad)
        if self._overlapping:
            self._ready[ui] += 1
            while self._next < len(self.units) and self._ready[self._next] >= len(self.units[self._next].params):
                self._send(self._next)

    def _send(self, ui: int) -> None:
        """All-reduce unit ``ui``'s flat gradient in place (async), after taking its summary."""
        u, g = self.units[ui], self.flat_grads[ui]
        self._settle(ui)
        self._summaries.append(grad_summary(g, self.held_grads_limit))
        wire = self.precision.for_reduce(g)  # the gradient itself, or its copy in the reduce dtype
        if wire is not g:
            self._hold(wire.numel() * wire.element_size())
        with self.comm.ledger.scope(Phase.STEP, micro_step=-1):  # the iteration's closing reduction
            work = self.comm.all_reduce_gradients(wire, tag=f"unit{u.index}", async_op=True)
        self._in_flight.append(SentSum(work, g, wire))
        self._next = ui + 1

    def end_micro_step(self) -> None:
        if self._overlapping:  # unused parameters: their gradients are final too
            while self._next < len(self.units):
                self._send(self._next)

    def close_micro_steps(self) -> None:
        while self._next < len(self.units):
            self._send(self._next)
        for work, grad, wire in self._in_flight:
            if work is not None:
                work.wait()
            if wire is not grad:
                grad.copy_(wire)
                self._release(wire.numel() * wire.element_size())
        self._in_flight = []

    def held_grads(self) -> list[torch.Tensor]:
        # Note: ZeRO-0's all-reduce overlaps the last backward
        assert self._next == len(self.units), "close_micro_steps runs before the gradients are checked"
        return self._summaries

    def reduce_gradients(self) -> None:
        pass  # summed in close_micro_steps

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.flat_grads

    def optimizer_step(self) -> None:
        stepped = self.master_params or [u.params for u in self.units]
        for u, g, params in zip(self.units, self.flat_grads, stepped):
            for si, p in enumerate(params):
                p.grad = u.slot(g, si)
        self.optimizer.step()
        for params in stepped:
            for p in params:
                p.grad = None
        if self.master_params is not None:
            with torch.no_grad():
                for flat, master in zip(self.flat_params, self.masters):
                    flat.copy_(master)

    def zero_grad(self) -> None:
        super().zero_grad()
        self._reset_reduction()


class Stage2(ReplicatedParams):
    stage = 2
    communicates_in_micro_steps = True
    reduces_in_flight = 2  # reduce-scatters overlapping backward; each holds one full bucket
    accumulates = False  # reduce-scatters run inside the node into node accumulators (``use_route``)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: tuple[bool, ...] = (True,) * len(self.units)  # per unit, in the held share (``use_route``)
        self.shard_params = self._shard_params()
        self._new_grad_buffers()
        self._reduces = ReduceQueue(self.reduces_in_flight, self._release)
        self._exchanges = NodeExchanges(self._exchange, self.comm.ledger, self.reduces_in_flight)
        self._reset_micro_step()

    def _new_grad_buffers(self) -> None:
        self.shard_grads = [u.new_shard() for u in self.units]
        self._new_accumulators()

    def _new_accumulators(self) -> None:
        """A node accumulator per unit of the route's held share (None for the others, which
        cross per micro-step), or none where the route does not accumulate."""
        self.accumulators = [torch.zeros(self.comm.accumulator_numel(u.part_sizes, u.shard_numel),
                                         dtype=ACCUMULATOR_DTYPE, device=u.device) if held else None
                             for u, held in zip(self.units, self._held)] if self.accumulates else []

    def use_route(self, routes: Routes) -> None:
        """Besides the compression, a node accumulator per unit where the step's route crosses
        nodes once per iteration (``Routes.accumulates``): the units of its held share alone
        (``Route.held``; Note: a share held, in ``poplar.types.route``)."""
        super().use_route(routes)
        self.accumulates = routes.accumulates(self.compression.gradient_quantization)
        self._held = routes.route.held([u.padded_numel for u in self.units])
        self._exchanges.use(self.accumulates)
        self._new_accumulators()  # of the step's parts (between iterations: they are zero)

    def _accumulator(self, ui: int) -> torch.Tensor | None:
        return self.accumulators[ui] if self.accumulates else None

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
        bucket = self._bucket(ui)
        wire = self.precision.for_reduce(bucket)  # the bucket itself, or its copy in the reduce dtype
        out = u.new_shard(wire.dtype, zero=False)  # the reduce-scatter writes all of it
        out_bytes, wire_bytes = out.numel() * out.element_size(), wire.numel() * wire.element_size()
        quantization = self.compression.gradient_quantization  # ZeRO-2 (``quantize_collectives``)
        if quantization is not None:  # blocks begin at each parameter of the bucket (the unit's flat)
            quantization = quantization.cut_at(u.offsets)
        staging = self.comm.staging_bytes("reduce_scatter", u.part_sizes, u.shard_numel, wire.element_size(),
                                          quantization)
        self._hold(out_bytes + staging)
        if wire is not bucket:  # only the copy stays alive
            self._hold(wire_bytes)
            self._release(bucket.numel() * bucket.element_size())
        self._buckets[ui] = None
        self._next = ui + 1
        acc = self._accumulator(ui)
        if acc is not None:  # the in-node step alone, into the node accumulator
            partials = torch.empty(acc.numel(), dtype=wire.dtype, device=wire.device)
            extra = partials.numel() * partials.element_size() - out_bytes
            self._hold(extra)
            work = self.comm.reduce_scatter_in_node(partials, wire, tag=f"unit{u.index}", async_op=True,
                                                    sizes=u.part_sizes)
            self._reduces.push(ReduceHandle(work, partials, wire, acc, out_bytes + extra + wire_bytes + staging,
                                            self._exchanges.after_reduce(ui)))
            return
        work = self.comm.reduce_scatter(out, wire, tag=f"unit{u.index}", async_op=True, sizes=u.part_sizes,
                                        quantization=quantization)
        self._reduces.push(ReduceHandle(work, out, wire, self.shard_grads[ui], out_bytes + wire_bytes + staging))

    def end_micro_step(self) -> None:
        while self._next < len(self.units):  # unused parameters: their gradient is zero
            self._issue(self._next)
        self._reduces.drain()
        self._reset_micro_step()

    def empty_micro_step(self) -> None:
        self.end_micro_step()

    def last_lockstep_micro_step(self) -> None:
        self._exchanges.last_micro_step()

    def _exchange(self, ui: int) -> PendingChain | None:
        u = self.units[ui]
        return self.comm.exchange_accumulated(self.shard_grads[ui], self.accumulators[ui], tag=f"unit{u.index}",
                                              async_op=True, sizes=u.part_sizes)

    def close_micro_steps(self) -> None:
        """Across nodes once per iteration: every unit's node partials have crossed nodes into
        its gradient shard (their exchanges started in the last lock-step micro-step: Note: the
        exchange overlaps the last lock-step micro-step, in ``reduce_queue``) before the status
        reduction checks them."""
        self._exchanges.finish(ui for ui in range(len(self.units)) if self._accumulator(ui) is not None)

    def reduce_gradients(self) -> None:
        for s, g in zip(self.shard_params, self.shard_grads):
            s.grad = g

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.shard_grads

    def held_grads(self) -> list[torch.Tensor]:
        return self.shard_grads

    def optimizer_step(self) -> None:
        self.offload.step()
        self.sync_params()

    def zero_grad(self) -> None:
        for s, g in zip(self.shard_params, self.shard_grads):
            g.zero_()
            s.grad = None
        for acc in self.accumulators:  # an iteration abandoned before its exchange
            if acc is not None:
                acc.zero_()
        self._exchanges.reset()

    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.shard_grads)

    def memory_report(self) -> dict[str, int]:
        """As for every stage, plus ``node_accumulator``: the node partials of the iteration's
        gradients (across nodes once per iteration; 0 otherwise)."""
        return {**super().memory_report(),
                "node_accumulator": sum(a.numel() * a.element_size() for a in self.accumulators if a is not None)}
