"""Route objects: one class per way of running the reduce-scatters and all-gathers (docs/design.md §3.10).

A plan's ``Route`` (``poplar.types.route``) names the way; ``Communicator.configure`` builds its
route objects once per route (``build``): one over the world, for the state collectives
(checkpoints, re-sharding), and one over the ranks in the step. A route object owns the process
groups it runs on (``Members``; ``NodeGroups`` for the hierarchical ways) and builds each
collective as a call for the communicator to issue: an ``UnevenCall`` (one collective on its
group; ``run`` None when there is nothing to issue: a rank alone did it where it was built) or a
``HierarchicalCall`` (a chain of steps, issued in order: ``poplar.comm.communicator``). A route
never records or observes: the communicator's ledger and observer hear what it built.

The ways:

- ``OneRank``: a world, or a step, of one rank: every collective is a local copy.
- ``FlatRoute``: one ring over every rank: torch's tensor collectives for parts of one length
  (NCCL), the uneven methods (``poplar.comm.uneven``) for parts of different lengths.
- ``UnevenRoute``: one ring over every rank, every call on the uneven methods (gloo: Note: even
  parts on gloo, in ``poplar.comm.uneven``).
- ``HierarchicalRoute``: a step inside each node and one exchange across (``poplar.comm.hierarchical``).
- ``SecondaryShardsRoute``: hierarchical; an all-gather can keep this rank's node-local secondary
  shard, and the gather of the same values again stays inside the node.
- ``OncePerIterationRoute``: secondary shards kept for the whole iteration, and gradients
  reduce-scattered inside the node each micro-step into a node accumulator, crossing nodes once
  per iteration (``poplar.comm.hierarchical``, Note: node partials, accumulated); ZeRO-0's
  gradient all-reduce hierarchical, crossing nodes once.
- ``PretendWorld``: the capacity search's rank r of N that talks to no one (``poplar.profiler.local_comm``).

[Note: compression is the route's policy]
A collective given a ``Quantization`` (the stage's: ``CommPolicy.weight_quantization`` /
``gradient_quantization``) sends quantized what its scope covers on this route (``quantized``):
``CROSS_NODE``, the bytes that cross nodes: a hierarchical route's exchange, a flat route's every
byte where its ranks span nodes, nothing on one node; ``EVERY_STEP`` (weights), every byte: a
hierarchical route then gathers flat, quantized (``poplar.comm.quantized``). A rank alone
quantizes nothing.

Adding a way: its ``Collectives`` member (``poplar.types.route``), its class here and its entry
in ``WAYS``, and its price (``poplar.planner.link_pricing.LinkPricing.call_s``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from poplar.comm import hierarchical, quantized, uneven
from poplar.comm.hierarchical import HierarchicalCall, NodeGroups
from poplar.comm.uneven import UnevenCall, UnevenMethod, all_gather_tensor, reduce_scatter_tensor
from poplar.types.compression import Quantization, QuantScope
from poplar.types.route import Collectives, Route
from poplar.types.topology import Link, Topology, Wire

Call = UnevenCall | HierarchicalCall


class Members(NamedTuple):
    """The ranks a route runs over: their process ``group`` (None: torch's default), this rank's
    number among them, the ``wire`` (their link and GLOBAL ranks: what an observer hears; a
    sub-group's own numbers 0..n-1 would name other ranks of the world) and the backend."""

    group: Any
    rank: int
    wire: Wire
    backend: str

    @property
    def size(self) -> int:
        return len(self.wire.ranks)

    @classmethod
    def of_group(cls, group: Any, link: Link) -> "Members":
        """The members of ``group`` (None: the default group; a world of one with no process group).
        None stays None, looked up at each call: holding the default group object would keep it
        (and gloo's threads) alive past destroy_process_group(), to be torn down during
        interpreter shutdown, where a gloo thread can abort the process."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, Wire(link, (0,)), "none")
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None \
            else tuple(range(dist.get_world_size()))
        return cls(group, dist.get_rank(group), Wire(link, ranks), dist.get_backend(group))


class CollectiveRoute:
    """What every way implements. The base runs nothing of its own: it applies the compression
    policy (Note: compression is the route's policy), builds the flat quantized calls, and says
    what a way without secondary shards says (none kept, 0 elements)."""

    keeps_secondary = False  # an all-gather can keep this rank's node-local secondary shard
    secondary_for_iteration = False  # the kept shard serves every gather of the iteration, not only backward's
    alone = False  # no peer to talk to: every collective is this rank's own (no process group used)

    def __init__(self, members: Members, topology: Topology) -> None:
        self.members, self.topology = members, topology

    @property
    def size(self) -> int:
        return self.members.size

    @property
    def wire(self) -> Wire:
        return self.members.wire

    @property
    def gathers_in_place(self) -> bool:
        """Whether an all-gather's ``input`` may be this rank's own part of ``output`` (a view of
        it): one rank, and gloo, whose all-gather is one broadcast per part into ``output``
        (``uneven.even_method``). Elsewhere the input must be a separate tensor."""
        return self.size == 1 or uneven.even_method(self.members.backend, "all_gather") is UnevenMethod.BROADCASTS

    def quantized(self, quantization: Quantization | None) -> Quantization | None:
        """What a collective given ``quantization`` quantizes here (Note: compression is the
        route's policy): None on one rank, and for ``CROSS_NODE`` where the ranks are on one node."""
        if quantization is None or self.size == 1:
            return None
        if quantization.scope is QuantScope.CROSS_NODE and not self.topology.spans_nodes:
            return None
        return quantization

    def parts(self, sizes: Sequence[int] | None, part_numel: int) -> list[int]:
        return list(sizes) if sizes is not None else [part_numel] * self.size

    def method(self, op: str) -> UnevenMethod:
        return uneven.method_for(self.members.backend, op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                       quantization: Quantization | None) -> Call:
        """``output`` (1/N of ``input``, or ``sizes[rank]`` elements: every rank's part, in rank
        order) gets this rank's part of the sum of ``input`` over the route's ranks."""
        q = self.quantized(quantization)
        if q is None:
            return self.exact_reduce_scatter(output, input, sizes)
        m = self.members
        return quantized.reduce_scatter(output, input, self.parts(sizes, output.numel()), m.rank, m.group, q)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                   quantization: Quantization | None) -> Call:
        """``output`` (N x ``input``, or the ``sizes`` of every rank's part back to back) gets
        every rank's ``input``, in rank order."""
        q = self.quantized(quantization)
        if q is None:
            return self.exact_all_gather(output, input, sizes)
        m = self.members
        return quantized.all_gather(output, input, self.parts(sizes, input.numel()), m.rank, m.group,
                                    self.method("all_gather"), q)

    def exact_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None) -> Call:
        m = self.members
        return uneven.reduce_scatter(output, input, self.parts(sizes, output.numel()), m.rank, m.group,
                                     self.method("reduce_scatter"))

    def exact_all_gather(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None) -> Call:
        m = self.members
        return uneven.all_gather(output, input, self.parts(sizes, input.numel()), m.rank, m.group,
                                 self.method("all_gather"))

    def staging_bytes(self, op: str, sizes: Sequence[int] | None, part_numel: int, element_size: int,
                      quantization: Quantization | None) -> int:
        """Bytes ``op`` ("all_gather" / "reduce_scatter") of parts ``sizes`` (None: every part
        ``part_numel`` long) allocates on this rank while it runs: what its quantized bytes stage."""
        q = self.quantized(quantization)
        return 0 if q is None else quantized.staging_bytes(op, self.parts(sizes, part_numel), self.members.rank, q)

    def secondary_numel(self, sizes: Sequence[int] | None, part_numel: int, element_size: int) -> int:
        """The length of this rank's secondary shard of an all-gather of parts ``sizes``: none here."""
        return 0

    def all_gather_keeping(self, output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor,
                           sizes: Sequence[int] | None, quantization: Quantization | None) -> HierarchicalCall:
        """``all_gather``, keeping this rank's secondary shard in ``secondary`` once it is done."""
        raise RuntimeError(f"{type(self).__name__} keeps no secondary shards; they need hierarchical collectives "
                           "over ranks that span nodes (Collectives.SECONDARY_SHARDS)")

    def all_gather_within_nodes(self, output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor,
                                sizes: Sequence[int] | None, quantization: Quantization | None) -> HierarchicalCall:
        """The all-gather of ``all_gather_keeping`` again, from the ``secondary`` shard it kept."""
        return self.all_gather_keeping(output, input, secondary, sizes, quantization)

    def all_reduce(self, tensor: torch.Tensor) -> UnevenCall:
        """The sum of ``tensor`` over the members, in place: one all-reduce on their group (nothing
        to issue for one rank alone)."""
        group = self.members.group
        run = None if self.alone else (lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=a))
        return UnevenCall(run, None, tensor.numel() * tensor.element_size())

    def all_reduce_gradients(self, tensor: torch.Tensor) -> Call:
        """ZeRO-0's gradient all-reduce of ``tensor``: the flat ``all_reduce`` on every way but
        the one that crosses nodes once per iteration."""
        return self.all_reduce(tensor)

    def accumulates(self, quantization: Quantization | None) -> bool:
        """Whether gradient reduce-scatters given ``quantization`` run in two halves here: inside
        the node each micro-step into a node accumulator (``reduce_scatter_in_node``), across
        nodes once per iteration (``exchange_accumulated``). Not on this way."""
        return False

    def accumulator_numel(self, sizes: Sequence[int] | None, part_numel: int) -> int:
        """The length of this rank's node accumulator of parts ``sizes``: 0 on a way without one."""
        return 0

    def reduce_scatter_in_node(self, partials: torch.Tensor, input: torch.Tensor,
                               sizes: Sequence[int] | None) -> HierarchicalCall:
        raise RuntimeError(f"{type(self).__name__} keeps no node accumulator (Collectives.ONCE_PER_ITERATION)")

    def exchange_accumulated(self, output: torch.Tensor, acc: torch.Tensor,
                             sizes: Sequence[int] | None) -> HierarchicalCall:
        raise RuntimeError(f"{type(self).__name__} keeps no node accumulator (Collectives.ONCE_PER_ITERATION)")


class OneRank(CollectiveRoute):
    """A world, or a step, of one rank: every collective is a copy, recorded as if sent."""

    alone = True

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                       quantization: Quantization | None) -> Call:
        output.copy_(input)
        return UnevenCall(None, None, input.numel() * input.element_size())

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                   quantization: Quantization | None) -> Call:
        output.copy_(input)
        return UnevenCall(None, None, output.numel() * output.element_size())


