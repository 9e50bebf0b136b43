"""Hierarchical reduce-scatter and all-gather over uneven parts: a step inside each node on its
fast link and one exchange between nodes that moves every element across once.

The buffer is every rank's part back to back in rank order (``poplar.comm.uneven``); nodes are
consecutive runs of ranks (``poplar.types.topology``), so node m's parts form one contiguous
*region* of the buffer. Parts may differ in length, be empty, and nodes may differ in size.

Reduce-scatter, on rank r of node k (``L_k`` ranks):

1. inside node k, for every node m: reduce-scatter region m over node k's group. For m == k the
   parts are node k's own, so r gets node k's partial sum of its own part. For m != k the region
   is cut into ``L_k`` contiguous pieces of about equal bytes (``pieces``), so each rank of node k
   *holds* node k's partial sums of one piece of every other node's region.
2. across nodes: each holder sends each piece's overlap with an owner's part to that owner
   (point-to-point, ``torch.distributed.batch_isend_irecv``: gloo and NCCL); the owner adds the
   K-1 partials it receives (one per other node, in node order) to its own node's partial.

All-gather is the reverse: the owner sends its part's overlap with each holder's piece to that
holder in every other node (straight into the holder's output buffer), then every node
all-gathers each region over its group, from the pieces (or, for its own region, the parts).

[Note: bytes across nodes]
Node k's ranks send, at the reduce-scatter's exchange, the partial sums of every element outside
node k's region once: (1 - s_k) of the buffer, s_k being node k's share of it (the sum of its
ranks' shard weights over all of them). At the all-gather node k sends its region once to every
other node and receives the (1 - s_k) it does not own. A flat ring moves (N-1)/N of the buffer
over every node boundary instead: for 2 nodes of 4 ranks with even shares, 0.875 of the buffer
against 0.5. docs/design.md §3.10.3 has the table.

[Note: pieces, not whole parts]
A foreign region is cut into pieces by bytes, across part boundaries, rather than into groups of
whole parts: with 3 ranks in node k and one part in node m, whole parts would leave one rank of
node k to carry node m's whole partial across (and two idle); pieces give each a third. The
cross-node bytes are the same either way. A piece may overlap several owners' parts: one
transfer each. Pieces start on 16-byte boundaries, as shards do (``poplar.zero.shard_layout``).

[Note: secondary shards]
After an all-gather's exchange a rank holds its own part and its pieces of every other region:
its node-local *secondary shard* (ZeRO++'s hpZ, exact). Kept until the backward re-gather, that
gather is the in-node step alone (``all_gather_within``): it never crosses a node. It costs the
pieces, about (1 - s_k) / L_k of the buffer per rank.

[Note: node partials, accumulated]
Crossing nodes once per iteration (``Collectives.ONCE_PER_ITERATION``) splits the reduce-scatter
in two: each micro-step runs its in-node step alone (``reduce_scatter_in_node``), and the rank
adds the node partials it holds (its own part, its pieces of the other regions: the cut of the
secondary shard, aligned for fp32) into a node accumulator in fp32; once per iteration the
exchange runs from the accumulator (``exchange_accumulated``). The sum of a micro-step's sums is
the sum of the node partials' sums: the same sums, summed in another order. Node k then sends
(1 - s_k) of the buffer across per iteration, not per micro-step; the accumulator costs its
length in fp32: its own part and its pieces, about 1 / L_k of the buffer.

Each collective here is a short chain of ``Step`` s; the communicator issues them in order
(``poplar.comm.communicator``), the first at once, the next when the one before is done.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from poplar.comm import uneven
from poplar.comm.uneven import UnevenCall, UnevenMethod
from poplar.types.topology import Link, Topology, TopologyError, Wire

ALIGN_BYTES = 16  # pieces start on 16-byte boundaries, as shards do


class NodeGroups(NamedTuple):
    """The process groups of a topology, created once (``create``): two per node, for the
    in-node steps issued first in a collective and later in one, and two over every rank for the
    exchange, likewise. Separate groups keep each group's calls in one order on every rank,
    whatever moment a rank completes a collective and issues its next step. ``ranks``: the
    global rank of each of the topology's ranks, where it numbers a subset of the world (the ranks
    in a training step that leaves some out, docs/design.md §3.12); None: the world itself."""

    topology: Topology
    node_first: tuple[Any, ...]
    node_later: tuple[Any, ...]
    cross_first: Any
    cross_later: Any
    ranks: tuple[int, ...] | None = None

    @classmethod
    def create(cls, topology: Topology, ranks: Sequence[int] | None = None) -> "NodeGroups":
        """Every rank of the world creates every group, in the same order (``new_group`` is a
        collective over the world), also a rank outside ``ranks``."""
        glob = tuple(range(topology.world_size)) if ranks is None else tuple(ranks)
        first = tuple(dist.new_group([glob[r] for r in node]) for node in topology.nodes)
        later = tuple(dist.new_group([glob[r] for r in node]) for node in topology.nodes)
        cross = (dist.new_group(list(glob)), dist.new_group(list(glob)))
        if dist.get_rank() in glob:
            for group in cross:  # a first call with every rank: NCCL's point-to-point batches need one
                dist.barrier(group=group)
        return cls(topology, first, later, *cross, ranks=None if ranks is None else glob)

    @staticmethod
    def check_agreed(nodes: Sequence[Any]) -> None:
        """A ``TopologyError`` unless every rank's ``nodes`` (gathered, in rank order) are the same."""
        if any(n != nodes[0] for n in nodes):
            lines = "\n".join(f"  rank {r}: {n!r}" for r, n in enumerate(nodes))
            raise TopologyError(f"ranks were given different topologies; give every rank the same:\n{lines}")

    def global_rank(self, rank: int) -> int:
        """The world's number of the topology's ``rank``."""
        return rank if self.ranks is None else self.ranks[rank]

    def global_ranks(self, ranks: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.global_rank(r) for r in ranks)


