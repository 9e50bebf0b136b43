"""Quantized reduce-scatter and all-gather: the bytes that cross between nodes (or, for weights at
``QuantScope.EVERY_STEP``, every byte) sent block-quantized (``poplar.comm.quantize``), the
rest exact. ``poplar.types.compression`` says which collectives use them and why.

Hierarchical (``routes.HierarchicalRoute`` on a topology that spans nodes), built as the exact ones
(``poplar.comm.hierarchical``) are, with the exchange quantized:

- reduce-scatter: the in-node reduce-scatters are exact; each holder quantizes the pieces of its
  node's partial it sends (blocks from each transfer's start and from each parameter's); the
  owner dequantizes every partial it receives and adds them, in node order, to its own node's
  partial in fp32, then writes the sum in the output's dtype. Nothing is summed in the quantized
  type.
- all-gather: the owner quantizes its part once (blocks from the part's start and from each
  parameter's) and sends each holder the window of it that holder's piece covers; the holder
  dequantizes it into the output; the in-node all-gathers are exact. A secondary shard
  (``keep``) therefore holds the dequantized values, so the backward's in-node gather from it
  gives exactly what the forward used.

Flat (a flat plan on a topology that spans nodes, where every byte crosses; or weights at
``EVERY_STEP``): the all-gather sends every rank's part quantized, once, over an uneven
all-gather of the quantized bytes; the reduce-scatter is an all-to-all of quantized slices
(``batch_isend_irecv``: gloo and NCCL), dequantized and summed in fp32 at the owner.

Everywhere a rank's own part is never quantized: it is used as it is. Error: an element passes
through one quantization (all-gather) or K - 1 / N - 1 of them, one per partial it sums
(reduce-scatter), each off by at most half its block's scale (``absmax / levels``).

[Note: weights at every step, with secondary shards]
``EVERY_STEP`` gathers flat and quantized: a rank sees every other rank's part dequantized, its
node's parts included. The backward's gather from a secondary shard reproduces that: the node's
own region is gathered in the node quantized as the forward did (each part quantized whole, the
same bytes), the other regions' pieces, already dequantized in the shard, exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from poplar.comm import hierarchical, uneven
from poplar.comm.hierarchical import HierarchicalCall, NodeGroups, NodeLayout, Step
from poplar.comm.quantize import (blocks_of, from_wire, pack_window, quantize, to_wire, unpack_window, window_nbytes,
                                  wire_nbytes)
from poplar.comm.uneven import UnevenCall, UnevenMethod
from poplar.types.compression import Quantization
from poplar.types.topology import Topology, Wire


def _global(group: Any, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


# ---------------------------------------------------------------------------------------- flat
def all_gather(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int, group: Any,
               method: UnevenMethod, spec: Quantization) -> UnevenCall:
    """``output`` (the parts back to back) gets every rank's ``input``: this rank's as it is,
    every other's dequantized from the quantized bytes it sent (module doc: flat)."""
    offsets = uneven.offsets(sizes)
    nbytes = [wire_nbytes(spec, lo, n) for lo, n in zip(offsets, sizes)]
    own = output[offsets[rank]:offsets[rank] + sizes[rank]]
    if input.data_ptr() != own.data_ptr():
        own.copy_(input)
    wire = torch.empty(sum(nbytes), dtype=torch.uint8, device=output.device)
    at = uneven.offsets(nbytes)
    mine = wire[at[rank]:at[rank] + nbytes[rank]]
    call = uneven.all_gather(wire, mine, nbytes, rank, group, method)

    def run(async_op: bool) -> Any:  # the input is read when issued (``UnevenCall``)
        if nbytes[rank]:
            mine.copy_(to_wire(input, spec, offsets[rank]))
        return call.run(async_op)

    def finish() -> None:
        if call.finish is not None:
            call.finish()
        for r, (lo, n) in enumerate(zip(offsets, sizes)):
            if r != rank and n:
                output[lo:lo + n].copy_(from_wire(wire[at[r]:at[r] + nbytes[r]], n, spec, lo))
    return UnevenCall(run, finish, sum(nbytes))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int, group: Any,
                   spec: Quantization) -> UnevenCall:
    """``output`` (``sizes[rank]`` long) gets this rank's part of the sum of ``input`` over ranks:
    every rank sends each other rank its slice quantized; the owner adds the dequantized slices,
    in rank order, to its own in fp32 (module doc: flat)."""
    offsets, n = uneven.offsets(sizes), sizes[rank]
    recvs = [(r, torch.empty(wire_nbytes(spec, offsets[rank], n), dtype=torch.uint8, device=input.device))
             for r in range(len(sizes)) if r != rank and n]

    sends: list[tuple[int, torch.Tensor]] = []  # held here until the call is done

    def run(async_op: bool) -> Any:  # the input is read when issued (``UnevenCall``)
        sends[:] = [(r, to_wire(input[lo:lo + size], spec, lo)) for r, (lo, size) in enumerate(zip(offsets, sizes))
                    if r != rank and size]
        ops = [dist.P2POp(dist.isend, t, _global(group, r), group) for r, t in sends]
        ops += [dist.P2POp(dist.irecv, t, _global(group, r), group) for r, t in recvs]
        return uneven.run_p2p(ops, async_op)

    def finish() -> None:
        total = input[offsets[rank]:offsets[rank] + n].to(torch.float32, copy=True)  # the input stays as given
        for _, payload in recvs:
            total += from_wire(payload, n, spec, offsets[rank])
        output.copy_(total)
        sends.clear()
    return UnevenCall(run, finish, sum(wire_nbytes(spec, lo, size) for lo, size in zip(offsets, sizes)))