class UnevenRoute(CollectiveRoute):
    """One ring over every rank, each part its own length, every call on the uneven methods
    (``poplar.comm.uneven``): gloo's way, for equal parts too (faster there than its tensor
    collectives, with the same bytes on the wire)."""


class FlatRoute(CollectiveRoute):
    """One ring over every rank: torch's tensor collectives where every part has one length, the
    uneven methods where they differ (uneven shards: ``UnevenRoute``'s calls)."""

    def exact_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None) -> Call:
        if sizes is not None and len(set(sizes)) > 1:
            return super().exact_reduce_scatter(output, input, sizes)
        group = self.members.group
        return UnevenCall(lambda a: reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=group,
                                                          async_op=a), None, input.numel() * input.element_size())

    def exact_all_gather(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None) -> Call:
        if sizes is not None and len(set(sizes)) > 1:
            return super().exact_all_gather(output, input, sizes)
        group = self.members.group
        return UnevenCall(lambda a: all_gather_tensor(output, input, group=group, async_op=a), None,
                          output.numel() * output.element_size())


class HierarchicalRoute(CollectiveRoute):
    """A step inside each node on its fast link and one exchange between nodes that moves each
    element across once (``poplar.comm.hierarchical``); quantized, the exchange is
    (``poplar.comm.quantized``), and weights quantized at every step gather flat."""

    def __init__(self, members: Members, groups: NodeGroups) -> None:
        super().__init__(members, groups.topology)
        self.groups = groups

    def _hierarchical(self, q: Quantization | None) -> bool:
        return q is None or q.scope is QuantScope.CROSS_NODE

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                       quantization: Quantization | None) -> Call:
        q = self.quantized(quantization)
        if not self._hierarchical(q):
            return super().reduce_scatter(output, input, sizes, q)
        parts, rank, method = self.parts(sizes, output.numel()), self.members.rank, self.method("reduce_scatter")
        if q is None:
            return hierarchical.reduce_scatter(output, input, parts, rank, self.groups, method)
        return quantized.hierarchical_reduce_scatter(output, input, parts, rank, self.groups, method, q)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                   quantization: Quantization | None) -> Call:
        return self._gather(output, input, sizes, quantization, None)

    def _gather(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                quantization: Quantization | None, keep: torch.Tensor | None) -> Call:
        q = self.quantized(quantization)
        parts, rank, method = self.parts(sizes, input.numel()), self.members.rank, self.method("all_gather")
        if q is None:
            return hierarchical.all_gather(output, input, parts, rank, self.groups, method, keep=keep)
        if q.scope is QuantScope.CROSS_NODE:
            return quantized.hierarchical_all_gather(output, input, parts, rank, self.groups, method, q, keep=keep)
        if keep is None:
            return super().all_gather(output, input, sizes, q)
        flat = (self.members.group, self.members.wire)
        return quantized.flat_all_gather_keeping(output, input, parts, rank, self.groups, flat, method, q, keep)

    def staging_bytes(self, op: str, sizes: Sequence[int] | None, part_numel: int, element_size: int,
                      quantization: Quantization | None) -> int:
        """Besides what its quantized bytes stage, the pieces a hierarchical ``op`` holds."""
        extra = super().staging_bytes(op, sizes, part_numel, element_size, quantization)
        layout = hierarchical.node_layout(tuple(self.parts(sizes, part_numel)), self.topology, element_size)
        in_place = self.method("all_gather") is UnevenMethod.BROADCASTS
        return hierarchical.staging_numel(op, layout, self.topology, self.members.rank, in_place) * element_size + extra