class Transfer(NamedTuple):
    """One send of the exchange: elements ``[at, at + length)`` of the buffer between the rank
    holding a piece of them (``holder``) and the rank whose part they are (``owner``)."""

    holder: int
    owner: int
    at: int
    length: int


class NodeLayout(NamedTuple):
    """How a buffer of per-rank parts is cut for the hierarchical collectives."""

    offsets: tuple[int, ...]  # each rank's part's start in the buffer
    region_offsets: tuple[int, ...]  # each node's region's start
    region_sizes: tuple[int, ...]
    step_sizes: tuple[tuple[tuple[int, ...], ...], ...]  # [k][m]: node k's ranks' lengths of region m
    transfers: tuple[Transfer, ...]  # every transfer of the exchange, on every rank alike

    def piece(self, topology: Topology, rank: int, m: int) -> tuple[int, int]:
        """``rank``'s piece of node m's region (its own part if m is its node): buffer [lo, hi)."""
        k, j = topology.node_of(rank), topology.local_rank(rank)
        sizes = self.step_sizes[k][m]
        lo = self.region_offsets[m] + sum(sizes[:j])
        return lo, lo + sizes[j]

    def cross_elements(self) -> int:
        """Elements crossing between nodes in one exchange, all nodes together."""
        return sum(t.length for t in self.transfers)

    def busiest_port_elements(self, topology: Topology) -> int:
        """Elements through the busiest node's network port in one exchange: the most any node
        sends or receives (a reduce-scatter's holders send, its owners receive; an all-gather
        the reverse: the same count either way)."""
        held, owned = [0] * topology.node_count, [0] * topology.node_count
        for t in self.transfers:
            held[topology.node_of(t.holder)] += t.length
            owned[topology.node_of(t.owner)] += t.length
        return max(max(h, o) for h, o in zip(held, owned))

    def secondary_numel(self, topology: Topology, rank: int) -> int:
        """The length of ``rank``'s pieces of the other nodes' regions (its secondary shard)."""
        k = topology.node_of(rank)
        return sum(b - a for a, b in (self.piece(topology, rank, m) for m in range(topology.node_count) if m != k))


