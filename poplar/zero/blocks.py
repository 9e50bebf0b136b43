"""ZeRO-3 storage of one block: its persistent shard, its transient gathered parameters and its
transient gradient buffers, and the collectives that move between them.

A block has one ``FlatUnit`` per optimizer param group (FlatUnit is per group). Rank r's shard
of the block is the concatenation of its slice of every unit, held in one persistent tensor
(the optimizer's parameters are views into it), so a block is **one** all-gather and **one**
reduce-scatter whatever its number of groups. With a single unit the collectives read and
write the unit's buffers directly; with several, the gathered (rank-major) result is copied
out into the units' flat buffers, and gradients are copied into rank-major order before the
reduce-scatter. Under uneven shard weights rank r's part of the rank-major buffer is its slice
of every unit, so the parts differ in length and the collectives take the per-rank sizes.

Gathered parameters: ``full`` holds every unit's padded flat buffer back to back; parameters
are views into it while the block is gathered. Releasing resizes its storage to 0 bytes and
points each parameter at an empty tensor (stale use fails with a shape error instead of reading
freed memory). The views saved by autograd in forward refer to the same storage, which the
backward gather refills before the block's backward runs.

Mixed precision (``StagePrecision.compute`` set): ``shard`` is the fp32 master; a gather sends it
cast to the compute dtype into a compute-dtype ``full``, so the gathered bytes are half of
fp32's. Gradients arrive in the compute dtype and are added into fp32 flat buffers; a lower
``reduce`` dtype is cast for the reduce-scatter only. While the rank's optimizer is offloaded the
master lives on the host only: ``shard``'s storage is freed and the block keeps ``compute_shard``,
the shard in the compute dtype, which the gathers send as it is.

Secondary shards (``Collectives.SECONDARY_SHARDS``): ``secondary`` holds this
rank's node-local pieces of the block's gathered buffer (``poplar.comm.hierarchical``), in the
compute dtype. Every gather but the backward's writes it; the backward's gathers from it and
this rank's shard inside the node only: parameters do not change between a micro-step's forward
and its backward, so the values are the same.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch
from torch import nn

from poplar.comm import Communicator, PendingChain, PendingCollective
from poplar.comm.hierarchical import ACCUMULATOR_DTYPE
from poplar.types.compression import Quantization
from poplar.zero.flat import FlatUnit
from poplar.zero.precision import StagePrecision
from poplar.zero.reduce_queue import ReduceHandle
from poplar.zero.shard_layout import Shards
from poplar.zero.wrap import plan_blocks


class BlockState(Enum):
    """Whether a block's gathered parameters (the storage of ``full``) exist."""

    RELEASED = "released"
    GATHERED = "gathered"


class GradState(Enum):
    """Where a micro-step's gradients of a block go: ``grad_flats`` until the block's
    reduce-scatter is issued, ``late_flats`` after it (reduced once at the iteration's end)."""

    ACCUMULATING = "accumulating"
    REDUCED = "reduced"


@dataclass
class GatherHandle:
    """An all-gather in flight. With several units the result lands in ``staged`` (rank-major)
    and is copied out into the units' buffers; with one it lands in the block's ``full``.
    ``source`` is the shard cast to the compute dtype (mixed precision), kept until it is done."""

    work: PendingCollective | PendingChain | None
    staged: torch.Tensor | None
    source: torch.Tensor | None = None
    staging_nbytes: int = 0  # what a hierarchical gather allocates while it runs

    @property
    def staged_nbytes(self) -> int:
        return 0 if self.staged is None else self.staged.numel() * self.staged.element_size()

    @property
    def held_nbytes(self) -> int:
        """Transient bytes the gather keeps alive besides the block's ``full``."""
        return sum(t.numel() * t.element_size() for t in (self.staged, self.source) if t is not None) \
            + self.staging_nbytes


