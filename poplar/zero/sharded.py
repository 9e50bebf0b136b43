"""ZeRO stage 3: each rank keeps only its 1/N shard of parameters, gradients and optimizer state.

Layout (``poplar.zero.wrap``, ``poplar.zero.blocks``): the wrap policy cuts the model into
blocks; each block is one ``FlatUnit`` per optimizer group whose shards live in one tensor, so
a block is one all-gather and one reduce-scatter. What no block owns — and every tied
parameter — forms the root unit, gathered at the model's forward pre-hook and kept until its
gradients are complete (so every user of a tied weight sees it gathered, and it stays tied).

A micro-step on every rank issues one fixed sequence of collectives (``poplar.zero.prefetch``):
forward, AG(root) then one all-gather per block in the forward order F, each block released
after its forward; backward, one all-gather per block in the backward order G (a multi-grad
hook on the block's outputs asks for it before its backward; the block is released once all
its parameters' gradients have arrived) interleaved with one reduce-scatter per block. The
sequence never depends on what the hooks ask for or when, so a rank whose forward visits blocks
in another order (or skips one) still matches, ``end_micro_step`` completes whatever a pass did
not issue (an exception mid-micro-step, unused parameters), and a rank with fewer micro-steps
(or none) replays the sequence with zero gradients (``empty_micro_step``). Gradients that arrive after their block's reduce-scatter had to be
issued early (only when a rank's backward runs blocks out of the recorded order) are kept and
reduce-scattered once at the iteration's end, after a one-number-per-block all-reduce that
tells every rank which blocks have such gradients.

Orders: iteration 0 uses module registration order (F = pre-order, G = reverse post-order),
which every rank knows without running anything, so a rank with no samples can replay it. Each
rank records the order its first micro-step actually ran; at the end of iteration 0 (in
``reduce_gradients``) the recorded orders are compared across ranks — a difference is a
``DistributedError`` on every rank — and become F and G; prefetch (one block ahead, forward
and backward) starts then. A later change of order stays exact and hang-free, and warns once.

Evaluation: ``engine.module(x)`` under ``torch.no_grad()`` gathers and releases block by block.
It is collective: all ranks must run the same number of evaluation forwards together.
Activation checkpointing (``poplar.zero.activation_checkpointing``): a checkpointed module lies
inside one block, whose recomputation runs in backward after the schedule gathered the block for
its backward; the block's hooks recognise it (``recomputing()``), check that the block is
gathered, and issue, gather and release nothing, so the list of collectives is unchanged.
Limits: one forward of the model per micro-step, a block runs once per forward (besides its
recomputation), parameters are used only inside their block's forward, and the model's
parameters are empty between uses: read them with ``full_state_dict()``.

Secondary shards (``Collectives.SECONDARY_SHARDS``, on hierarchical collectives): each block keeps this
rank's node-local secondary shard from its forward gather (``poplar.zero.blocks``), so the
backward schedule's gathers run inside the node and never cross one; the shards cost about
(1 - the node's share) / (ranks in the node) of the parameters (``memory_report``'s
``secondary_params``).

Across nodes once per iteration (``Collectives.ONCE_PER_ITERATION``, docs/design.md §3.10.12):
a block's secondary shard, once its first gather of the iteration kept it, serves every later
gather of the block in the iteration (forward and backward, every micro-step, the replays of a
rank with fewer micro-steps), inside the node; it is current until the optimizer step, a
re-shard or a load changes the parameters, and every iteration's first gather crosses again.
Each micro-step's reduce-scatter runs inside the node into the block's node accumulator (fp32,
``memory_report``'s ``node_accumulator``); the exchange across nodes runs once, when the rank's
micro-steps are over (``close_micro_steps``). A plan that holds this for a share of the
parameters (``Route``'s Note: a share held) keeps the secondary shard and the accumulator on the
blocks of that share alone; every other block crosses per micro-step, as hierarchical collectives
do. Gradients that come after their block's
reduce-scatter (blocks run out of the recorded order) are reduce-scattered whole at the end.

Mixed precision: each block's shard is its fp32 master, sent cast to the compute dtype by the
all-gathers (half of fp32's bytes for bf16/fp16) and gathered as it is by ``full_state_dict``; an
offloading rank keeps the master on the host and a compute-dtype shard on the device.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Collection, Iterator

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from poplar.zero.activation_checkpointing import recomputing
from poplar.zero.base import StageHooks, ZeroStage, on_grad_accumulated
from poplar.zero.eager_hooks import eager_hook
from poplar.zero.blocks import BlockState, GatherHandle, GradState, ShardedBlock, build_blocks
from poplar.comm import Communicator, DistributedError, PendingChain, Phase
from poplar.comm.routes import Routes
from poplar.zero import sharded_state
from poplar.zero.state_parts import StatePart, StateSpec, sharded_parts, sharded_specs
from poplar.zero.optim import repoint_optimizer
from poplar.zero.precision import StagePrecision
from poplar.zero.prefetch import Pass, PassKind, PassState, Schedule, backward_items, forward_items
from poplar.zero.reduce_queue import NodeExchanges, ReduceQueue
from poplar.zero.shard_layout import Shards
from poplar.zero.wrap import block_orders, post_order


class Stage3(ZeroStage):
    stage = 3
    communicates_in_micro_steps = True
    grads_sharded = True
    reduces_in_flight = 1  # reduce-scatters left running while backward goes on

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                 groups: list[list[tuple[str, nn.Parameter]]], wrap_policy: Any = None, *,
                 prefetch: bool = True, hooks: StageHooks | None = None,
                 precision: StagePrecision = StagePrecision(), shards: Shards) -> None:
        blocks = build_blocks(model, groups, wrap_policy, comm, shards, precision)
        super().__init__(model, optimizer, comm, [u for b in blocks for u in b.units], precision, hooks)
        self.blocks = blocks
        self.root = blocks[0] if blocks and blocks[0].index == 0 else None
        self.layers = [b for b in blocks if b is not self.root]
        self.point_optimizer()

        self.prefetch = prefetch
        self.secondary_shards = False  # blocks keep node-local secondary shards (``use_route``)
        self.secondary_for_iteration = False  # ... current for the whole iteration (once per iteration)
        self.accumulates = False  # blocks reduce-scatter inside the node into node accumulators (``use_route``)
        # per block, whether it holds what the way keeps (``Route.held``; Note: a share held)
        self._held: tuple[bool, ...] = (True,) * len(blocks)
        self._on_gathered = self.hooks.transient_allocated  # after each gather allocation (memory-cap checks)
        self.gathered_bytes = 0  # gathered parameter bytes alive now
        self.peak_gathered_bytes = 0
        self._gathered: dict[int, ShardedBlock] = {}  # blocks whose gathered parameters exist
        self._pass: Pass | None = None
        self._agreed = False
        self._recorded: tuple[list[int], list[int]] | None = None
        self._agreed_order: tuple[list[int], list[int]] | None = None  # the first iteration's, once agreed
        self._warned = False
        self._reduces = ReduceQueue(self.reduces_in_flight, self._release)
        self._exchanges = NodeExchanges(self._exchange, self.comm.ledger, self.reduces_in_flight)
        self._zeros: torch.Tensor | None = None  # what a block with no gradient reduce-scatters
        self._set_orders([b.index for b in self.layers], post_order(self.layers))

        self._blocks_by_index = {b.index: b for b in blocks}
        model.register_forward_pre_hook(eager_hook(self._root_pre))
        model.register_forward_hook(eager_hook(self._root_post), always_call=True)
        for b in self.layers:
            b.module.register_forward_pre_hook(eager_hook(partial(self._block_pre, b)))
            b.module.register_forward_hook(eager_hook(partial(self._block_post, b)))
        for b in blocks:
            for k, u in enumerate(b.units):
                for i, p in enumerate(u.params):
                    on_grad_accumulated(p, self._grad_ready, b.index, k, i)

    def point_optimizer(self) -> None:
        """The optimizer steps the blocks' shard parameters, each in its unit's group."""
        self.shard_params = [sp for b in self.blocks for sp in b.shard_params]
        per_group: list[list[nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        for u, sp in zip(self.units, self.shard_params):
            per_group[u.group_index].append(sp)
        repoint_optimizer(self.optimizer, per_group)

    def _reshard(self, shards: Shards) -> None:
        """Cut every block by new ``shards``, between iterations (every rank together)."""
        sharded_state.reshard(self, shards)
        for b, held in zip(self.blocks, self._held):  # the secondary shards' and accumulators' lengths follow the cut
            b.keep_secondary(self.comm if self.secondary_shards and held else None)
            b.keep_accumulator(self.comm if self.accumulates and held else None)

    def use_route(self, routes: Routes) -> None:
        """Besides the compression, each block keeps its secondary shard from the next pass on
        where the step's route keeps them (``Routes.keeps_secondary``), or none; across nodes once
        per iteration, the blocks of the route's held share alone (``Route.held``)."""
        super().use_route(routes)
        held = routes.route.held([b.full_numel for b in self.blocks])
        self._keep_secondary_shards(routes.keeps_secondary, held)
        self.secondary_for_iteration = routes.secondary_for_iteration
        accumulates = routes.accumulates(self.compression.gradient_quantization)
        if accumulates != self.accumulates or accumulates:
            self.accumulates = accumulates
            for b, h in zip(self.blocks, held):
                b.keep_accumulator(self.comm if accumulates and h else None)
        self._exchanges.use(accumulates)
        self._parameters_changed()

    def _parameters_changed(self) -> None:
        """The blocks' secondary shards no longer hold the parameters (a step, a load, a new
        route): the next gather of each block crosses nodes again and keeps them."""
        for b in self.blocks:
            b.secondary_current = False

    def _keep_secondary_shards(self, on: bool, held: tuple[bool, ...]) -> None:
        if on == self.secondary_shards and held == self._held:
            return
        if self.in_pass:
            raise RuntimeError("ZeRO-3: secondary shards switched inside a micro-step; change the plan between "
                               "iterations")
        self.secondary_shards, self._held = on, held
        for b, h in zip(self.blocks, held):
            b.keep_secondary(self.comm if on and h else None)

    def block_names(self) -> list[str]:
        return [b.name for b in self.layers]

    # ------------------------------------------------------------------ orders
    def _set_orders(self, pre: list[int], post: list[int]) -> None:
        self.fwd_order, self.bwd_order = block_orders(self.blocks, self.layers, pre, post)

    def _agree_order(self) -> None:
        names = {b.index: b.name for b in self.blocks}
        everyone = self.comm.all_gather_object(self._recorded, tag="zero3-order")
        recorded = [(r, o) for r, o in enumerate(everyone) if o is not None]
        if not recorded:
            return
        first = recorded[0][1]
        if any(o != first for _, o in recorded):
            lines = [f"  rank {r}: " + " -> ".join(names[i] for i in o[0]) for r, o in recorded]
            raise DistributedError("ZeRO-3: the wrapped blocks ran forward in a different order on different ranks "
                                   "in the first iteration; every rank must run the same model code:\n"
                                   + "\n".join(lines))
        self._set_orders(*first)
        self._agreed, self._agreed_order = True, first

    def share_step_agreements(self) -> None:
        everyone = self.comm.all_gather_object(self._agreed_order, tag="zero3-order")
        agreed = next((o for o in everyone if o is not None), None)
        if agreed is not None and self._agreed_order is None:  # a rank that sat out the first iterations
            self._set_orders(*agreed)
            self._agreed, self._agreed_order, self._recorded = True, agreed, None

    # ------------------------------------------------------------------ collectives (Schedule's Gatherer)
    def start_gather(self, b: ShardedBlock, again: bool = False, exact: bool = False) -> GatherHandle:
        """Issue ``b``'s gather: for compute, quantized as the plan says (``use_route``);
        ``exact``: the values as they are (the state: ``full_state_dict``)."""
        quantization = None if exact else self.compression.weight_quantization
        training = self._pass is not None and self._pass.train
        again = again or (b.secondary_current and training and not exact)
        handle = b.start_gather(self.comm, async_op=True, again=again, quantization=quantization)
        if not again and b.secondary is not None:  # this gather keeps the shard: current from now on?
            b.secondary_current = self.secondary_for_iteration and training and not exact
        self._gathered[b.index] = b
        self.gathered_bytes += b.gathered_nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        self._hold(handle.held_nbytes)
        return handle

    def finish_gather(self, b: ShardedBlock, handle: GatherHandle, use: bool) -> None:
        b.finish_gather(handle, use)
        self._release(handle.held_nbytes)

    def free_gather(self, b: ShardedBlock) -> None:
        if self._gathered.pop(b.index, None) is not None:
            self.gathered_bytes -= b.gathered_nbytes
            b.free()

    def _free_all_gathers(self, keep: Collection[int] = ()) -> None:
        """Release every gathered block but those whose index is in ``keep``."""
        for b in list(self._gathered.values()):
            if b.index not in keep:
                self.free_gather(b)

    def gathered_hook(self, b: ShardedBlock) -> None:
        if self._on_gathered is not None:
            self._on_gathered()

    def gather_now(self, b: ShardedBlock) -> None:
        """Gather ``b``'s parameters exactly, now (the state collectives)."""
        self.finish_gather(b, self.start_gather(b, exact=True), True)
        self.gathered_hook(b)

    def reduce(self, b: ShardedBlock) -> None:
        """Issue ``b``'s reduce-scatter of its micro-step gradient (zeros if none came); its
        gradients that arrive after it are ``late_flats``."""
        flats, b.grad_flats = b.grad_flats, None  # the handle keeps what the collective needs
        b.grad_state = GradState.REDUCED
        self._start_reduce(b, flats, in_node=b.accumulator is not None)

    def _reduce_late_flats(self, b: ShardedBlock) -> None:
        """Issue ``b``'s reduce-scatter of the gradients that came after its micro-step's one
        (zeros if none came on this rank)."""
        flats, b.late_flats = b.late_flats, None
        self._start_reduce(b, flats)

    def _start_reduce(self, b: ShardedBlock, flats: list[torch.Tensor] | None, in_node: bool = False) -> None:
        if flats is None and self._zeros is None:
            wire = self.precision.reduce_dtype(b.dtype)
            self._zeros = torch.zeros(max(x.full_numel for x in self.blocks), dtype=wire, device=b.device)
            self._hold(self._zeros.numel() * self._zeros.element_size())
        then = self._exchanges.after_reduce(b.index) if in_node else None
        handle = b.start_reduce(self.comm, flats, self._zeros, self.compression.gradient_quantization, in_node, then)
        self._hold(handle.held_bytes - (b.grad_nbytes if flats is not None else 0))  # gradients: held as they came
        self._reduces.push(handle)

    def _wait_reduces(self) -> None:
        self._reduces.drain()
        if self._zeros is not None:
            self._release(self._zeros.numel() * self._zeros.element_size())
            self._zeros = None

    # ------------------------------------------------------------------ hooks
    def _new_pass(self, kind: PassKind) -> Pass:
        return Pass(kind, Schedule(forward_items(self.root, self.fwd_order), self),
                     Schedule(backward_items(self.root, self.bwd_order), self, again=True) if kind is PassKind.TRAIN
                     else None)

    def _prefetching(self) -> bool:
        return self.prefetch and self._agreed

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        p = self._pass
        if torch.is_grad_enabled():
            if p is None:  # a loop of the user's own: engine.module(...) then engine.backward(...)
                p = self._pass = self._new_pass(PassKind.TRAIN)
            elif not p.train or p.state is not PassState.IDLE:
                raise RuntimeError("ZeRO-3 runs one forward of the model per micro-step, followed by "
                                   "engine.backward(); evaluate under torch.no_grad()")
        else:
            if p is not None:
                raise RuntimeError("ZeRO-3: a forward under torch.no_grad() inside a training micro-step; "
                                   "evaluate between iterations")
            p = self._pass = self._new_pass(PassKind.EVAL)
            p.eval_scope.enter_context(self.comm.ledger.scope(Phase.EVAL))
        p.state = PassState.FORWARD
        if self.root is not None:
            p.fwd.need(self.root)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        p = self._pass
        if p is None or p.state.forward_over:
            return
        p.finish_forward()
        if p.fwd.deviated and self._agreed and not self._warned:
            self._warned = True
            warnings.warn("ZeRO-3: the blocks ran forward in another order than the one recorded in the first "
                          "iteration; the collectives keep the recorded order (results stay exact, more blocks "
                          "may be gathered at once)", stacklevel=2)
        if not p.train:
            self._free_all_gathers()
            p.eval_scope.close()
            self._pass = None

    def _block_pre(self, b: ShardedBlock, module: nn.Module, args: Any) -> None:
        if recomputing():  # activation checkpointing: the backward schedule gathered the block
            if b.state is not BlockState.GATHERED:
                raise RuntimeError(f"ZeRO-3: block '{b.name}' is recomputed (activation checkpointing) while its "
                                   "parameters are released; checkpoint modules inside one block")
            return
        p = self._pass
        if p is None:
            raise RuntimeError(f"ZeRO-3: block '{b.name}' ran outside a forward of the engine's model; call "
                               "engine.module(...) (not .forward()) so that parameters are gathered")
        if b.index in p.ran:
            raise RuntimeError(f"ZeRO-3: block '{b.name}' ran forward twice in one forward of the model; wrap a "
                               "module that contains every use (wrap_policy), or do not recompute it")
        p.ran.add(b.index)
        p.pre_order.append(b.index)
        p.fwd.need(b)
        if self._prefetching():
            p.fwd.prefetch_after(b)

    def _block_post(self, b: ShardedBlock, module: nn.Module, args: Any, output: Any) -> None:
        p = self._pass
        if p is None or recomputing():  # a recomputation keeps the block for its backward
            return
        p.post_order.append(b.index)
        self.free_gather(b)
        if p.train and torch.is_grad_enabled():
            tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, partial(self._pre_backward, p, b), mode="any")

    def _pre_backward(self, p: Pass, b: ShardedBlock, grad: Any) -> None:
        if p is not self._pass:
            raise RuntimeError("ZeRO-3: backward through a graph of an earlier micro-step")
        if not p.bwd.need(b):
            raise RuntimeError(f"ZeRO-3: block '{b.name}' began its backward twice, or after its gradients were "
                               "complete (a parameter of it is used outside its forward?)")
        if self._prefetching():
            p.bwd.prefetch_after(b)

    def _grad_ready(self, block_index: int, k: int, i: int, param: nn.Parameter) -> None:
        b, (grad, param.grad) = self._blocks_by_index[block_index], (param.grad, None)
        p = self._pass
        if p is None or not p.train or p.bwd is None:
            raise RuntimeError("ZeRO-3: a gradient arrived outside a micro-step; call engine.backward(loss, n)")
        if b.ready == b.num_params:
            raise RuntimeError(f"ZeRO-3: a second gradient of '{b.units[k].names[i]}' in one micro-step; call "
                               "backward once per micro-step (through the engine)")
        complete, new = b.add_grad(k, i, grad)
        self._hold(new)
        if complete:
            p.bwd.ready(b)

    # ------------------------------------------------------------------ the engine's interface
    def begin_micro_step(self) -> None:
        if self._pass is not None:
            raise RuntimeError("ZeRO-3: a forward with grad enabled ran without engine.backward(); "
                               "evaluate under torch.no_grad()")
        self._pass = self._new_pass(PassKind.TRAIN)

    def end_micro_step(self) -> None:
        """Complete the micro-step's collectives (all of them when nothing ran) and release."""
        p = self._pass if self._pass is not None and self._pass.train else self._new_pass(PassKind.TRAIN)
        self._pass = p
        self._complete_pass(p)
        for b in self.blocks:
            b.reset_grads()
        if p.state is PassState.FORWARD_DONE and self._recorded is None and not self._agreed:
            self._recorded = (p.pre_order, p.post_order)
        self._pass = None

    def _complete_pass(self, p: Pass) -> None:
        ledger = self.comm.ledger
        if not p.state.forward_over:  # no forward, or it stopped half-way: issue what it did not
            with ledger.scope(Phase.FORWARD):
                p.finish_forward()
        # backward is over (or never ran): a block still gathered outside the backward schedule's
        # own gathers (one whose forward raised, so its post-hook never ran) would be gathered
        # again by the flush below; release it first
        self._free_all_gathers(keep=p.bwd.pending)
        with ledger.scope(Phase.BACKWARD):
            p.bwd.flush()
            self._free_all_gathers()
            self._wait_reduces()

    def empty_micro_step(self) -> None:
        self._pass = self._new_pass(PassKind.TRAIN)
        self.end_micro_step()

    def last_lockstep_micro_step(self) -> None:
        self._exchanges.last_micro_step()

    def _exchange(self, index: int) -> PendingChain | None:
        b = self._blocks_by_index[index]
        return self.comm.exchange_accumulated(b.shard_grad, b.accumulator, tag=f"block{b.index}", async_op=True,
                                              sizes=b.part_sizes)

    def close_micro_steps(self) -> None:
        """Across nodes once per iteration: every block's node partials have crossed nodes into
        its gradient shard (their exchanges started in the last lock-step micro-step: Note: the
        exchange overlaps the last lock-step micro-step, in ``reduce_queue``) before the status
        reduction checks them."""
        self._exchanges.finish(b.index for b in self.blocks if b.accumulator is not None)

    def reduce_gradients(self) -> None:
        if not self._agreed:
            self._agree_order()
        self._reduce_late()
        for b in self.blocks:
            for sp, g in zip(b.shard_params, b.unit_shard_grads()):
                sp.grad = g

    def _reduce_late(self) -> None:
        """Gradients that came after their block's reduce-scatter: which blocks have some on any
        rank (one all-reduce), then one reduce-scatter for each such block."""
        flags = torch.tensor([0.0 if b.late_flats is None else 1.0 for b in self.blocks], device=self.comm.device)
        self.comm.all_reduce(flags, tag="zero3-late")
        for b, flag in zip(self.blocks, flags.tolist()):
            if flag:
                self._reduce_late_flats(b)
        self._wait_reduces()

    def grad_tensors(self) -> list[torch.Tensor]:
        return [b.shard_grad for b in self.blocks]

    def held_grads(self) -> list[torch.Tensor]:
        return [b.shard_grad for b in self.blocks] + [g for b in self.blocks for g in b.late_flats or ()]

    def optimizer_step(self) -> None:
        self.offload.step()
        self._parameters_changed()

    def zero_grad(self) -> None:
        self._parameters_changed()  # the next iteration's first gathers cross again
        for b in self.blocks:
            if b.accumulator is not None:  # an iteration abandoned before its exchange
                b.accumulator.zero_()
            b.shard_grad.zero_()
            if b.late_flats is not None:
                b.late_flats = None
                self._release(b.grad_nbytes)
        self._exchanges.reset()
        for sp in self.shard_params:
            sp.grad = None
        if not self._agreed:
            self._recorded = None

    # ------------------------------------------------------------------ state
    @property
    def in_pass(self) -> bool:
        """A forward or micro-step is under way (state must be read between iterations)."""
        return self._pass is not None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every block gathered in turn (a collective: all ranks call it, between iterations);
        under mixed precision the fp32 master shards are gathered."""
        return sharded_state.full_state_dict(self)

    def state_specs(self) -> dict[str, StateSpec]:
        return sharded_specs(self)

    def state_parts(self) -> Iterator[StatePart]:
        """One gathered block at a time (a collective, between iterations: ``zero.state_parts``)."""
        return sharded_parts(self)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set each rank's shards (and the unsharded tensors: buffers, frozen parameters) from a
        complete state, without a collective; ValueError before any change if it does not fit."""
        sharded_state.load_full_state_dict(self, state)
        self._parameters_changed()

    compute_copies = sharded_state.compute_copies  # offloaded master: a compute-dtype shard on the device
    drop_compute_copies = sharded_state.drop_compute_copies

    def param_bytes(self) -> int:
        return sharded_state.kept_bytes(self)[0]

    def master_bytes(self) -> int:
        return sharded_state.kept_bytes(self)[1]

    def grad_bytes(self) -> int:
        return sum(b.shard_grad.numel() * b.element_size for b in self.blocks)

    def memory_report(self) -> dict[str, int]:
        """As for stages 0-2, plus ``gathered_params`` (the peak of gathered parameter bytes),
        ``secondary_params`` (the node-local secondary shards kept, 0 without them) and
        ``node_accumulator`` (the node partials of the iteration's gradients, once per iteration)."""
        return {**super().memory_report(), "gathered_params": self.peak_gathered_bytes,
                "secondary_params": sum(b.secondary_nbytes for b in self.blocks),
                "node_accumulator": sum(b.accumulator_nbytes for b in self.blocks)}