def pieces(length: int, n: int, align: int) -> tuple[int, ...]:
    """``length`` cut into ``n`` contiguous pieces of about equal length, every cut on a multiple
    of ``align`` (the last piece takes the rest)."""
    cuts = [0] + [min(length, round(length * j / n / align) * align) for j in range(1, n)] + [length]
    for j in range(1, n + 1):
        cuts[j] = max(cuts[j], cuts[j - 1])
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))


@lru_cache(maxsize=256)
def node_layout(sizes: tuple[int, ...], topology: Topology, element_size: int) -> NodeLayout:
    """The layout of a buffer of parts ``sizes`` (one per rank) on ``topology``."""
    align = max(1, ALIGN_BYTES // element_size)
    offsets = tuple(sum(sizes[:r]) for r in range(len(sizes)))
    region_offsets = tuple(offsets[node[0]] for node in topology.nodes)
    region_sizes = tuple(sum(sizes[r] for r in node) for node in topology.nodes)
    step_sizes = tuple(tuple(tuple(sizes[r] for r in node) if m == k else pieces(region_sizes[m], len(node), align)
                             for m in range(topology.node_count))
                       for k, node in enumerate(topology.nodes))
    transfers = []
    for k, node in enumerate(topology.nodes):
        for m, owners in enumerate(topology.nodes):
            if m == k:
                continue
            at = region_offsets[m]
            for holder, length in zip(node, step_sizes[k][m]):
                for owner in owners:
                    lo, hi = max(at, offsets[owner]), min(at + length, offsets[owner] + sizes[owner])
                    if lo < hi:
                        transfers.append(Transfer(holder, owner, lo, hi - lo))
                at += length
    return NodeLayout(offsets, region_offsets, region_sizes, step_sizes, tuple(transfers))


def staging_numel(op: str, layout: NodeLayout, topology: Topology, rank: int, in_place: bool) -> int:
    """Elements a hierarchical ``op`` allocates on ``rank`` while it runs (beside its input and
    output): the reduce-scatter's pieces of node partials and the partials it receives; the
    all-gather's copies of its pieces where the in-node gather cannot send them from the output
    (``in_place`` False)."""
    k = topology.node_of(rank)
    alone, others = len(topology.nodes[k]) == 1, topology.node_count - 1
    own = layout.step_sizes[k][k][topology.local_rank(rank)]
    if op == "reduce_scatter":
        return (0 if alone else layout.secondary_numel(topology, rank)) + others * own
    return 0 if alone or in_place else layout.secondary_numel(topology, rank) + own


class Step(NamedTuple):
    """One step of a hierarchical collective. ``run(async_op)`` issues it (torch's work or None)
    and ``finish()`` completes it once that is done. ``wire`` is None for a step that runs no
    collective (a node of one rank copies locally): no observer hears it and the ledger has no
    record of it. ``observed_bytes`` is what an observer hears (the exchange: the node count times
    the busiest node port's bytes, ``CollectiveObserver``); ``sent_bytes`` what the ledger records
    (the exchange: this rank's sends)."""

    op: str
    link: Link
    wire: Wire | None
    observed_bytes: int
    sent_bytes: int
    run: Callable[[bool], Any]
    finish: Callable[[], None] | None


class HierarchicalCall(NamedTuple):
    """A hierarchical collective: its steps, in order, and what completes it after the last."""

    steps: list[Step]
    finish: Callable[[], None] | None


def _all(works: list[Any]) -> Any:
    works = [w for w in works if w is not None]
    return uneven.AllWorks(works) if works else None


def _finish_all(calls: list[UnevenCall]) -> Callable[[], None] | None:
    finishes = [c.finish for c in calls if c.finish is not None]
    if not finishes:
        return None

    def finish() -> None:
        for f in finishes:
            f()
    return finish


def in_node_step(op: str, groups: NodeGroups, group: Any, rank: int, calls: list[UnevenCall]) -> Step:
    """The in-node step of ``rank``'s node: the region ``calls`` on ``group`` as one step."""
    topology = groups.topology
    node = topology.nodes[topology.node_of(rank)]
    wire_bytes = sum(c.wire_bytes for c in calls)
    return Step(op, Link.INTRA, Wire(Link.INTRA, groups.global_ranks(node)), wire_bytes, wire_bytes,
                lambda a: _all([c.run(a) for c in calls]), _finish_all(calls))


def exchange_step(groups: NodeGroups, group: Any, observed: int, sends: list[tuple[int, torch.Tensor]],
                  recvs: list[tuple[int, torch.Tensor]], finish: Callable[[], None] | None,
                  prepare: Callable[[], None] | None = None) -> Step:
    """The cross-node exchange: this rank's ``sends`` and ``recvs`` (peer, tensor) as one batch;
    ``observed``: what an observer hears (``Step``), the same on every rank; ``prepare``: what
    writes the sends once the step before is done (they are allocated here)."""
    def run(async_op: bool) -> Any:
        if prepare is not None:
            prepare()
        ops = [dist.P2POp(dist.isend, t, groups.global_rank(peer), group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, groups.global_rank(peer), group) for peer, t in recvs]
        return uneven.run_p2p(ops, async_op)
    sent = sum(t.numel() * t.element_size() for _, t in sends)
    wire = Wire(Link.CROSS, groups.global_ranks(range(groups.topology.world_size)))
    return Step("exchange", Link.CROSS, wire, observed, sent, run, finish)


def exchange_transfers(layout: NodeLayout, topology: Topology, rank: int, pieces: Any,
                       incoming: torch.Tensor) -> tuple[list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor]]]:
    """This rank's sends and receives in the exchange of node partials (``layout.transfers``):
    from ``pieces[m]`` (its piece of its node's partial of region m, indexed by node) the overlap
    with each owner's part, and into ``incoming`` (one row per other node, in node order) each
    holder's overlap with this rank's part."""
    k = topology.node_of(rank)
    others = [m for m in range(topology.node_count) if m != k]
    sends, recvs = [], []
    for t in layout.transfers:
        if t.holder == rank:
            m = topology.node_of(t.owner)
            at = t.at - layout.piece(topology, rank, m)[0]
            sends.append((t.owner, pieces[m][at:at + t.length]))
        if t.owner == rank:
            at = t.at - layout.offsets[rank]
            recvs.append((t.holder, incoming[others.index(topology.node_of(t.holder)), at:at + t.length]))
    return sends, recvs