def build_blocks(model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], wrap_policy: Any,
                 comm: Communicator, shards: Shards, precision: StagePrecision = StagePrecision()
                 ) -> list["ShardedBlock"]:
    """The root unit's block (index 0, if it owns anything) and the wrapped blocks, cut by ``shards``.
    Every rank first checks the policy and agrees on the layout, so a bad policy (or different
    policies on different ranks) is a ``DistributedError`` on every rank before any other collective."""
    try:
        specs, error = plan_blocks(model, groups, wrap_policy)
    except Exception as e:  # a user policy that raises must not leave the other ranks waiting
        specs, error = [], f"wrap_policy raised {type(e).__name__}: {e}"
    layout = [(s.name, [(gi, [(n, tuple(p.shape)) for n, p in ps]) for gi, ps in s.members]) for s in specs]
    signature = hashlib.sha256(repr(layout).encode()).hexdigest()
    comm.agree(error, "ZeRO-3 setup", signature,
                         mismatch="ranks cut the model into different blocks; pass the same wrap_policy to every rank")
    blocks, index = [], 0
    for bi, spec in enumerate(specs):
        units = []
        for gi, named in spec.members:
            units.append(FlatUnit([p for _, p in named], [n for n, _ in named], gi, shards, comm.rank, index))
            index += 1
        if units:
            blocks.append(ShardedBlock(bi, spec.name, spec.module, units, precision))
    return blocks


