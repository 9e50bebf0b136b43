"""Instrumented collectives: every collective the runtime issues goes through ``Communicator``.

Each call is recorded in a ``CommLedger`` (``poplar.comm.ledger``). Collectives are stateless
calls; an async one returns a ``PendingCollective`` whose ``wait()`` records the seconds the
rank was blocked, stamped with the position where it was issued.

Reductions always use ``ReduceOp.SUM``; the engine scales losses itself (averaging by world
size is wrong for uneven batches).

All-gather and reduce-scatter take per-rank ``sizes`` for parts of different lengths (uneven
shards, ``poplar.comm.uneven``); the ledger records the bytes the chosen method sends. On gloo
even parts take the same methods, faster there than torch's tensor collectives.

A ``CollectiveObserver`` (``Communicator.observed``) hears of every tensor collective when it is
issued and when it is done on this rank, before the rank's blocked seconds are stopped, so what
it does there counts as time in the collective (a tracer, or a link model that holds the rank
until the collective would have ended on the interconnect it models). Object collectives
(agreements, profile assembly) are control traffic and are not observed.

Built with a ``Topology`` that spans nodes, the communicator creates the node process groups
once (``poplar.comm.hierarchical.NodeGroups``); while ``use_hierarchy(True)`` its all-gathers and
reduce-scatters run hierarchically: a chain of steps, each recorded with the ``Link`` it used.

Given a ``Quantization`` (``quantization=``), an all-gather or reduce-scatter sends what it
quantizes block-quantized (``poplar.comm.quantized``): hierarchical, the exchange between nodes;
flat on a topology that spans nodes, every byte; on one node nothing (``CROSS_NODE`` is exact
there), except weights at ``EVERY_STEP``. The ledger records the quantized bytes sent.

A plan may leave ranks out of the training step (docs/design.md §3.12): ``set_step_ranks`` makes
the process group of the ranks in the step once per plan, and inside ``step_collectives()`` the
tensor collectives and object gathers run on it (per-rank ``sizes`` are given over the world, as
the shard layout has them; a rank left out holds a part of 0 elements). Outside, every
collective is over the world: the state collectives (checkpoints, re-sharding, full state).

[Note: chains of steps, issued in order]
A hierarchical collective is two steps (in-node, exchange), the second issued only once the first
is done. Its first step is issued with the call and overlaps what the rank does next; its last
step is issued when the collective is waited on or, at the latest, before the rank's next
collective of any kind (``settle``: every chain issued before is brought to its last step,
oldest first). So every rank issues every step of every collective in one order, the order of
the calls, which is the same on every rank: no group sees two orders, an observer hears the same
sequence on every rank of a wire, and a rank never blocks in a collective while a peer waits for
a step it has not issued. The price: a collective's first step (in-node for a reduce-scatter, the
exchange for an all-gather) completes before the next collective is issued; its last step still
overlaps until the next wait. Later steps run on groups of their own (``NodeGroups``), so even a
step issued at a different moment on two ranks meets no other call of its group in between.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist

from poplar.comm import hierarchical, quantized, uneven
from poplar.comm.hierarchical import HierarchicalCall, NodeGroups, Step
from poplar.comm.ledger import Blocked, BlockedTimer, CommLedger
from poplar.process.sigterm_watch import BLOCKED
from poplar.comm.uneven import all_gather_tensor, reduce_scatter_tensor
from poplar.types.compression import Quantization, QuantScope
from poplar.types.errors import DistributedError
from poplar.types.topology import Link, Topology, TopologyError, Wire


class CollectiveObserver(Protocol):
    """What an observer of the tensor collectives implements (the same calls, in the same order,
    on every rank of ``wire.ranks``; a hierarchical collective's steps are heard one by one, in
    one order on every rank: Note: chains of steps, issued in order): ``issued`` before a collective starts, returning a ticket,
    and ``done`` with that ticket once the collective is complete on this rank. ``nbytes`` is
    the same on every rank taking part: the full buffer of a collective, and for a cross-node
    exchange (op ``"exchange"``) the node count times the bytes through the busiest node's port
    (the most any node sends or receives), so a port model that divides it by the nodes prices
    uneven node shares exactly.
    ``wire`` says which link it runs on and which global ranks take part."""

    def issued(self, op: str, nbytes: int, wire: Wire) -> Any:
        ...

    def done(self, ticket: Any) -> None:
        ...


class PendingCollective:
    """An async collective in flight; ``wait()`` blocks until it is done and records the seconds
    blocked (issue time included) at the position where it was issued."""

    def __init__(self, comm: "Communicator", work: Any, op: str, nbytes: int, issue: Blocked, tag: str,
                 observer: CollectiveObserver | None = None, ticket: Any = None,
                 finish: Callable[[], None] | None = None) -> None:
        self.comm, self.work, self.op, self.nbytes, self.issue, self.tag = comm, work, op, nbytes, issue, tag
        self.observer, self.ticket = observer, ticket  # who heard it issued, and its ticket there
        self.finish = finish  # what completes it once torch's work is done (an uneven call's copy-out)
        self.position = comm.ledger.position

    def wait(self) -> None:
        timer = self.comm.start_timer()
        if self.work is not None:
            self.comm.guard(self.op, self.tag, self.work.wait)
        if self.finish is not None:
            self.finish()
            self.finish = None
        if self.observer is not None:  # the observer that heard it issued, even if its block has ended
            self.observer.done(self.ticket)
            self.observer = None
        blocked = self.issue.plus(timer.stop())
        with self.comm.ledger.at(self.position):
            self.comm.ledger.add(self.op, self.nbytes, blocked, self.tag, self.comm.wire.link)


class PendingChain:
    """A hierarchical collective in flight (Note: chains of steps, issued in order): its current
    step and the steps still to issue. ``wait()`` issues and completes what is left; each step is
    recorded when done, with its link, at the position where the collective was issued."""

    def __init__(self, comm: "Communicator", op: str, call: HierarchicalCall, tag: str) -> None:
        self.comm, self.op, self.call, self.tag = comm, op, call, tag
        self.position = comm.ledger.position
        self.next = 0  # call.steps[:next] have been issued
        self.current: tuple[Step, Any, CollectiveObserver | None, Any, Blocked] | None = None

    @property
    def issued_all(self) -> bool:
        return self.next == len(self.call.steps)

    def issue_next(self) -> None:
        step = self.call.steps[self.next]
        self.next += 1
        timer = self.comm.start_timer(issue_only=True)
        observer = self.comm.observer if step.wire is not None else None
        ticket = observer.issued(step.op, step.observed_bytes, step.wire) if observer is not None else None
        work = self.comm.guard(self.op, self.tag, lambda: step.run(True))
        self.current = (step, work, observer, ticket, timer.stop())

    def complete_current(self) -> None:
        if self.current is None:
            return
        (step, work, observer, ticket, issue), self.current = self.current, None
        timer = self.comm.start_timer()
        if work is not None:
            self.comm.guard(self.op, self.tag, work.wait)
        if step.finish is not None:
            step.finish()
        if observer is not None:
            observer.done(ticket)
        blocked = issue.plus(timer.stop())
        if step.wire is not None:
            with self.comm.ledger.at(self.position):
                self.comm.ledger.add(self.op, step.sent_bytes, blocked, self.tag, step.link)

    def issue_rest(self) -> None:
        """Complete each step and issue the next, until the last is issued."""
        while not self.issued_all:
            self.complete_current()
            self.issue_next()

    def wait(self) -> None:
        self.comm.settle(upto=self)  # the chains issued before first, then this one's own steps
        self.issue_rest()
        self.complete_current()
        if self.call.finish is not None:
            self.call.finish()
            self.call = HierarchicalCall(self.call.steps, None)


class StepGroup(NamedTuple):
    """The ranks in the training step and, on a rank among them, the communicator of their group."""

    ranks: tuple[int, ...]
    comm: "Communicator | None"


class Communicator:
    """The engine's only door to ``torch.distributed``. With no process group initialised it
    runs as a world of one (every collective is a local copy), so single-process use works."""

    observer: CollectiveObserver | None = None  # hears of tensor collectives while set (``observed``)
    node_groups: NodeGroups | None = None  # a topology that spans nodes: its process groups
    hierarchical: bool = False  # all-gathers and reduce-scatters run on node_groups (``use_hierarchy``)
    _chains: "deque[PendingChain] | None" = None  # hierarchical collectives not issued to their last step
    step_group: "StepGroup | None" = None  # the ranks in the step, when a plan leaves some out
    _step_groups: "dict[tuple[int, ...], StepGroup] | None" = None  # made once per set of ranks (new_group)
    _stepping = False  # inside step_collectives()

    def __init__(self, process_group: Any = None, device: torch.device | None = None,
                 ledger: CommLedger | None = None, topology: Topology | None = None,
                 link: Link = Link.FLAT) -> None:
        """``topology``: the nodes of the ranks; one that spans nodes creates the node groups
        here, a collective over the world (every rank builds its communicator together).
        ``link``: the link this communicator's group runs on (a group of one node's ranks is
        ``Link.INTRA``, one of one rank per node ``Link.CROSS``), for the ledger and the observer."""
        self.distributed = dist.is_available() and dist.is_initialized()
        # None means torch's default group, looked up at each call: holding the group object here
        # would keep it (and gloo's threads) alive past destroy_process_group(), to be torn down
        # during interpreter shutdown, where a gloo thread can abort the process
        self.group = process_group
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.device = device or torch.device("cpu")
        self.ledger = ledger or CommLedger()
        self.backend = dist.get_backend(self.group) if self.distributed else "none"
        # what an observer hears a flat collective run on: the group's GLOBAL ranks (a sub-group's
        # own ranks 0..n-1 would name other ranks of the world) and the link it was built for
        members = tuple(dist.get_process_group_ranks(self.group)) if self.distributed and process_group is not None \
            else tuple(range(self.world_size))
        self.wire = Wire(link, members)
        self._chains = deque()
        self._step_groups = {}
        if topology is not None and (problem := topology.problem(self.world_size)) is not None:
            raise TopologyError(problem)
        if topology is not None and topology.spans_nodes and self.world_size > 1:
            if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
                raise TopologyError("a topology that spans nodes needs the world process group (its node groups are "
                                    "made of global ranks); leave process_group unset")
            nodes = self.all_gather_object(topology.nodes, tag="topology")
            if any(n != nodes[0] for n in nodes):  # before new_group: a different count would hang
                lines = "\n".join(f"  rank {r}: {n!r}" for r, n in enumerate(nodes))
                raise TopologyError(f"ranks were given different topologies; give every rank the same:\n{lines}")
            self.node_groups = NodeGroups.create(topology)

    @property
    def topology(self) -> Topology:
        """The nodes of this communicator's ranks (one node unless built with a topology that spans nodes)."""
        return self.node_groups.topology if self.node_groups is not None else Topology.single(self.world_size)

    def use_hierarchy(self, on: bool) -> None:
        """Run all-gathers and reduce-scatters hierarchically (True) or flat from now on; with no
        topology spanning nodes they stay flat. Every rank switches together, between collectives."""
        self.settle()
        self.hierarchical = bool(on) and self.node_groups is not None
        if self.step_group is not None and self.step_group.comm is not None:
            self.step_group.comm.use_hierarchy(on)  # its own node groups (one node: flat)

    def settle(self, upto: PendingChain | None = None) -> None:
        """Issue the remaining steps of the hierarchical collectives in flight, oldest first, up to
        ``upto`` (None: all of them). Note: chains of steps, issued in order."""
        if not self._chains or (upto is not None and upto not in self._chains):
            return
        while self._chains:
            chain = self._chains[0]
            chain.issue_rest()
            self._chains.popleft()
            if chain is upto:
                return

    def _run_chain(self, op: str, call: HierarchicalCall, async_op: bool, tag: str) -> PendingChain | None:
        chain = PendingChain(self, op, call, tag)
        self.settle()  # every earlier chain's steps first: one order of every step on every rank
        if call.steps:
            chain.issue_next()
        if async_op:
            if not chain.issued_all and self._chains is not None:
                self._chains.append(chain)
            return chain
        chain.wait()
        return None

    # -- the ranks in the step (a plan that leaves ranks out; docs/design.md §3.12) --
    def set_step_ranks(self, ranks: Sequence[int]) -> None:
        """From now on ``step_collectives()`` runs on the group of ``ranks`` (every rank calls this
        together, with the same ranks: a new group is a collective over the world; each set of
        ranks gets its group once and keeps it). All the ranks: the world's collectives."""
        ranks = tuple(sorted(ranks))
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.world_size:
            raise ValueError(f"step ranks must be ranks of the world of {self.world_size}, got {ranks}")
        if len(ranks) == self.world_size:
            self.step_group = None
            return
        if self._step_groups is None:
            self._step_groups = {}
        if ranks not in self._step_groups:
            group = dist.new_group(list(ranks))
            # the step's own node groups, where its ranks span nodes (every rank creates them)
            nodes = [sum(1 for r in node if r in ranks) for node in self.topology.nodes]
            sizes = [n for n in nodes if n]
            node_groups = NodeGroups.create(Topology.of_sizes(sizes), ranks) if len(sizes) > 1 else None
            comm = None
            if self.rank in ranks:
                comm = Communicator(group, self.device, self.ledger)
                comm.node_groups = node_groups  # its wire is its group's global ranks (__init__)
            self._step_groups[ranks] = StepGroup(ranks, comm)
        self.step_group = self._step_groups[ranks]
        if self.step_group.comm is not None:
            self.step_group.comm.use_hierarchy(self.hierarchical)

    @property
    def steps_hierarchically(self) -> bool:
        """Whether this rank's step collectives run hierarchically (with ranks left out: the
        step's own node groups, when its ranks span nodes; a rank left out runs none)."""
        if self.step_group is None:
            return self.hierarchical
        return self.step_group.comm is not None and self.step_group.comm.hierarchical

    @property
    def in_step(self) -> bool:
        """Whether this rank takes part in the training step of the current step ranks."""
        return self.step_group is None or self.rank in self.step_group.ranks

    def step_collectives(self) -> ContextManager["Communicator"]:
        """Until the block ends, collectives run over the ranks in the step. A rank left out
        issuing one is a bug: it would wait for peers that never come, so it raises at once."""
        return self._stepping_as(True)

    def world_collectives(self) -> ContextManager["Communicator"]:
        """Until the block ends, collectives run over the world, also inside ``step_collectives``:
        the iteration's agreements that a rank left out joins too (its status reduction and what
        follows a failed one), so that every rank reaches the same verdict (docs/design.md §3.12)."""
        return self._stepping_as(False)

    @contextlib.contextmanager
    def _stepping_as(self, stepping: bool) -> Iterator["Communicator"]:
        outer, self._stepping = self._stepping, stepping
        try:
            yield self
        finally:
            self._stepping = outer

    def _step_comm(self) -> "Communicator | None":
        if not self._stepping or self.step_group is None:
            return None
        step = self.step_group.comm
        if step is None:
            raise RuntimeError(f"rank {self.rank} is left out of the training step (the plan gives it no samples and "
                               "no shard) but issued a step collective; a rank left out runs no step")
        # the step's communicator is this one's own: whoever observes this one hears its collectives
        step.observer = self.observer
        return step

    def _step_sizes(self, sizes: Sequence[int] | None) -> list[int]:
        assert self.step_group is not None
        if sizes is None or len(sizes) != self.world_size:
            raise RuntimeError("a collective over the ranks in the step needs every world rank's part size")
        if any(sizes[r] for r in range(self.world_size) if r not in self.step_group.ranks):
            raise RuntimeError("a rank left out of the step holds a part of a step collective; its shard weight must be 0")
        return [sizes[r] for r in self.step_group.ranks]

    @contextlib.contextmanager
    def observed(self, observer: CollectiveObserver | None) -> Iterator["Communicator"]:
        """Until the block ends, ``observer`` hears of every tensor collective (None: nothing
        changes). One observer at a time: a second, different one is an error."""
        if observer is None:
            yield self
            return
        if self.observer is not None and self.observer is not observer:
            raise RuntimeError("this communicator already has a collective observer")
        outer, self.observer = self.observer, observer
        try:
            yield self
        finally:
            self.observer = outer

    def start_timer(self, issue_only: bool = False) -> BlockedTimer:
        """Times a collective (``issue_only``: an async one's issue) on this rank's clock (Note:
        blocked time on a GPU, in ``comm.ledger``)."""
        return BlockedTimer(self.device, issue_only)

    def _run(self, op: str, nbytes: int, fn: Any, async_op: bool, tag: str,
             finish: Callable[[], None] | None = None) -> PendingCollective | None:
        self.settle()
        timer = self.start_timer(issue_only=async_op)
        observer = self.observer if self.world_size > 1 else None
        ticket = observer.issued(op, nbytes, self.wire) if observer is not None else None
        work = self.guard(op, tag, lambda: fn(async_op)) if self.world_size > 1 else None
        if async_op:
            return PendingCollective(self, work, op, nbytes, timer.stop(), tag, observer, ticket, finish)
        if finish is not None:
            finish()
        if observer is not None:
            observer.done(ticket)
        self.ledger.add(op, nbytes, timer.stop(), tag, self.wire.link)
        return None

    def guard(self, op: str, tag: str, fn: Any) -> Any:
        """Run a collective; a peer that died or timed out becomes a clear error on this rank.
        While it runs, ``BLOCKED`` says so (``poplar.process.sigterm_watch``)."""
        BLOCKED.enter(f"{op} ({tag or 'untagged'})")
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as e:
            if isinstance(e, DistributedError):
                raise
            raise DistributedError(
                f"rank {self.rank}: collective {op} ({tag or 'untagged'}) failed — another rank probably died, "
                f"raised outside a collective, or timed out ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
            ) from e
        finally:
            BLOCKED.leave()

    def all_reduce(self, tensor: torch.Tensor, tag: str = "", async_op: bool = False) -> PendingCollective | None:
        """Sum ``tensor`` over ranks, in place."""
        if (step := self._step_comm()) is not None:
            return step.all_reduce(tensor, tag, async_op)
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_reduce", nbytes,
                         lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=a),
                         async_op, tag)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, tag: str = "",
                       async_op: bool = False, sizes: Sequence[int] | None = None,
                       quantization: Quantization | None = None) -> PendingCollective | PendingChain | None:
        """``output`` (1/N of ``input``, or ``sizes[rank]`` elements: every rank's part, in rank
        order) gets this rank's part of the sum of ``input`` over ranks. ``quantization``: send
        what it quantizes block-quantized (``poplar.comm.quantized``; None: exact)."""
        if (step := self._step_comm()) is not None:
            return step.reduce_scatter(output, input, tag, async_op, self._step_sizes(sizes), quantization)
        q = self.quantized(quantization)
        if self.world_size == 1:
            output.copy_(input)
        elif self.hierarchical and (q is None or q.scope is QuantScope.CROSS_NODE):
            parts, method = self._sizes(sizes, output.numel()), uneven.method_for(self.backend, "reduce_scatter")
            call = hierarchical.reduce_scatter(output, input, parts, self.rank, self._groups, method) if q is None \
                else quantized.hierarchical_reduce_scatter(output, input, parts, self.rank, self._groups, method, q)
            return self._run_chain("reduce_scatter", call, async_op, tag)
        elif q is not None:
            flat = quantized.reduce_scatter(output, input, self._sizes(sizes, output.numel()), self.rank, self.group, q)
            return self._run("reduce_scatter", flat.wire_bytes, flat.run, async_op, tag, flat.finish)
        elif (sizes is not None and len(set(sizes)) > 1) or uneven.even_method(self.backend, "reduce_scatter"):
            sizes = sizes or [output.numel()] * self.world_size
            call = uneven.reduce_scatter(output, input, sizes, self.rank, self.group,
                                         uneven.method_for(self.backend, "reduce_scatter"))
            return self._run("reduce_scatter", call.wire_bytes, call.run, async_op, tag, call.finish)
        nbytes = input.numel() * input.element_size()
        return self._run("reduce_scatter", nbytes,
                         lambda a: reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM,
                                                              group=self.group, async_op=a),
                         async_op, tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: str = "",
                   async_op: bool = False, sizes: Sequence[int] | None = None,
                   quantization: Quantization | None = None) -> PendingCollective | PendingChain | None:
        """``output`` (N x ``input``, or the ``sizes`` of every rank's part back to back) gets
        every rank's ``input``, in rank order. ``quantization``: send what it quantizes
        block-quantized (``poplar.comm.quantized``; None: exact)."""
        if (step := self._step_comm()) is not None:
            return step.all_gather(output, input, tag, async_op, self._step_sizes(sizes), quantization)
        q = self.quantized(quantization)
        method = uneven.method_for(self.backend, "all_gather")
        if self.world_size == 1:
            output.copy_(input)
        elif self.hierarchical and (q is None or q.scope is QuantScope.CROSS_NODE):
            parts = self._sizes(sizes, input.numel())
            call = hierarchical.all_gather(output, input, parts, self.rank, self._groups, method) if q is None \
                else quantized.hierarchical_all_gather(output, input, parts, self.rank, self._groups, method, q)
            return self._run_chain("all_gather", call, async_op, tag)
        elif q is not None:
            parts = self._sizes(sizes, input.numel())
            flat = quantized.all_gather(output, input, parts, self.rank, self.group, method, q)
            return self._run("all_gather", flat.wire_bytes, flat.run, async_op, tag, flat.finish)
        elif (sizes is not None and len(set(sizes)) > 1) or uneven.even_method(self.backend, "all_gather"):
            sizes = sizes or [input.numel()] * self.world_size
            call = uneven.all_gather(output, input, sizes, self.rank, self.group, method)
            return self._run("all_gather", call.wire_bytes, call.run, async_op, tag, call.finish)
        nbytes = output.numel() * output.element_size()
        return self._run("all_gather", nbytes,
                         lambda a: all_gather_tensor(output, input, group=self.group, async_op=a),
                         async_op, tag)

    # -- node-local secondary shards (ZeRO-3, hierarchical only; poplar.comm.hierarchical) --
    def secondary_numel(self, sizes: Sequence[int] | None, part_numel: int, element_size: int) -> int:
        """The length of this rank's secondary shard of an all-gather of parts ``sizes`` (None:
        every part ``part_numel`` long) of ``element_size`` bytes; 0 unless hierarchical. With ranks
        left out of the step: the shard of the step's gathers (0 on a rank left out)."""
        if self.step_group is not None:
            step = self.step_group.comm
            return 0 if step is None else step.secondary_numel(self._step_sizes(sizes), part_numel, element_size)
        if not self.hierarchical:
            return 0
        layout = hierarchical.node_layout(tuple(self._sizes(sizes, part_numel)), self._groups.topology, element_size)
        return layout.secondary_numel(self._groups.topology, self.rank)

    def staging_bytes(self, op: str, sizes: Sequence[int] | None, part_numel: int, element_size: int,
                      quantization: Quantization | None = None) -> int:
        """Bytes a hierarchical or quantized ``op`` ("all_gather" / "reduce_scatter") of parts
        ``sizes`` (None: every part ``part_numel`` long) allocates on this rank while it runs; 0
        when flat and exact."""
        if (step := self._step_comm()) is not None:
            return step.staging_bytes(op, self._step_sizes(sizes), part_numel, element_size, quantization)
        q = self.quantized(quantization)
        extra = 0 if q is None else quantized.staging_bytes(op, self._sizes(sizes, part_numel), self.rank, q)
        if not self.hierarchical:
            return extra
        topology = self._groups.topology
        layout = hierarchical.node_layout(tuple(self._sizes(sizes, part_numel)), topology, element_size)
        in_place = uneven.method_for(self.backend, "all_gather") is uneven.UnevenMethod.BROADCASTS
        return hierarchical.staging_numel(op, layout, topology, self.rank, in_place) * element_size + extra

    def all_gather_keeping(self, output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor, tag: str = "",
                           async_op: bool = False, sizes: Sequence[int] | None = None,
                           quantization: Quantization | None = None) -> PendingChain | None:
        """``all_gather`` (hierarchical), keeping this rank's secondary shard in ``secondary``
        (``secondary_numel`` long) once it is done; quantized, the shard holds the values as
        dequantized (``poplar.comm.quantized``)."""
        if (step := self._step_comm()) is not None:
            return step.all_gather_keeping(output, input, secondary, tag, async_op, self._step_sizes(sizes),
                                           quantization)
        sizes, method = self._sizes(sizes, input.numel()), uneven.method_for(self.backend, "all_gather")
        q = self.quantized(quantization)
        if q is None:
            call = hierarchical.all_gather(output, input, sizes, self.rank, self._groups, method, keep=secondary)
        elif q.scope is QuantScope.CROSS_NODE:
            call = quantized.hierarchical_all_gather(output, input, sizes, self.rank, self._groups, method, q,
                                                     keep=secondary)
        else:
            call = quantized.flat_all_gather_keeping(output, input, sizes, self.rank, self._groups,
                                                     (self.group, self.wire), method, q, secondary)
        return self._run_chain("all_gather", call, async_op, tag)

    def all_gather_within_nodes(self, output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor,
                                tag: str = "", async_op: bool = False, sizes: Sequence[int] | None = None,
                                quantization: Quantization | None = None) -> PendingChain | None:
        """The all-gather of ``all_gather_keeping`` again, of the same values, from this rank's part
        and the ``secondary`` shard it kept: inside each node only. ``quantization``: the one that
        gather used (only ``EVERY_STEP`` quantizes here: the node's own parts, as it did)."""
        if (step := self._step_comm()) is not None:
            return step.all_gather_within_nodes(output, input, secondary, tag, async_op, self._step_sizes(sizes),
                                                quantization)
        sizes, method = self._sizes(sizes, input.numel()), uneven.method_for(self.backend, "all_gather")
        q = self.quantized(quantization)
        if q is not None and q.scope is QuantScope.EVERY_STEP:
            call = quantized.all_gather_within_every_step(output, input, secondary, sizes, self.rank, self._groups,
                                                          method, q)
        else:
            call = hierarchical.all_gather_within(output, input, secondary, sizes, self.rank, self._groups, method)
        return self._run_chain("all_gather", call, async_op, tag)

    def quantized(self, quantization: Quantization | None) -> Quantization | None:
        """What a collective given ``quantization`` quantizes here: None (exact) on a world of one,
        and for ``CROSS_NODE`` on a topology of one node, where nothing crosses."""
        if quantization is None or self.world_size == 1:
            return None
        if quantization.scope is QuantScope.CROSS_NODE and self.node_groups is None:
            return None
        return quantization

    @property
    def _groups(self) -> NodeGroups:
        if self.node_groups is None or not self.hierarchical:
            raise RuntimeError("hierarchical collectives need a communicator built with a topology that spans nodes, "
                               "with use_hierarchy(True)")
        return self.node_groups

    def _sizes(self, sizes: Sequence[int] | None, part_numel: int) -> list[int]:
        return list(sizes) if sizes is not None else [part_numel] * self.world_size

    @property
    def gathers_in_place(self) -> bool:
        """Whether an all-gather's ``input`` may be this rank's own part of ``output`` (a view of
        it): a world of one, and gloo, whose all-gather is one broadcast per part into ``output``
        (``uneven.even_method``). Elsewhere the input must be a separate tensor."""
        return self.world_size == 1 or uneven.even_method(self.backend, "all_gather") is uneven.UnevenMethod.BROADCASTS

    def all_gather_object(self, obj: Any, tag: str = "") -> list[Any]:
        """Every rank's ``obj``, in rank order; in ``step_collectives`` gathered over the ranks in
        the step, a rank left out's entry None (the list stays indexed by global rank)."""
        if (step := self._step_comm()) is not None:
            assert self.step_group is not None
            out: list[Any] = [None] * self.world_size
            for r, value in zip(self.step_group.ranks, step.all_gather_object(obj, tag)):
                out[r] = value
            return out
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self.settle()
        timer = self.start_timer()
        self.guard("all_gather_object", tag, lambda: dist.all_gather_object(out, obj, group=self.group))
        self.ledger.add("all_gather_object", 0, timer.stop(), tag)
        return out

    def agree(self, error: str | None, what: str, value: Any = None, *, mismatch: str | None = None,
              error_type: type[Exception] = DistributedError) -> list[Any]:
        """The one agreement point: every rank says whether it is fine (``error`` None) and may
        add a ``value``. Returns every rank's ``value``; otherwise ``error_type`` on every rank,
        naming each failing rank and its reason, or (given ``mismatch``, the fix to name) when
        the values differ between ranks. A peer that died or timed out is an ``error_type``
        too, naming ``what``. No rank is left waiting in a later collective."""
        try:
            verdicts = self.all_gather_object((error, value), tag=what)
        except DistributedError as e:
            if error_type is DistributedError:
                raise
            raise error_type(f"{what}: {e}") from e
        lines = [f"  rank {r}: {e}" for r, (e, _) in enumerate(verdicts) if e is not None]
        if lines:
            raise error_type(f"{what} failed on {len(lines)} of {self.world_size} ranks:\n" + "\n".join(lines))
        values = [v for _, v in verdicts]
        if mismatch is not None and len(set(values)) > 1:
            raise error_type(f"{what} failed: {mismatch}")
        return values