def observed_exchange(layout: NodeLayout, topology: Topology, element_size: int) -> int:
    """What an observer hears of an exact exchange: the node count times the busiest port's bytes."""
    return topology.node_count * layout.busiest_port_elements(topology) * element_size


def reduce_in_node(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int, groups: NodeGroups,
                   method: UnevenMethod) -> tuple[NodeLayout, dict[int, torch.Tensor], list[Step]]:
    """A hierarchical reduce-scatter's first step: the buffer's layout, this rank's piece of its
    node's partial of every region (``output`` for its own node's), and the in-node step."""
    topology = groups.topology
    layout = node_layout(tuple(sizes), topology, input.element_size())
    k, j = topology.node_of(rank), topology.local_rank(rank)
    node, group = topology.nodes[k], groups.node_first[k]
    held: dict[int, torch.Tensor] = {}  # node m -> this rank's piece of node k's partial of region m
    calls: list[UnevenCall] = []
    for m in range(topology.node_count):
        lo, size = layout.region_offsets[m], layout.region_sizes[m]
        region, step = input[lo:lo + size], layout.step_sizes[k][m]
        if len(node) == 1:  # a node of one: its partial is its own input (a view, no copy)
            held[m] = region
            continue
        mine = held[m] = output if m == k else torch.empty(step[j], dtype=input.dtype, device=input.device)
        if size:
            calls.append(uneven.reduce_scatter(mine, region, step, j, group, method))
    steps = []
    if len(node) == 1:
        steps.append(Step("reduce_scatter", Link.INTRA, None, 0, 0, lambda a: None,
                          lambda: output.copy_(held[k])))
    elif calls:
        steps.append(in_node_step("reduce_scatter", groups, group, rank, calls))
    return layout, held, steps


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int, groups: NodeGroups,
                   method: UnevenMethod) -> HierarchicalCall:
    """``output`` (``sizes[rank]`` long) gets this rank's part of the sum of ``input`` over every
    rank: in-node reduce-scatters, then the exchange of node partials (module doc)."""
    topology = groups.topology
    layout, held, steps = reduce_in_node(output, input, sizes, rank, groups, method)
    incoming = torch.empty(topology.node_count - 1, sizes[rank], dtype=input.dtype, device=input.device)
    sends, recvs = exchange_transfers(layout, topology, rank, held, incoming)

    def add_partials() -> None:
        for row in incoming:
            output.add_(row)
    observed = observed_exchange(layout, topology, input.element_size())
    steps.append(exchange_step(groups, groups.cross_later, observed, sends, recvs, add_partials))
    return HierarchicalCall(steps, None)