class SecondaryShardsRoute(HierarchicalRoute):
    """Hierarchical, and ZeRO-3's forward gather keeps this rank's node-local secondary shard, so
    the backward gather of the same values stays inside the node (ZeRO++'s hpZ, exact;
    ``poplar.comm.hierarchical``, Note: secondary shards)."""

    keeps_secondary = True

    def secondary_numel(self, sizes: Sequence[int] | None, part_numel: int, element_size: int) -> int:
        layout = hierarchical.node_layout(tuple(self.parts(sizes, part_numel)), self.topology, element_size)
        return layout.secondary_numel(self.topology, self.members.rank)

    def all_gather_keeping(self, output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor,
                           sizes: Sequence[int] | None, quantization: Quantization | None) -> HierarchicalCall:
        """Quantized, the shard holds the values as dequantized (``poplar.comm.quantized``)."""
        call = self._gather(output, input, sizes, quantization, secondary)
        assert isinstance(call, HierarchicalCall)
        return call

    def all_gather_within_nodes(self, output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor,
                                sizes: Sequence[int] | None, quantization: Quantization | None) -> HierarchicalCall:
        """Inside each node only; ``quantization``: the one the keeping gather used (only
        ``EVERY_STEP`` quantizes here: the node's own parts, as it did)."""
        q = self.quantized(quantization)
        parts, rank, method = self.parts(sizes, input.numel()), self.members.rank, self.method("all_gather")
        if q is not None and q.scope is QuantScope.EVERY_STEP:
            return quantized.all_gather_within_every_step(output, input, secondary, parts, rank, self.groups,
                                                          method, q)
        return hierarchical.all_gather_within(output, input, secondary, parts, rank, self.groups, method)


