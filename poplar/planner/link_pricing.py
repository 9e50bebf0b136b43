"""Link pricing: the seconds of one collective on the links it crosses, for a job whose ranks
span nodes (docs/design.md §5.2).

A flat ring over the ranks of several nodes moves (N-1)/N of the buffer over every hop, the
node-boundary hops included, so it runs at the pace of the slowest link it crosses: the profile's
flat link (``Links.bandwidth_bytes_per_s``, measured over every rank, or the slowest tier). A
hierarchical reduce-scatter or all-gather of a buffer of B bytes runs in two steps:

- inside each node k of L_k ranks, a collective of the whole buffer over the node's ranks:
  (L_k-1)/L_k B bus bytes on node k's own link; the nodes run at once, so the step lasts as long
  as its slowest node;
- across nodes, each element once: node k, holding the share s_k of the buffer, sends
  (1 - s_k) B and receives (K-1) s_k B over the cross-node link; the step lasts as long as the
  node with the most bytes either way (even shares: (K-1)/K B, the cross link's bus bytes).

With node-local secondary shards at ZeRO-3, the backward re-gather is the intra-node step alone.

Across nodes once per iteration (``Collectives.ONCE_PER_ITERATION``), a micro-step's gathers and
reduce-scatters are their intra-node steps alone (``call_s(..., in_micro_step=True)``); each
block's gather and each gradient buffer's exchange cross nodes once per iteration, priced by
``crossing_s`` and added to the iteration's end whole (not hidden by compute: the exchange runs
after the last backward). A call quantized across nodes keeps its crossing per micro-step (its
exchange quantizes each partial), priced as secondary shards. Calls at the iteration's end
(ZeRO-1's, ZeRO-2's parameter gather) cross as hierarchical ones do.
ZeRO-0's gradient all-reduce of B bytes, across nodes once per iteration, runs hierarchically
(``hierarchical.all_reduce``): a reduce-scatter and an all-gather of the buffer cut into about
equal parts per rank, so node k's share is its ranks over all of them, whatever the shard
weights. It costs both collectives' two steps (``gradient_all_reduce_s``): node k sends
(1 - s_k) B across at the reduce-scatter and (K-1) s_k B at the all-gather (``exchange_bytes``).
Every other way runs it as one flat ring, and so does every other all-reduce (the status and
grad-norm reductions, a few numbers each): those ``call_s`` prices flat. The recorded collectives
do not say which all-reduce is the gradients' (they are ``[op, bytes]`` pairs), so the cost model
prices the gradients' from the table, one all-reduce of the full gradients
(``CommModel.all_reduce_s``).

Everything is priced from node sizes and shares, not from the world: a plan that leaves a rank
or a node out is priced by the ``LinkPricing`` of the nodes that take part (``with_nodes``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from poplar.planner.quantized_pricing import QuantizedWire
from poplar.types.plans import PlanError
from poplar.types.profiles import Links, LinkSpeed, slowest_tier
from poplar.types.route import Collectives


def ring_s(link: LinkSpeed, op: str, nbytes: float, ranks: int) -> float:
    """One ring collective of a ``nbytes`` buffer over ``ranks`` ranks on ``link`` (0 for one rank):
    2 (N-1)/N of it for an all-reduce, (N-1)/N for a reduce-scatter or an all-gather."""
    if ranks <= 1:
        return 0.0
    factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks
    return factor * nbytes / link.bandwidth_bytes_per_s + link.latency_s


@dataclass(frozen=True)
class LinkPricing:
    """The links of the nodes that take part in a plan: ``sizes[k]`` ranks on node k, its link
    ``intra[k]``, its share ``shares[k]`` of a sharded buffer (sum 1), the ``cross`` link between
    nodes and the ``flat`` link a ring over all of them runs at."""

    flat: LinkSpeed
    sizes: tuple[int, ...]
    intra: tuple[LinkSpeed, ...]
    shares: tuple[float, ...]
    cross: LinkSpeed | None = None

    @classmethod
    def of(cls, links: Links, world_size: int, shard_weights: Sequence[float] | None = None) -> "LinkPricing":
        """The pricing of ``links`` for every rank, each node's share the sum of its ranks' shard
        weights (None: even). A job on one node is one node on the flat link."""
        weights = [1.0] * world_size if shard_weights is None else [float(w) for w in shard_weights]
        if links.topology is None or not links.topology.spans_nodes:
            return cls(links.flat, (world_size,), (links.flat,), (1.0,))
        nodes = links.topology.nodes
        total = sum(weights)
        shares = tuple(sum(weights[r] for r in node) / total for node in nodes)
        return cls(links.flat, tuple(len(n) for n in nodes), links.intra, shares, links.cross)

    @property
    def world_size(self) -> int:
        return sum(self.sizes)

    @property
    def spans_nodes(self) -> bool:
        return len(self.sizes) > 1

    def with_nodes(self, keep: Sequence[int]) -> "LinkPricing":
        """The pricing of the nodes ``keep`` alone (their shares scaled to sum 1; one node left:
        its own link is the flat one)."""
        keep = list(keep)
        total = sum(self.shares[k] for k in keep)
        if not keep or total <= 0:
            raise PlanError(f"nodes {keep} hold no share of the sharded state; keep a node that holds some")
        sizes, intra = tuple(self.sizes[k] for k in keep), tuple(self.intra[k] for k in keep)
        shares = tuple(self.shares[k] / total for k in keep)
        if len(keep) == 1:
            return LinkPricing(intra[0], sizes, intra, shares)
        assert self.cross is not None  # more than one node
        return LinkPricing(slowest_tier(intra, sizes, self.cross), sizes, intra, shares, self.cross)

    def flat_s(self, op: str, nbytes: float) -> float:
        """A ring over every rank, on the flat link."""
        return ring_s(self.flat, op, nbytes, self.world_size)

    def intra_s(self, op: str, nbytes: float) -> float:
        """The step inside each node (the whole buffer over the node's ranks), nodes at once."""
        return max(ring_s(link, op, nbytes, n) for link, n in zip(self.intra, self.sizes))

    def exchange_bytes(self, nbytes: float) -> tuple[tuple[float, float], ...]:
        """Per node, (sent, received) across nodes at a reduce-scatter's exchange of a ``nbytes``
        buffer: node k sends the partial sums of everything outside its share, (1 - s_k) B, and
        receives its share from each other node, (K-1) s_k B (an all-gather's is the reverse)."""
        k = len(self.sizes)
        return tuple(((1.0 - s) * nbytes, (k - 1) * s * nbytes) for s in self.shares)

    def cross_s(self, nbytes: float) -> float:
        """The step across nodes: each element once (``exchange_bytes``); the step lasts as long
        as the busiest node, either way."""
        if len(self.sizes) <= 1 or self.cross is None:
            return 0.0
        busiest = max(max(pair) for pair in self.exchange_bytes(nbytes))
        return busiest / self.cross.bandwidth_bytes_per_s + self.cross.latency_s

    def even(self) -> "LinkPricing":
        """These links with the buffer cut about equally per rank: node k's share its ranks over
        all of them (the parts of ZeRO-0's hierarchical all-reduce)."""
        world = self.world_size
        return replace(self, shares=tuple(n / world for n in self.sizes))

    def gradient_all_reduce_s(self, nbytes: float, collectives: Collectives) -> float:
        """ZeRO-0's gradient all-reduce of a ``nbytes`` buffer run as ``collectives``: across nodes
        once per iteration, hierarchically with even parts (the in-node reduce-scatter, the
        exchange, the exchange back, the in-node all-gather); every other way, one flat ring."""
        if self.world_size <= 1:
            return 0.0
        if not self.spans_nodes or collectives is not Collectives.ONCE_PER_ITERATION:
            return self.flat_s("all_reduce", nbytes)
        even = self.even()
        return sum(even.intra_s(op, nbytes) + even.cross_s(nbytes) for op in ("reduce_scatter", "all_gather"))

    def call_s(self, op: str, nbytes: float, collectives: Collectives, backward_gather: bool = False,
               wire: QuantizedWire | None = None, in_micro_step: bool = False) -> float:
        """One collective of a ``nbytes`` buffer run as ``collectives`` (an all-reduce: one flat
        ring; ZeRO-0's gradients' is ``gradient_all_reduce_s``); ``backward_gather``: a
        ZeRO-3 all-gather before backward (inside each node with secondary shards); ``wire``: its
        quantization (``quantized_pricing``): the bytes of its scope sent quantized, plus the
        conversion work; ``in_micro_step``: a call of every micro-step (once per iteration: its
        intra-node step alone, its crossing in ``crossing_s``), not of the iteration's end."""
        if self.world_size <= 1:
            return 0.0
        if wire is not None and not (self.spans_nodes or wire.every_step):
            wire = None  # cross-node scope on one node: nothing crosses, nothing is quantized
        extra = wire.conversion_s(nbytes) if wire is not None else 0.0
        sent = wire.bytes(nbytes) if wire is not None else nbytes
        if not self.spans_nodes or collectives is Collectives.FLAT or op == "all_reduce":
            return self.flat_s(op, sent) + extra
        inside = sent if wire is not None and wire.every_step else nbytes
        if in_micro_step and self._crosses_once(op, collectives, wire):
            return self.intra_s(op, inside)
        keeps = collectives.secondary_shards or collectives is Collectives.ONCE_PER_ITERATION
        if backward_gather and keeps and op == "all_gather":
            return self.intra_s(op, inside) + (extra if inside != nbytes else 0.0)
        return self.intra_s(op, inside) + self.cross_s(sent) + extra

    def crossing_s(self, op: str, nbytes: float, collectives: Collectives, wire: QuantizedWire | None = None) -> float:
        """What a micro-step's collective of a ``nbytes`` buffer adds once per iteration: its
        step across nodes where it crosses once per iteration (0 for every other way, and for a
        call quantized across nodes, which crosses per micro-step)."""
        if not self.spans_nodes or not self._crosses_once(op, collectives, wire):
            return 0.0
        return self.cross_s(nbytes)

    @staticmethod
    def _crosses_once(op: str, collectives: Collectives, wire: QuantizedWire | None) -> bool:
        return collectives is Collectives.ONCE_PER_ITERATION and op != "all_reduce" and wire is None


def secondary_shard_bytes(param_count: int, compute_itemsize: int, node_size: int) -> float:
    """What node-local secondary shards cost a rank on a node of ``node_size`` ranks, at worst:
    its 1/L part of every block's parameters in the compute dtype, held from forward to backward."""
    return param_count * compute_itemsize / node_size


def node_accumulator_bytes(param_count: int, node_size: int) -> float:
    """What crossing nodes once per iteration holds per rank at ZeRO-2/3 on a node of
    ``node_size`` ranks: its node's partial gradient sums of its pieces, 1/L of the gradients, in
    fp32 (``memory_report()["node_accumulator"]``), from the first micro-step to the exchange."""
    return param_count * 4 / node_size


def held_bytes(way: Collectives, stage: int, param_count: int, compute_itemsize: int, node_size: int) -> float:
    """What running the collectives ``way`` at ``stage`` holds per rank beyond the flat way, at
    worst: ZeRO-3's secondary shards (with secondary shards, and once per iteration, which keeps
    them the whole iteration) and the node accumulator (once per iteration, ZeRO-2/3)."""
    once = way is Collectives.ONCE_PER_ITERATION
    held = 0.0
    if stage == 3 and (way.secondary_shards or once):
        held += secondary_shard_bytes(param_count, compute_itemsize, node_size)
    if stage >= 2 and once:
        held += node_accumulator_bytes(param_count, node_size)
    return held