def gather_in_node(output: torch.Tensor, layout: NodeLayout, rank: int, groups: NodeGroups,
                   method: UnevenMethod, group: Any, also: Sequence[UnevenCall] = ()) -> Step | None:
    """The in-node all-gathers of every region, in place in ``output`` (each rank's piece is
    there already), as one step with the calls ``also`` (which gather the node's own region
    themselves: then it is skipped here); None on a node of one rank (nothing to gather)."""
    topology = groups.topology
    k, j = topology.node_of(rank), topology.local_rank(rank)
    if len(topology.nodes[k]) == 1:
        return None
    calls = list(also)
    in_place = method is UnevenMethod.BROADCASTS  # broadcasts into views: a part may be its own source
    for m in range(topology.node_count):
        lo, size = layout.region_offsets[m], layout.region_sizes[m]
        if not size or (also and m == k):
            continue
        a, b = layout.piece(topology, rank, m)
        if in_place:
            calls.append(uneven.all_gather(output[lo:lo + size], output[a:b], layout.step_sizes[k][m], j, group,
                                           method))
        else:
            source = torch.empty_like(output[a:b])
            call = uneven.all_gather(output[lo:lo + size], source, layout.step_sizes[k][m], j, group, method)
            calls.append(call._replace(run=_copied_when_run(output[a:b], source, call.run)))
    return in_node_step("all_gather", groups, group, rank, calls) if calls else None


def _copied_when_run(piece: torch.Tensor, source: torch.Tensor, run: Callable[[bool], Any]) -> Callable[[bool], Any]:
    """``run`` with ``piece`` copied into ``source`` first: the piece is written by the step
    before (the exchange), so it is read when this step is issued, not when it is built."""
    def copied(async_op: bool) -> Any:
        source.copy_(piece)
        return run(async_op)
    return copied


def place_own_part(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int,
                   topology: Topology) -> tuple[NodeLayout, int, torch.Tensor]:
    """An all-gather's layout, this rank's offset, and its part of ``output`` holding ``input``."""
    layout = node_layout(tuple(sizes), topology, output.element_size())
    lo = layout.offsets[rank]
    own = output[lo:lo + sizes[rank]]
    if input.data_ptr() != own.data_ptr():
        own.copy_(input)
    return layout, lo, own


