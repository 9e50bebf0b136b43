"""Topology: which ranks share a machine (a node), and which link a collective crosses.

A mixed cluster is islands: the GPUs of one node talk over NVLink or PCIe, and nodes talk over
InfiniBand or Ethernet, often ten times slower. ``Topology`` groups the ranks into nodes; the
communicator runs hierarchical collectives on it (a step inside each node, a step across nodes)
and tags every collective with the ``Link`` it used, so the ledger, the profiler and the planner
can price each link on its own.

Nodes are consecutive runs of ranks in rank order, as torchrun numbers them (node 0 holds ranks
0..L0-1, node 1 the next L1, ...). A flat buffer of per-rank parts (``poplar.comm.uneven``) then
holds each node's parts back to back, so a node's region of the buffer is one slice. Nodes may
differ in size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from itertools import accumulate
from typing import Any, Mapping, NamedTuple, Sequence



class TopologyError(ValueError):
    """A topology that does not describe the job's ranks (the message names the fix)."""


class Link(str, Enum):
    """The link a collective used (compares equal to its value string)."""

    FLAT = "flat"  # one call over ranks of every node: a ring that crosses the node boundaries
    INTRA = "intra-node"  # every rank taking part is on one node
    CROSS = "cross-node"  # the step between nodes of a hierarchical collective

    def __str__(self) -> str:
        return self.value


class Wire(NamedTuple):
    """Where a collective runs: its link and the global ranks taking part (in rank order)."""

    link: Link
    ranks: tuple[int, ...]

    @classmethod
    def world(cls, world_size: int) -> "Wire":
        return cls(Link.FLAT, tuple(range(world_size)))


@dataclass(frozen=True)
class Topology:
    """The nodes of a job, each a tuple of consecutive global ranks.

    ``Topology(nodes=[[0, 1], [2, 3]])`` is two nodes of two; ``Topology.of_sizes([4, 3])`` is a
    node of 4 beside a node of 3. ``Topology.single(n)`` (one node) is what a job on one machine
    has, and its collectives are the flat ones."""

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        nodes = tuple(tuple(int(r) for r in node) for node in self.nodes)
        object.__setattr__(self, "nodes", nodes)  # frozen: normalise lists to tuples once, here
        if not nodes or any(not node for node in nodes):
            raise TopologyError(f"topology {list(map(list, nodes))}: every node needs at least one rank")
        ranks = [r for node in nodes for r in node]
        if ranks != list(range(len(ranks))):
            raise TopologyError(
                f"topology {list(map(list, nodes))}: nodes must be consecutive runs of ranks 0..N-1 in order, "
                "each rank once (torchrun numbers ranks node by node); renumber the ranks so each node's are "
                "consecutive, e.g. [[0, 1], [2, 3]]")

    @classmethod
    def single(cls, world_size: int) -> "Topology":
        return cls(nodes=(tuple(range(world_size)),))

    @classmethod
    def of_sizes(cls, sizes: Sequence[int]) -> "Topology":
        starts = list(accumulate(sizes, initial=0))
        return cls(nodes=tuple(tuple(range(a, a + n)) for a, n in zip(starts, sizes)))

    @classmethod
    def from_launcher(cls, environ: Mapping[str, str], world_size: int) -> "Topology":
        """The nodes torchrun started: ``LOCAL_WORLD_SIZE`` ranks on each node, numbered node by
        node (``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``). One node where the variables
        are missing or do not describe that numbering (another launcher, or nodes of different
        sizes, which must be declared: ``ZeroConfig(topology=...)``)."""
        try:
            local = int(environ["LOCAL_WORLD_SIZE"])
            group, rank, local_rank = int(environ["GROUP_RANK"]), int(environ["RANK"]), int(environ["LOCAL_RANK"])
        except (KeyError, ValueError):
            return cls.single(world_size)
        if local < 1 or world_size % local or rank != group * local + local_rank:
            return cls.single(world_size)
        return cls.of_sizes([local] * (world_size // local))

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(n) for n in self.nodes)

    @property
    def spans_nodes(self) -> bool:
        return len(self.nodes) > 1

    def node_of(self, rank: int) -> int:
        for k, node in enumerate(self.nodes):
            if rank in node:
                return k
        raise TopologyError(f"rank {rank} is in no node of topology {self.describe()}")

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def problem(self, world_size: int) -> str | None:
        """Why this topology cannot run on ``world_size`` ranks, or None."""
        if self.world_size != world_size:
            return (f"topology {self.describe()} has {self.world_size} ranks but the world has {world_size}; "
                    "list every rank in exactly one node")
        return None

    def describe(self) -> str:
        """``2 nodes: [0-3] [4-6]``."""
        spans = " ".join(f"[{n[0]}-{n[-1]}]" if len(n) > 1 else f"[{n[0]}]" for n in self.nodes)
        return f"{len(self.nodes)} node{'s' if len(self.nodes) > 1 else ''}: {spans}"

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [list(n) for n in self.nodes]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Topology":
        return cls(nodes=data["nodes"])