class OncePerIterationRoute(SecondaryShardsRoute):
    """Across nodes once per iteration (docs/design.md §3.10.12). ZeRO-3's parameters: a block's
    first gather of the iteration crosses nodes and keeps its secondary shard, every later one
    (forward or backward, any micro-step) runs inside the node from it, until the optimizer step
    changes the parameters (``secondary_for_iteration``: the stage drops it then). Gradients
    (ZeRO-2/3): each micro-step's reduce-scatter runs inside the node into the rank's node
    accumulator, the exchange once per iteration (``accumulates``). Quantized gradients reduce
    per micro-step, as ``SecondaryShardsRoute`` does: their exchange quantizes each partial sent."""

    secondary_for_iteration = True

    def all_reduce_gradients(self, tensor: torch.Tensor) -> Call:
        """ZeRO-0: the all-reduce crosses nodes once, hierarchically (``hierarchical.all_reduce``)."""
        return hierarchical.all_reduce(tensor, self.members.rank, self.groups, self.method("reduce_scatter"),
                                       self.method("all_gather"))

    def accumulates(self, quantization: Quantization | None) -> bool:
        return self.quantized(quantization) is None

    def accumulator_numel(self, sizes: Sequence[int] | None, part_numel: int) -> int:
        layout = hierarchical.accumulator_layout(self.parts(sizes, part_numel), self.topology)
        return hierarchical.accumulator_numel(layout, self.topology, self.members.rank)

    def reduce_scatter_in_node(self, partials: torch.Tensor, input: torch.Tensor,
                               sizes: Sequence[int] | None) -> HierarchicalCall:
        parts = self.parts(sizes, input.numel() // self.size)
        return hierarchical.reduce_scatter_in_node(partials, input, parts, self.members.rank, self.groups,
                                                   self.method("reduce_scatter"))

    def exchange_accumulated(self, output: torch.Tensor, acc: torch.Tensor,
                             sizes: Sequence[int] | None) -> HierarchicalCall:
        return hierarchical.exchange_accumulated(output, acc, self.parts(sizes, output.numel()), self.members.rank,
                                                 self.groups)


class PretendWorld(CollectiveRoute):
    """Rank r of a pretend world of N (the capacity search, ``poplar.profiler.local_comm``): the
    buffers of the real world and collectives that are local copies. An all-gather tiles this
    rank's input into every part (the others' are unknown; tiling keeps the gathered weights
    finite and of the right magnitude); a reduce-scatter keeps this rank's slice of its own
    input. Nothing is sent, so nothing is quantized; what a quantized collective would stage is
    counted (``staging_bytes``) as on a real route."""

    alone = True

    def __init__(self, world_size: int, rank: int) -> None:
        super().__init__(Members(None, rank, Wire.world(world_size), "local"), Topology.single(world_size))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                       quantization: Quantization | None) -> Call:
        rank = self.members.rank
        if sizes is None:
            output.copy_(input.view(self.size, -1)[rank].view_as(output))
        else:
            output.copy_(input.split(list(sizes))[rank])
        return UnevenCall(None, None, input.numel() * input.element_size())

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int] | None,
                   quantization: Quantization | None) -> Call:
        nbytes = output.numel() * output.element_size()
        if sizes is None:
            output.view(self.size, -1).copy_(input.reshape(1, -1).expand(self.size, -1))
            return UnevenCall(None, None, nbytes)
        for part in output.split(list(sizes)):  # each part: this rank's values, repeated to fit
            n = part.numel()
            if n and input.numel():
                part.copy_(input.reshape(-1).repeat(-(-n // input.numel()))[:n])
            else:
                part.zero_()
        return UnevenCall(None, None, nbytes)


# the hierarchical ways, by the ``Collectives`` member they run (flat is ``build``'s default)
WAYS: dict[Collectives, type[HierarchicalRoute]] = {
    Collectives.HIERARCHICAL: HierarchicalRoute,
    Collectives.SECONDARY_SHARDS: SecondaryShardsRoute,
    Collectives.ONCE_PER_ITERATION: OncePerIterationRoute,
}


def build(collectives: Collectives, members: Members, topology: Topology,
          groups: NodeGroups | None) -> CollectiveRoute:
    """The route object of ``collectives`` over ``members`` (on ``topology``; ``groups``: its
    node process groups where it spans nodes, else None): one rank alone, or a flat way on one
    node, whatever the way asked."""
    if members.size == 1:
        return OneRank(members, topology)
    if collectives is Collectives.FLAT or groups is None:
        flat = UnevenRoute if uneven.even_method(members.backend, "all_gather") is not None else FlatRoute
        return flat(members, topology)
    return WAYS[collectives](members, groups)


class StepGroups:
    """The process groups of each set of ranks a plan keeps in its step, made the first time that
    set is asked for and kept: ``new_group`` is collective over the world, so every rank makes
    them together, in one order (docs/design.md §3.10.1)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, ...], tuple[Members | None, NodeGroups | None, Topology]] = {}

    def of(self, ranks: tuple[int, ...], rank: int, topology: Topology) -> tuple[Members | None, NodeGroups | None,
                                                                                  Topology]:
        """The step's members on this ``rank`` (None where it is left out), its node groups where
        its ranks span nodes of ``topology``, and its own topology."""
        if ranks not in self._made:
            group = dist.new_group(list(ranks))
            sizes = [n for n in (sum(1 for r in node if r in ranks) for node in topology.nodes) if n]
            step_topology = Topology.of_sizes(sizes) if len(sizes) > 1 else Topology.single(len(ranks))
            groups = NodeGroups.create(step_topology, ranks) if len(sizes) > 1 else None
            members = Members.of_group(group, Link.FLAT) if rank in ranks else None
            self._made[ranks] = (members, groups, step_topology)
        return self._made[ranks]


class Routes(NamedTuple):
    """A plan's route objects on this rank (``Communicator.configure``): the world's, for the
    state collectives, and the step's (None on a rank the plan leaves out; the world's when every
    rank is in the step)."""

    route: Route
    world: CollectiveRoute
    step: CollectiveRoute | None

    @property
    def keeps_secondary(self) -> bool:
        """Whether this rank's step gathers keep node-local secondary shards (ZeRO-3)."""
        return self.step is not None and self.step.keeps_secondary

    @property
    def secondary_for_iteration(self) -> bool:
        """Whether this rank's secondary shards serve every gather of an iteration (ZeRO-3)."""
        return self.step is not None and self.step.secondary_for_iteration

    def accumulates(self, quantization: Quantization | None) -> bool:
        """Whether this rank's step reduce-scatters gradients given ``quantization`` into a node
        accumulator, crossing nodes once per iteration (ZeRO-2/3)."""
        return self.step is not None and self.step.accumulates(quantization)

    def current(self, stepping: bool, rank: int) -> CollectiveRoute:
        """The route object a collective runs on: the step's while ``stepping``, else the world's."""
        if not stepping or self.step is self.world:
            return self.world
        if self.step is None:
            raise RuntimeError(f"rank {rank} is left out of the training step (the plan gives it no samples and no "
                               "shard) but issued a step collective; a rank left out runs no step")
        return self.step

    def parts(self, route: CollectiveRoute, sizes: Sequence[int] | None) -> Sequence[int] | None:
        """``sizes`` (given over the world, as the shard layout has them) as ``route``'s parts:
        the world's as they are, the step's those of the ranks in the step."""
        if route is self.world:
            return sizes
        world, step = self.world.size, self.route.ranks_in_step(self.world.size)
        if sizes is None or len(sizes) != world:
            raise RuntimeError("a collective over the ranks in the step needs every world rank's part size")
        if any(sizes[r] for r in range(world) if r not in step):
            raise RuntimeError("a rank left out of the step holds a part of a step collective; its shard weight must be 0")
        return [sizes[r] for r in step]