def all_gather(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int, groups: NodeGroups,
               method: UnevenMethod, keep: torch.Tensor | None = None) -> HierarchicalCall:
    """``output`` (the parts back to back) gets every rank's ``input`` (``sizes[rank]`` long):
    the exchange of each part to its holders in the other nodes, then in-node all-gathers
    (module doc). ``keep``: where this rank's secondary shard is copied once the call is done
    (``secondary_numel`` long)."""
    topology = groups.topology
    layout, lo, own = place_own_part(output, input, sizes, rank, topology)
    sends, recvs = [], []
    for t in layout.transfers:
        if t.owner == rank:
            sends.append((t.holder, own[t.at - lo:t.at - lo + t.length]))
        if t.holder == rank:
            recvs.append((t.owner, output[t.at:t.at + t.length]))
    observed = observed_exchange(layout, topology, output.element_size())
    steps = [exchange_step(groups, groups.cross_first, observed, sends, recvs, None)]
    gather = gather_in_node(output, layout, rank, groups, method, groups.node_later[topology.node_of(rank)])
    if gather is not None:
        steps.append(gather)
    finish = None if keep is None else (lambda: copy_secondary(output, keep, layout, topology, rank, True))
    return HierarchicalCall(steps, finish)


def all_gather_within(output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor, sizes: Sequence[int],
                      rank: int, groups: NodeGroups, method: UnevenMethod) -> HierarchicalCall:
    """The all-gather of ``all_gather`` from this rank's part ``input`` and its ``secondary``
    shard (kept by an earlier ``all_gather(..., keep=)`` of the same values): the in-node step
    alone, nothing crosses a node."""
    topology = groups.topology
    layout, lo, own = place_own_part(output, input, sizes, rank, topology)
    copy_secondary(output, secondary, layout, topology, rank, False)
    gather = gather_in_node(output, layout, rank, groups, method, groups.node_first[topology.node_of(rank)])
    return HierarchicalCall([] if gather is None else [gather], None)


def copy_secondary(output: torch.Tensor, secondary: torch.Tensor, layout: NodeLayout, topology: Topology,
                   rank: int, out_of_output: bool) -> None:
    """Copy this rank's pieces of the other regions from ``output`` into ``secondary`` (or back)."""
    at, k = 0, topology.node_of(rank)
    for m in range(topology.node_count):
        if m == k:
            continue
        a, b = layout.piece(topology, rank, m)
        if out_of_output:
            secondary[at:at + b - a].copy_(output[a:b])
        else:
            output[a:b].copy_(secondary[at:at + b - a])
        at += b - a


# -- crossing nodes once per iteration (Note: node partials, accumulated) --

ACCUMULATOR_DTYPE = torch.float32  # node partials are summed over micro-steps in fp32


def accumulator_layout(sizes: Sequence[int], topology: Topology) -> NodeLayout:
    """The cut of a node accumulator of parts ``sizes``: one layout for every micro-step's in-node
    step and the exchange, whatever dtype the in-node step runs in (pieces aligned for fp32)."""
    return node_layout(tuple(sizes), topology, ACCUMULATOR_DTYPE.itemsize)


def accumulator_numel(layout: NodeLayout, topology: Topology, rank: int) -> int:
    """The length of ``rank``'s node accumulator: its own part and its pieces of the other regions."""
    k, j = topology.node_of(rank), topology.local_rank(rank)
    return layout.step_sizes[k][k][j] + layout.secondary_numel(topology, rank)


def accumulator_views(acc: torch.Tensor, layout: NodeLayout, topology: Topology, rank: int) -> dict[int, torch.Tensor]:
    """``acc`` cut into this rank's piece of each node m's region (its own part for its own node,
    first; then the other nodes' pieces in node order)."""
    k, j = topology.node_of(rank), topology.local_rank(rank)
    own = layout.step_sizes[k][k][j]
    views, at = {k: acc[:own]}, own
    for m in range(topology.node_count):
        if m != k:
            a, b = layout.piece(topology, rank, m)
            views[m], at = acc[at:at + b - a], at + b - a
    return views