# ---------------------------------------------------------------------------------------- hierarchical
def _observed(layout: NodeLayout, topology: Topology, nbytes: Callable[[hierarchical.Transfer], int]) -> int:
    """What an observer hears of a quantized exchange: the node count times the bytes through the
    busiest node's port (``Step``), each transfer counted at its quantized size."""
    held, owned = [0] * topology.node_count, [0] * topology.node_count
    for t in layout.transfers:
        held[topology.node_of(t.holder)] += nbytes(t)
        owned[topology.node_of(t.owner)] += nbytes(t)
    return topology.node_count * max(max(h, o) for h, o in zip(held, owned))


def hierarchical_reduce_scatter(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int,
                                groups: NodeGroups, method: UnevenMethod, spec: Quantization) -> HierarchicalCall:
    """The hierarchical reduce-scatter with its exchange quantized (module doc)."""
    topology = groups.topology
    layout, held, steps = hierarchical.reduce_in_node(output, input, sizes, rank, groups, method)
    sends, recvs, into, pieces = [], [], [], []
    for t in layout.transfers:
        if t.holder == rank:
            m = topology.node_of(t.owner)
            at = t.at - layout.piece(topology, rank, m)[0]
            sends.append((t.owner, torch.empty(wire_nbytes(spec, t.at, t.length), dtype=torch.uint8,
                                               device=input.device)))
            pieces.append((t.at, held[m][at:at + t.length]))
        if t.owner == rank:
            payload = torch.empty(wire_nbytes(spec, t.at, t.length), dtype=torch.uint8, device=input.device)
            recvs.append((t.holder, payload))
            into.append((topology.node_of(t.holder), t.at, t.length, payload))

    def quantize_pieces() -> None:  # the node's partials exist once the in-node step is done
        for (_, payload), (at, piece) in zip(sends, pieces):
            payload.copy_(to_wire(piece, spec, at))

    def add_partials() -> None:
        total, mine = output.to(torch.float32), layout.offsets[rank]
        for _, at, n, payload in sorted(into, key=lambda x: (x[0], x[1])):  # node order, as the exact call
            total[at - mine:at - mine + n] += from_wire(payload, n, spec, at)
        output.copy_(total)
    observed = _observed(layout, topology, lambda t: wire_nbytes(spec, t.at, t.length))
    steps.append(hierarchical.exchange_step(groups, groups.cross_later, observed, sends, recvs, add_partials,
                                            quantize_pieces))
    return HierarchicalCall(steps, None)


def _window(layout: NodeLayout, t: hierarchical.Transfer) -> tuple[int, int]:
    """Transfer ``t``'s elements as a window of its owner's part."""
    a = t.at - layout.offsets[t.owner]
    return a, a + t.length