class ShardedBlock:
    def __init__(self, index: int, name: str, module: nn.Module, units: list[FlatUnit],
                 precision: StagePrecision = StagePrecision()) -> None:
        self.index, self.name, self.module, self.units = index, name, module, units
        u0 = units[0]
        self.world_size, self.rank, self.dtype, self.device = u0.world_size, u0.rank, u0.dtype, u0.device
        self.precision = precision
        self.compute_dtype = precision.compute_dtype(self.dtype)  # of the gathered parameters
        self.element_size = u0.element_size
        self.num_params = sum(len(u.params) for u in units)
        self.params = [p for u in units for p in u.params]
        # rank r keeps its slice of its own initial values: the gathered model is consistent on
        # every rank even if ranks built different initial weights (each slice has one owner)
        flats = []
        for u in units:
            flats.append(u.new_flat())
            u.copy_params_into(flats[-1])
        self._allocate(flats)
        self.late_flats: list[torch.Tensor] | None = None
        self.secondary: torch.Tensor | None = None
        self.secondary_current = False  # ``secondary`` holds this iteration's parameters (once per iteration)
        self.accumulator: torch.Tensor | None = None  # node partials of the iteration's gradients (fp32)
        self.reset_grads()

    def keep_accumulator(self, comm: Communicator | None) -> None:
        """Hold a node accumulator for ``comm``'s in-node reduce-scatters (None: hold none)."""
        self.accumulator = None
        if comm is not None:
            numel = comm.accumulator_numel(self.part_sizes, self.shard_numel)
            self.accumulator = torch.zeros(numel, dtype=ACCUMULATOR_DTYPE, device=self.device)

    @property
    def accumulator_nbytes(self) -> int:
        return 0 if self.accumulator is None else self.accumulator.numel() * self.accumulator.element_size()

    def keep_secondary(self, comm: Communicator | None) -> None:
        """Hold a secondary shard for ``comm``'s hierarchical gathers (None: hold none)."""
        self.secondary, self.secondary_current = None, False
        if comm is not None:
            element = torch.empty((), dtype=self.compute_dtype).element_size()
            numel = comm.secondary_numel(self.part_sizes, self.shard_numel, element)
            self.secondary = torch.zeros(numel, dtype=self.compute_dtype, device=self.device)

    @property
    def secondary_nbytes(self) -> int:
        return 0 if self.secondary is None else self.secondary.numel() * self.secondary.element_size()

    def reshard(self, shards: Shards, flats: list[torch.Tensor]) -> None:
        """Cut the block by new ``shards``, taking this rank's new shard from ``flats`` (every
        unit's full flat values: ``gather_master``'s, between iterations, block released)."""
        assert self.state is BlockState.RELEASED, f"block {self.name!r} resharded while gathered"
        for u in self.units:
            u.set_shards(shards)
        self._allocate(flats)

    def _allocate(self, flats: list[torch.Tensor]) -> None:
        """The layout's sizes and this rank's storage: its shard (from ``flats``, the units' full
        values), gradient shard, optimizer parameters, and the released gathered buffer."""
        units = self.units
        self.shard_sizes = [u.shard_numel for u in units]
        self.shard_offsets = [sum(self.shard_sizes[:k]) for k in range(len(units))]
        self.shard_numel = sum(self.shard_sizes)
        # every rank's length of the rank-major buffer (its slice of each unit, back to back)
        self.rank_sizes = [sum(u.layout.size(r) for u in units) for r in range(self.world_size)]
        self.even = all(u.layout.even for u in units)
        self.part_sizes = None if self.even else self.rank_sizes  # what the collectives take
        pieces = self._rank_major_pieces()
        self._pieces = [] if self.even else pieces  # the even layout packs by rows instead
        self.tensor_starts = self._tensor_starts(pieces)
        self.full_offsets = [sum(u.padded_numel for u in units[:k]) for k in range(len(units))]
        self.full_numel = sum(u.padded_numel for u in units)
        self.gathered_nbytes = self.full_numel * torch.empty((), dtype=self.compute_dtype).element_size()

        self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        for k, (u, flat) in enumerate(zip(units, flats)):
            lo, hi = u.shard_range
            part = flat[lo:min(hi, flat.numel())]
            self._unit_shard(self.shard, k)[:part.numel()].copy_(part)
        self.shard_grad = torch.zeros_like(self.shard)
        self.compute_shard: torch.Tensor | None = None  # offloaded master: the shard in the compute dtype
        self.shard_params = [nn.Parameter(self._unit_shard(self.shard, k), requires_grad=True)
                             for k in range(len(units))]

        self.full = torch.empty(self.full_numel, dtype=self.compute_dtype, device=self.device)
        self.views = [[u.slot(self._unit_full(k), i) for i in range(len(u.params))] for k, u in enumerate(units)]
        self._storage = self.full.untyped_storage()
        self._storage.resize_(0)
        self._empty = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        for p in self.params:
            p.data = self._empty
        self.state = BlockState.RELEASED

    def _unit_shard(self, flat_shard: torch.Tensor, k: int) -> torch.Tensor:
        return flat_shard[self.shard_offsets[k]:self.shard_offsets[k] + self.shard_sizes[k]]

    def _unit_full(self, k: int) -> torch.Tensor:
        return self.full[self.full_offsets[k]:self.full_offsets[k] + self.units[k].padded_numel]

    def _rank_major_pieces(self) -> list[tuple[int, int, int, int]]:
        """(unit k, offset in the rank-major buffer, offset in unit k's flat, length): where each
        rank's slice of each unit lies in the rank-major buffer of the collectives."""
        pieces, start = [], 0
        for r in range(self.world_size):
            for k, u in enumerate(self.units):
                lo, hi = u.layout.range(r)
                pieces.append((k, start, lo, hi - lo))
                start += hi - lo
        return pieces

    def _tensor_starts(self, pieces: list[tuple[int, int, int, int]]) -> tuple[int, ...]:
        """Where each parameter's elements begin in the rank-major buffer of the collectives (a
        parameter that a shard boundary cuts begins again in the next piece), sorted, once each:
        a quantized collective's blocks begin there (``Quantization.tensor_starts``)."""
        starts = {at + off - lo for k, at, lo, n in pieces for off in self.units[k].offsets if lo < off < lo + n}
        return tuple(sorted(starts | {at for _, at, _, _ in pieces}))

    def _cut(self, quantization: Quantization | None) -> Quantization | None:
        return None if quantization is None else quantization.cut_at(self.tensor_starts)

    def _unpack(self, rank_major: torch.Tensor, flats: list[torch.Tensor]) -> None:
        """Copy a rank-major buffer out into the units' flat buffers."""
        if self.even:
            rows = rank_major.view(self.world_size, self.shard_numel)
            for k, (o, s) in enumerate(zip(self.shard_offsets, self.shard_sizes)):
                flats[k].view(self.world_size, s).copy_(rows[:, o:o + s])
            return
        for k, at, lo, n in self._pieces:
            flats[k][lo:lo + n].copy_(rank_major[at:at + n])

    def _pack(self, flats: list[torch.Tensor], rank_major: torch.Tensor) -> None:
        """Copy the units' flat buffers into rank-major order."""
        if self.even:
            rows = rank_major.view(self.world_size, self.shard_numel)
            for k, (o, s) in enumerate(zip(self.shard_offsets, self.shard_sizes)):
                rows[:, o:o + s].copy_(flats[k].view(self.world_size, s))
            return
        for k, at, lo, n in self._pieces:
            rank_major[at:at + n].copy_(flats[k][lo:lo + n])

    def load_param(self, k: int, i: int, value: torch.Tensor, shard: torch.Tensor) -> None:
        """Copy this rank's part of parameter i of unit k from its full ``value`` into ``shard``
        (unit k's master shard, wherever it lives)."""
        u = self.units[k]
        lo, off, n = u.shard_range[0], u.offsets[i], u.shapes[i].numel()
        a, b = max(lo, off), min(lo + u.shard_numel, off + n)
        if a < b:
            shard[a - lo:b - lo].copy_(value.detach().reshape(-1)[a - off:b - off].to(shard.dtype))

    def hold_compute_shard(self) -> list[torch.Tensor]:
        """Allocate ``compute_shard`` (its values come from the master); each unit's slice of it."""
        self.compute_shard = torch.zeros(self.shard_numel, dtype=self.compute_dtype, device=self.device)
        return [self._unit_shard(self.compute_shard, k) for k in range(len(self.units))]

    def unit_shard_grads(self) -> list[torch.Tensor]:
        return [self._unit_shard(self.shard_grad, k) for k in range(len(self.units))]

    # ------------------------------------------------------------------ parameters
    def start_gather(self, comm: Communicator, async_op: bool, again: bool = False,
                     quantization: Quantization | None = None) -> GatherHandle:
        """Allocate the gathered buffer and issue the all-gather of the block's shards; ``again``:
        the same values as the micro-step's forward gathered (its backward), which a block that
        keeps a secondary shard gathers inside the node from it. ``quantization``: the gather's
        (``CommPolicy.weight_quantization``); the shard itself stays exact."""
        assert self.state is BlockState.RELEASED, f"block {self.name!r} gathered twice"
        self._storage.resize_(self.gathered_nbytes)
        self.state = BlockState.GATHERED
        out = self.full if len(self.units) == 1 else torch.empty(
            self.full_numel, dtype=self.compute_dtype, device=self.device)
        kept = self.shard if self.compute_shard is None else self.compute_shard
        source = kept if self.compute_dtype == kept.dtype else kept.to(self.compute_dtype)
        tag, sizes = f"block{self.index}", self.part_sizes
        q = self._cut(quantization)
        if self.secondary is None:
            work = comm.all_gather(out, source, tag=tag, async_op=async_op, sizes=sizes, quantization=q)
        elif again:
            work = comm.all_gather_within_nodes(out, source, self.secondary, tag=tag, async_op=async_op, sizes=sizes,
                                                quantization=q)
        else:
            work = comm.all_gather_keeping(out, source, self.secondary, tag=tag, async_op=async_op, sizes=sizes,
                                           quantization=q)
        staging = comm.staging_bytes("all_gather", sizes, self.shard_numel, out.element_size(),
                                     None if again else q)
        return GatherHandle(work, None if out is self.full else out, None if source is kept else source, staging)

    def finish_gather(self, handle: GatherHandle, use: bool = True) -> None:
        """Wait for the all-gather; with ``use`` point the parameters at the gathered values."""
        if handle.work is not None:
            handle.work.wait()
        staged = handle.staged
        if staged is not None and use:
            self._unpack(staged, [self._unit_full(k) for k in range(len(self.units))])
        if use:
            for u_views, u in zip(self.views, self.units):
                for v, p in zip(u_views, u.params):
                    p.data = v

    def gather_master(self, comm: Communicator, shard: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every unit's full flat master, gathered from the shards in their own dtype (mixed
        precision: the fp32 values, not the compute copy; ``shard``: this rank's, if not
        ``self.shard``). A collective."""
        rows = torch.empty(self.full_numel, dtype=self.dtype, device=self.device)
        comm.all_gather(rows, self.shard if shard is None else shard, tag=f"block{self.index}", sizes=self.part_sizes)
        if len(self.units) == 1:
            return [rows]
        flats = [u.new_flat(zero=False) for u in self.units]
        self._unpack(rows, flats)
        return flats

    def free(self) -> None:
        for p in self.params:
            p.data = self._empty
        self._storage.resize_(0)
        self.state = BlockState.RELEASED

    # ------------------------------------------------------------------ gradients
    def reset_grads(self) -> None:
        """A new micro-step: no gradient yet (``late_flats`` lives until the iteration's end)."""
        self.grad_flats: list[torch.Tensor] | None = None
        self.ready = 0
        self.grad_state = GradState.ACCUMULATING

    @property
    def grad_nbytes(self) -> int:
        return self.full_numel * self.element_size

    def add_grad(self, k: int, i: int, grad: torch.Tensor) -> tuple[bool, int]:
        """Take parameter i of unit k's gradient. Returns (every parameter's has arrived, bytes
        newly allocated). After the block's reduce-scatter (issued early), gradients go to
        ``late_flats``, reduced once at the iteration's end."""
        new = 0
        if self.grad_state is GradState.REDUCED:
            if self.late_flats is None:
                self.late_flats, new = [u.new_flat() for u in self.units], self.grad_nbytes
            flats = self.late_flats
        else:
            if self.grad_flats is None:
                self.grad_flats, new = [u.new_flat() for u in self.units], self.grad_nbytes
            flats = self.grad_flats
        self.units[k].slot(flats[k], i).add_(grad)
        self.ready += 1
        return self.ready == self.num_params, new

    def start_reduce(self, comm: Communicator, flats: list[torch.Tensor] | None, zeros: torch.Tensor | None,
                     quantization: Quantization | None = None, in_node: bool = False,
                     then: Callable[[], None] | None = None) -> ReduceHandle:
        """Issue the async reduce-scatter of ``flats`` (the block's gradient; None: ``zeros``, a
        read-only zero buffer of at least the block's elements, in the reduce dtype) into
        ``shard_grad``, quantized by ``quantization`` (``CommPolicy.gradient_quantization``);
        ``in_node``: its in-node step alone, into ``accumulator`` (across nodes once per
        iteration, ``exchange_accumulated``), followed by ``then`` once added to it. The handle's
        ``held_bytes`` are the transient bytes it keeps alive: the output, the gradient
        (``grad_nbytes``, held since it arrived) and a cast copy, if any."""
        sn, total = self.shard_numel, self.full_numel
        wire = self.precision.reduce_dtype(self.dtype)
        wire_size = torch.empty((), dtype=wire).element_size()
        held = sn * wire_size
        if flats is None:
            assert zeros is not None
            inp = zeros[:total]
        elif len(flats) == 1:
            inp = self.precision.for_reduce(flats[0])
            held += self.grad_nbytes + (0 if inp is flats[0] else total * wire_size)
        else:
            inp = torch.empty(total, dtype=wire, device=self.device)
            self._pack(flats, inp)
            held += self.grad_nbytes
        if in_node and self.accumulator is not None:
            partials = torch.empty(self.accumulator.numel(), dtype=wire, device=self.device)
            held += partials.numel() * wire_size - sn * wire_size
            work = comm.reduce_scatter_in_node(partials, inp, tag=f"block{self.index}", async_op=True,
                                               sizes=self.part_sizes)
            return ReduceHandle(work, partials, inp, self.accumulator, held, then)
        held += comm.staging_bytes("reduce_scatter", self.part_sizes, sn, wire_size, quantization)
        out = torch.empty(sn, dtype=wire, device=self.device)
        work = comm.reduce_scatter(out, inp, tag=f"block{self.index}", async_op=True, sizes=self.part_sizes,
                                   quantization=self._cut(quantization))
        return ReduceHandle(work, out, inp, self.shard_grad, held)