def reduce_scatter_in_node(partials: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int,
                           groups: NodeGroups, method: UnevenMethod) -> HierarchicalCall:
    """The first step of ``reduce_scatter`` alone: ``partials`` (``accumulator_numel`` long, in
    ``input``'s dtype) gets this rank's node partial sums of its own part and of its pieces of
    every other region. Nothing crosses a node."""
    topology = groups.topology
    layout = accumulator_layout(sizes, topology)
    k, j = topology.node_of(rank), topology.local_rank(rank)
    node, group = topology.nodes[k], groups.node_first[k]
    views = accumulator_views(partials, layout, topology, rank)
    regions = {m: input[lo:lo + size] for m, (lo, size) in enumerate(zip(layout.region_offsets, layout.region_sizes))}
    if len(node) == 1:  # a node of one: its partials are its input
        def copy() -> None:
            for m, view in views.items():
                view.copy_(regions[m])
        return HierarchicalCall([Step("reduce_scatter", Link.INTRA, None, 0, 0, lambda a: None, copy)], None)
    calls = [uneven.reduce_scatter(views[m], regions[m], layout.step_sizes[k][m], j, group, method)
             for m in range(topology.node_count) if layout.region_sizes[m]]
    return HierarchicalCall([in_node_step("reduce_scatter", groups, group, rank, calls)] if calls else [], None)


def exchange_accumulated(output: torch.Tensor, acc: torch.Tensor, sizes: Sequence[int], rank: int,
                         groups: NodeGroups) -> HierarchicalCall:
    """The second step of ``reduce_scatter`` from a node accumulator: every holder sends its
    pieces' overlaps with each owner's part; ``output`` (``sizes[rank]`` long) has added to it
    this rank's node partial and the other nodes' partials, in node order; ``acc`` is zero after."""
    topology = groups.topology
    layout = accumulator_layout(sizes, topology)
    k = topology.node_of(rank)
    views = accumulator_views(acc, layout, topology, rank)
    incoming = torch.empty(topology.node_count - 1, sizes[rank], dtype=acc.dtype, device=acc.device)
    sends, recvs = exchange_transfers(layout, topology, rank, views, incoming)

    def add_partials() -> None:
        total = views[k].clone()
        for row in incoming:
            total.add_(row)
        output.add_(total.to(output.dtype))
        acc.zero_()
    observed = observed_exchange(layout, topology, acc.element_size())
    return HierarchicalCall([exchange_step(groups, groups.cross_first, observed, sends, recvs, add_partials)], None)


def all_reduce(tensor: torch.Tensor, rank: int, groups: NodeGroups, scatter: UnevenMethod,
               gather: UnevenMethod) -> HierarchicalCall:
    """``tensor`` summed over every rank, in place, crossing nodes once: ``reduce_scatter`` of it
    cut into one part per rank (about equal, aligned), then ``all_gather`` of the parts: in-node
    reduce-scatters, the exchange, the exchange back, in-node all-gathers. Node k sends (1 - s_k)
    of the buffer across and then its region to every other node; a flat ring sends 2 (N-1)/N of
    it over every boundary."""
    topology = groups.topology
    parts = pieces(tensor.numel(), topology.world_size, max(1, ALIGN_BYTES // tensor.element_size()))
    lo = sum(parts[:rank])
    own = tensor[lo:lo + parts[rank]]
    summed = torch.empty_like(own)
    scattered = reduce_scatter(summed, tensor, parts, rank, groups, scatter)
    gathered = all_gather(tensor, own, parts, rank, groups, gather)  # sends ``own`` once it holds the sum
    last = scattered.steps[-1]

    def own_sum() -> None:
        if last.finish is not None:
            last.finish()
        own.copy_(summed)
    return HierarchicalCall(scattered.steps[:-1] + [last._replace(finish=own_sum)] + gathered.steps, None)
