"""Instrumented collectives: every collective the runtime issues goes through ``Communicator``.

Each call is recorded in a ``CommLedger`` (``poplar.comm.ledger``); an async one returns a
``PendingCollective`` or ``PendingChain`` (``poplar.comm.pending``) whose ``wait()`` records the
seconds the rank was blocked, at the position where it was issued. Reductions always use
``ReduceOp.SUM``; the engine scales losses itself (averaging by world size is wrong for uneven
batches).

How the reduce-scatters and all-gathers run is the plan's ``Route`` (``poplar.types.route``):
``configure(route)`` builds its route objects once (``poplar.comm.routes``: one class per way,
each owning its process groups, applying the compression policy), and each such collective is
built by the route object in use and issued here, recorded with the link of each step. They take
per-rank ``sizes`` for parts of different lengths (uneven shards, ``poplar.comm.uneven``).

Built with a ``Topology`` that spans nodes, it creates the node process groups once
(``NodeGroups``), and those of the ranks in the step once per set of ranks a route keeps
(docs/design.md §3.12). Inside ``step_collectives()`` the tensor collectives and object gathers run
on the step's route object (``sizes`` given over the world, a rank left out holding 0 elements);
outside, on the world's: the state collectives.

A ``CollectiveObserver`` (``observed``) hears of every tensor collective when it is issued and
when it is done on this rank, before the rank's blocked seconds are stopped, so what it does
there counts as time in the collective. Object collectives (agreements, profile assembly) are
control traffic and are not observed.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist

from poplar.comm import routes
from poplar.comm.hierarchical import HierarchicalCall, NodeGroups
from poplar.comm.ledger import BlockedTimer, CommLedger
from poplar.comm.pending import CollectiveObserver, PendingChain, PendingCollective, guarded
from poplar.comm.routes import Call, CollectiveRoute, Members, Routes
from poplar.comm.uneven import UnevenCall
from poplar.types.compression import Quantization
from poplar.types.errors import DistributedError
from poplar.types.route import Route
from poplar.types.topology import Link, Topology, TopologyError, Wire

__all__ = ["Communicator", "CollectiveObserver", "PendingChain", "PendingCollective"]


class Communicator:
    """The engine's only door to ``torch.distributed``. With no process group initialised it
    runs as a world of one (every collective is a local copy), so single-process use works."""

    def __init__(self, process_group: Any = None, device: torch.device | None = None,
                 ledger: CommLedger | None = None, topology: Topology | None = None,
                 link: Link = Link.FLAT, world: CollectiveRoute | None = None) -> None:
        """``topology``: the nodes of the ranks; one that spans nodes creates the node groups
        here, a collective over the world (every rank builds its communicator together).
        ``link``: the link this communicator's group runs on (a group of one node's ranks is
        ``Link.INTRA``, one of one rank per node ``Link.CROSS``), for the ledger and the observer.
        ``world``: the route object of a world that is not the process group's (a pretend one)."""
        self._pretend = world  # a pretend world makes no process groups (``_build``)
        self._members = world.members if world is not None else Members.of_group(process_group, link)
        self.group, self.rank, self.wire = self._members.group, self._members.rank, self._members.wire
        self.world_size, self.backend = self._members.size, self._members.backend
        self.device = device or torch.device("cpu")
        self.ledger = ledger or CommLedger()
        self.observer: CollectiveObserver | None = None  # hears of tensor collectives while set (``observed``)
        self.node_groups: NodeGroups | None = None  # a topology that spans nodes: its process groups
        self._chains: deque[PendingChain] = deque()  # hierarchical collectives not issued to their last step
        self._step_groups = routes.StepGroups()  # the groups of each set of step ranks, made once
        self._built: dict[Route, Routes] = {}  # each route's objects, built once (``configure``)
        self._stepping = False  # inside step_collectives()
        self.routes: Routes = self._build(Route())  # flat over the world until its nodes are known
        if topology is not None and (problem := topology.problem(self.world_size)) is not None:
            raise TopologyError(problem)
        if topology is not None and topology.spans_nodes and self.world_size > 1:
            if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
                raise TopologyError("a topology that spans nodes needs the world process group (its node groups are "
                                    "made of global ranks); leave process_group unset")
            # before new_group: a different count would hang
            NodeGroups.check_agreed(self.all_gather_object(topology.nodes, tag="topology"))
            self.node_groups = NodeGroups.create(topology)
        self.configure(Route())

    @property
    def distributed(self) -> bool:
        """Whether a process group is initialised (else a world of one, where nothing leaves this process)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def topology(self) -> Topology:
        """The nodes of this communicator's ranks (one node unless built with a topology that spans nodes)."""
        return self.node_groups.topology if self.node_groups is not None else Topology.single(self.world_size)

    # -- the plan's route (docs/design.md §3.10) --
    def configure(self, route: Route) -> Routes:
        """Run the collectives as ``route`` from now on (every rank together, with the same route,
        between collectives). Its route objects are built once per route and kept; the process
        groups of a set of step ranks once per set, collectively, in one order on every rank."""
        self.settle()
        if route not in self._built:
            self._built[route] = self._build(route)
        self.routes = self._built[route]
        return self.routes

    def _build(self, route: Route) -> Routes:
        """``route``'s objects: the world's, and the step's."""
        ranks = route.ranks_in_step(self.world_size)
        if self._pretend is not None:  # every collective is this rank's copy: no group to make
            return Routes(route, self._pretend, self._pretend)
        world = routes.build(route.collectives, self._members, self.topology, self.node_groups)
        if len(ranks) == self.world_size:
            return Routes(route, world, world)
        members, groups, topology = self._step_groups.of(ranks, self.rank, self.topology)
        step = None if members is None else routes.build(route.collectives, members, topology, groups)
        return Routes(route, world, step)

    @property
    def in_step(self) -> bool:
        """Whether this rank takes part in the training step of the current route."""
        return self.routes.step is not None

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

    def _route(self) -> CollectiveRoute:
        """The route object the next collective runs on: the step's inside ``step_collectives``."""
        return self.routes.current(self._stepping, self.rank)

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

    # -- issuing (poplar.comm.pending, Note: chains of steps, issued in order) --
    def settle(self, upto: PendingChain | None = None) -> None:
        """Issue the remaining steps of the hierarchical collectives in flight, oldest first, up to
        ``upto`` (None: all of them)."""
        if not self._chains or (upto is not None and upto not in self._chains):
            return
        while self._chains:
            chain = self._chains[0]
            chain.issue_rest()
            self._chains.popleft()
            if chain is upto:
                return

    def start_timer(self, issue_only: bool = False) -> BlockedTimer:
        """Times a collective (``issue_only``: an async one's issue) on this rank's clock (Note:
        blocked time on a GPU, in ``comm.ledger``)."""
        return BlockedTimer(self.device, issue_only)

    def _issue(self, op: str, route: CollectiveRoute, call: Call, async_op: bool,
               tag: str) -> PendingCollective | PendingChain | None:
        """``call``, built by the route object ``route``, issued: a chain of steps, or one call on its wire."""
        return self._run_chain(op, call, async_op, tag) if isinstance(call, HierarchicalCall) \
            else self._run(op, route.wire, call, async_op, tag)

    def _run_chain(self, op: str, call: HierarchicalCall, async_op: bool, tag: str) -> PendingChain | None:
        chain = PendingChain(self, op, call, tag)
        self.settle()  # every earlier chain's steps first: one order of every step on every rank
        if call.steps:
            chain.issue_next()
        if async_op:
            if not chain.issued_all:
                self._chains.append(chain)
            return chain
        chain.wait()
        return None

    def _run(self, op: str, wire: Wire, call: UnevenCall, async_op: bool, tag: str) -> PendingCollective | None:
        """One collective on ``wire``'s group; ``call.run`` None: done already, nothing to issue."""
        self.settle()
        timer = self.start_timer(issue_only=async_op)
        observer = self.observer if call.run is not None else None
        ticket = observer.issued(op, call.wire_bytes, wire) if observer is not None else None
        run = call.run
        work = guarded(self.rank, op, tag, lambda: run(async_op)) if run is not None else None
        if async_op:
            return PendingCollective(self, work, op, call.wire_bytes, timer.stop(), tag, observer, ticket, call.finish,
                                     wire.link)
        if call.finish is not None:
            call.finish()
        if observer is not None:
            observer.done(ticket)
        self.ledger.add(op, call.wire_bytes, timer.stop(), tag, wire.link)
        return None

    # -- the collectives --
    def all_reduce(self, tensor: torch.Tensor, tag: str = "", async_op: bool = False) -> PendingCollective | None:
        """Sum ``tensor`` over ranks, in place."""
        route = self._route()
        return self._run("all_reduce", route.wire, route.all_reduce(tensor), async_op, tag)  # one call, never a chain

    def all_reduce_gradients(self, tensor: torch.Tensor, tag: str = "",
                             async_op: bool = False) -> PendingCollective | PendingChain | None:
        """ZeRO-0's gradient sum over ranks, in place: hierarchical where the route crosses nodes
        once per iteration (``routes.OncePerIterationRoute``), else ``all_reduce``."""
        route = self._route()
        return self._issue("all_reduce", route, route.all_reduce_gradients(tensor), async_op, tag)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, tag: str = "",
                       async_op: bool = False, sizes: Sequence[int] | None = None,
                       quantization: Quantization | None = None) -> PendingCollective | PendingChain | None:
        """``output`` (1/N of ``input``, or ``sizes[rank]`` elements: every rank's part, in rank
        order) gets this rank's part of the sum of ``input`` over ranks. ``quantization``: send
        what it quantizes block-quantized (``poplar.comm.quantized``; None: exact)."""
        route = self._route()
        call = route.reduce_scatter(output, input, self.routes.parts(route, sizes), quantization)
        return self._issue("reduce_scatter", route, call, async_op, tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: str = "",
                   async_op: bool = False, sizes: Sequence[int] | None = None,
                   quantization: Quantization | None = None) -> PendingCollective | PendingChain | None:
        """``output`` (N x ``input``, or the ``sizes`` of every rank's part back to back) gets
        every rank's ``input``, in rank order. ``quantization``: send what it quantizes
        block-quantized (``poplar.comm.quantized``; None: exact)."""
        route = self._route()
        call = route.all_gather(output, input, self.routes.parts(route, sizes), quantization)
        return self._issue("all_gather", route, call, async_op, tag)

    # -- node-local secondary shards (ZeRO-3, ``routes.SecondaryShardsRoute``) --
    def secondary_numel(self, sizes: Sequence[int] | None, part_numel: int, element_size: int) -> int:
        """The length of this rank's secondary shard of the step's all-gathers of parts ``sizes``
        (None: every part ``part_numel`` long) of ``element_size`` bytes; 0 where the route keeps
        none (and on a rank left out)."""
        step = self.routes.step
        return 0 if step is None else step.secondary_numel(self.routes.parts(step, sizes), part_numel, element_size)

    def staging_bytes(self, op: str, sizes: Sequence[int] | None, part_numel: int, element_size: int,
                      quantization: Quantization | None = None) -> int:
        """Bytes a hierarchical or quantized ``op`` ("all_gather" / "reduce_scatter") of parts
        ``sizes`` (None: every part ``part_numel`` long) allocates on this rank while it runs; 0
        when flat and exact."""
        route = self._route()
        return route.staging_bytes(op, self.routes.parts(route, sizes), part_numel, element_size, quantization)

    def all_gather_keeping(self, output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor, tag: str = "",
                           async_op: bool = False, sizes: Sequence[int] | None = None,
                           quantization: Quantization | None = None) -> PendingChain | None:
        """``all_gather``, keeping this rank's secondary shard in ``secondary`` (``secondary_numel``
        long) once it is done."""
        route = self._route()
        call = route.all_gather_keeping(output, input, secondary, self.routes.parts(route, sizes), quantization)
        return self._run_chain("all_gather", call, async_op, tag)

    def all_gather_within_nodes(self, output: torch.Tensor, input: torch.Tensor, secondary: torch.Tensor,
                                tag: str = "", async_op: bool = False, sizes: Sequence[int] | None = None,
                                quantization: Quantization | None = None) -> PendingChain | None:
        """The all-gather of ``all_gather_keeping`` again, of the same values, from this rank's part
        and the ``secondary`` shard it kept: inside each node only."""
        route = self._route()
        call = route.all_gather_within_nodes(output, input, secondary, self.routes.parts(route, sizes), quantization)
        return self._run_chain("all_gather", call, async_op, tag)

    # -- node accumulators: across nodes once per iteration (``routes.OncePerIterationRoute``) --
    def accumulator_numel(self, sizes: Sequence[int] | None, part_numel: int) -> int:
        """The length of this rank's node accumulator of the step's reduce-scatters of parts
        ``sizes`` (None: every part ``part_numel`` long); 0 where the route keeps none."""
        step = self.routes.step
        return 0 if step is None else step.accumulator_numel(self.routes.parts(step, sizes), part_numel)

    def reduce_scatter_in_node(self, partials: torch.Tensor, input: torch.Tensor, tag: str = "",
                               async_op: bool = False, sizes: Sequence[int] | None = None) -> PendingChain | None:
        """A reduce-scatter's in-node step alone: ``partials`` (``accumulator_numel`` long) gets
        this rank's node partial sums of ``input``; nothing crosses a node."""
        route = self._route()
        call = route.reduce_scatter_in_node(partials, input, self.routes.parts(route, sizes))
        return self._run_chain("reduce_scatter", call, async_op, tag)

    def exchange_accumulated(self, output: torch.Tensor, acc: torch.Tensor, tag: str = "",
                             async_op: bool = False, sizes: Sequence[int] | None = None) -> PendingChain | None:
        """The exchange of the node partials accumulated in ``acc``: ``output`` (this rank's part)
        has the sum over every rank added to it; ``acc`` is zero once it is done."""
        route = self._route()
        call = route.exchange_accumulated(output, acc, self.routes.parts(route, sizes))
        return self._run_chain("reduce_scatter", call, async_op, tag)

    @property
    def gathers_in_place(self) -> bool:
        """Whether an all-gather's ``input`` may be this rank's own part of ``output`` (a view of
        it): see ``routes.CollectiveRoute.gathers_in_place`` (the world's route)."""
        return self.routes.world.gathers_in_place

    # -- object collectives: control traffic, not observed --
    def all_gather_object(self, obj: Any, tag: str = "") -> list[Any]:
        """Every rank's ``obj``, in rank order; in ``step_collectives`` gathered over the ranks in
        the step, a rank left out's entry None (the list stays indexed by global rank)."""
        route = self._route()
        values: list[Any] = [obj] * route.size
        if not route.alone:
            self.settle()
            timer = self.start_timer()
            guarded(self.rank, "all_gather_object", tag,
                    lambda: dist.all_gather_object(values, obj, group=route.members.group))
            self.ledger.add("all_gather_object", 0, timer.stop(), tag)
        if route is self.routes.world:
            return values
        out: list[Any] = [None] * self.world_size
        for r, value in zip(route.wire.ranks, values):
            out[r] = value
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