def hierarchical_all_gather(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int,
                            groups: NodeGroups, method: UnevenMethod, spec: Quantization,
                            keep: torch.Tensor | None = None) -> HierarchicalCall:
    """The hierarchical all-gather with its exchange quantized (module doc); ``keep``: where the
    secondary shard, dequantized, is copied once the call is done."""
    topology = groups.topology
    layout, lo, own = hierarchical.place_own_part(output, input, sizes, rank, topology)
    quantized = quantize(own, spec, layout.offsets[rank]) if any(t.owner == rank for t in layout.transfers) else None
    blocks = [blocks_of(spec, at, n) for at, n in zip(layout.offsets, sizes)]  # of each owner's part
    sends, recvs, into = [], [], []
    for t in layout.transfers:
        a, b = _window(layout, t)
        if t.owner == rank:
            sends.append((t.holder, pack_window(quantized, a, b)))
        if t.holder == rank:
            payload = torch.empty(window_nbytes(a, b, spec.bits, blocks[t.owner]), dtype=torch.uint8,
                                  device=output.device)
            recvs.append((t.owner, payload))
            into.append((t.at, a, b, blocks[t.owner], payload))

    def dequantize_pieces() -> None:
        for at, a, b, part_blocks, payload in into:
            output[at:at + b - a].copy_(unpack_window(payload, a, b, spec.bits, part_blocks))
    observed = _observed(layout, topology, lambda t: window_nbytes(*_window(layout, t), spec.bits, blocks[t.owner]))
    steps = [hierarchical.exchange_step(groups, groups.cross_first, observed, sends, recvs, dequantize_pieces)]
    gather = hierarchical.gather_in_node(output, layout, rank, groups, method, groups.node_later[topology.node_of(rank)])
    if gather is not None:
        steps.append(gather)
    finish = None if keep is None else (lambda: hierarchical.copy_secondary(output, keep, layout, topology, rank, True))
    return HierarchicalCall(steps, finish)


# ---------------------------------------------------------------------------------------- every step, kept
def flat_all_gather_keeping(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int,
                            groups: NodeGroups, flat: tuple[Any, Wire], method: UnevenMethod, spec: Quantization,
                            keep: torch.Tensor) -> HierarchicalCall:
    """The flat quantized all-gather (``EVERY_STEP``) on ``flat`` (its group and wire), keeping
    this rank's secondary shard of the result in ``keep`` (Note: weights at every step)."""
    group, wire = flat
    call = all_gather(output, input, sizes, rank, group, method, spec)
    layout = hierarchical.node_layout(tuple(sizes), groups.topology, output.element_size())
    step = Step("all_gather", wire.link, wire, call.wire_bytes, call.wire_bytes, call.run, call.finish)
    return HierarchicalCall([step], lambda: hierarchical.copy_secondary(output, keep, layout, groups.topology, rank,
                                                                        True))


def all_gather_within_every_step(output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor,
                                 sizes: Sequence[int], rank: int, groups: NodeGroups, method: UnevenMethod,
                                 spec: Quantization) -> HierarchicalCall:
    """The gather of ``flat_all_gather_keeping`` again, inside each node: the node's own parts
    quantized as that gather sent them, the other regions' pieces from ``secondary`` exactly."""
    topology = groups.topology
    layout, _, _ = hierarchical.place_own_part(output, input, sizes, rank, topology)
    hierarchical.copy_secondary(output, secondary, layout, topology, rank, False)
    k, j = topology.node_of(rank), topology.local_rank(rank)
    group = groups.node_first[k]
    lo, size = layout.region_offsets[k], layout.region_sizes[k]
    own_region = [] if not size else [
        all_gather(output[lo:lo + size], input, [sizes[r] for r in topology.nodes[k]], j, group, method,
                   spec.within(lo))]
    gather = hierarchical.gather_in_node(output, layout, rank, groups, method, group, also=own_region)
    return HierarchicalCall([] if gather is None else [gather], None)


def staging_bytes(op: str, sizes: Sequence[int], rank: int, spec: Quantization) -> int:
    """About the bytes a quantized ``op`` allocates on ``rank`` beside its input and output: the
    quantized bytes of the buffer (sent and received) and an fp32 sum of this rank's part."""
    total = spec.wire_bytes(sum(sizes))
    return total + (4 * sizes[rank] if op == "reduce_scatter" else 0)
