"""Route objects (``poplar.comm.routes``): one class per way, chosen once per route by
``Communicator.configure``, which builds them once and keeps them (a step's process groups once
per set of ranks); on 4 gloo ranks as 2 + 2 nodes, switching routes back and forth."""

from __future__ import annotations

import pytest
import torch

from poplar.comm import Communicator
from poplar.comm.hierarchical import NodeGroups
from poplar.process.launch import spawn
from poplar.comm.routes import (WAYS, FlatRoute, HierarchicalRoute, Members, OneRank, SecondaryShardsRoute,
                                UnevenRoute, build)
from poplar.types.compression import CommPolicy
from poplar.types.route import Collectives, Route, RouteError
from poplar.types.topology import Link, Topology, Wire

TWO_NODES = Topology.of_sizes([2, 2])


def _members(backend: str, size: int = 4) -> Members:
    return Members(None, 0, Wire(Link.FLAT, tuple(range(size))), backend)


def test_each_way_is_one_class_chosen_once() -> None:
    groups = NodeGroups(TWO_NODES, (None, None), (None, None), None, None)
    assert type(build(Collectives.FLAT, _members("nccl"), TWO_NODES, groups)) is FlatRoute
    assert type(build(Collectives.FLAT, _members("gloo"), TWO_NODES, groups)) is UnevenRoute  # gloo: uneven methods
    assert type(build(Collectives.HIERARCHICAL, _members("nccl"), TWO_NODES, groups)) is HierarchicalRoute
    assert type(build(Collectives.SECONDARY_SHARDS, _members("nccl"), TWO_NODES, groups)) is SecondaryShardsRoute
    # on one node every way is flat; one rank alone copies
    assert type(build(Collectives.SECONDARY_SHARDS, _members("nccl"), Topology.single(4), None)) is FlatRoute
    assert type(build(Collectives.HIERARCHICAL, _members("nccl", 1), Topology.single(1), None)) is OneRank
    assert set(WAYS) | {Collectives.FLAT} == set(Collectives)  # every way has its class
    assert build(Collectives.SECONDARY_SHARDS, _members("nccl"), TWO_NODES, groups).keeps_secondary
    assert not build(Collectives.HIERARCHICAL, _members("nccl"), TWO_NODES, groups).keeps_secondary


def test_configure_builds_a_route_once_and_keeps_it() -> None:
    comm = Communicator()
    flat = comm.configure(Route())
    lossy = comm.configure(Route(compression=CommPolicy(gradients="int8")))
    assert comm.configure(Route()) is flat and comm.routes is flat and lossy is not flat
    assert comm.configure(Route(compression=CommPolicy(gradients="int8"))) is lossy
    assert isinstance(flat.world, OneRank) and flat.step is flat.world and comm.in_step
    with pytest.raises(RouteError, match="ranks of the world of 1"):
        comm.configure(Route((0, 1)))
    out, x = torch.zeros(3), torch.arange(3.0)
    comm.reduce_scatter(out, x, tag="one")
    assert torch.equal(out, x) and comm.ledger.records[-1].bytes == 12


def route_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    comm = Communicator(topology=TWO_NODES)
    step = (0, 1, 3)  # rank 2 sits out; the step spans both nodes
    ways = [Route(step, Collectives.HIERARCHICAL), Route(step, Collectives.SECONDARY_SHARDS), Route(),
            Route(step, Collectives.FLAT)]
    built = [comm.configure(r) for r in ways]
    out: dict = {"again": [comm.configure(r) is b for r, b in zip(ways, built)]}
    out["kinds"] = [(type(b.world).__name__, type(b.step).__name__) for b in built]
    if rank != 2:  # one process group of the step's ranks (and node groups), whatever the way
        out["shared"] = (built[0].step.members is built[1].step.members is built[3].step.members,
                         built[0].step.groups is built[1].step.groups)
    sizes = [4, 3, 0, 5]
    sums = []
    for route in ways * 2:  # back and forth: every rank issues on the same groups in one order
        comm.configure(route)
        if not comm.in_step:
            with comm.step_collectives(), pytest.raises(RuntimeError, match="left out of the training step"):
                comm.all_reduce(torch.zeros(1))
            continue
        x = torch.arange(12.0) * (rank + 1)
        part = torch.zeros(sizes[rank] if route.step_ranks else 3)
        with comm.step_collectives():
            comm.reduce_scatter(part, x, sizes=sizes if route.step_ranks else None)
        sums.append(part.tolist())
    out["sums"] = sums
    # the flat way of NCCL (torch's tensor collectives for parts of one length) run on gloo, beside
    # gloo's own: the same values and the same bytes recorded
    members = Members.of_group(None, Link.FLAT)
    flat, uneven = FlatRoute(members, TWO_NODES), UnevenRoute(members, TWO_NODES)
    same = []
    for sizes in (None, [3, 3, 3, 3], [4, 3, 0, 5]):
        got = []
        for route in (flat, uneven):
            part, whole, sent = torch.zeros(3 if sizes is None else sizes[rank]), torch.zeros(12), []
            for build_call in (lambda: route.reduce_scatter(part, torch.arange(12.0) * (rank + 1), sizes, None),
                               lambda: route.all_gather(whole, part + rank, sizes, None)):
                call = build_call()
                call.run(False)
                if call.finish is not None:
                    call.finish()
                sent.append(call.wire_bytes)
            got.append((part.tolist(), whole.tolist(), sent))
        same.append(got[0] == got[1])
    out["flat"] = same
    return out


@pytest.mark.multiprocess
def test_a_route_switched_back_and_forth_keeps_its_groups_and_its_sums() -> None:
    results = spawn(route_worker, 4, timeout_s=120)
    total = torch.arange(12.0) * sum(r + 1 for r in (0, 1, 3))  # the step's ranks
    everyone = torch.arange(12.0) * 10
    for rank, res in enumerate(results):
        assert all(res["again"]) and res["flat"] == [True] * 3, rank
        if rank == 2:
            assert [step for _, step in res["kinds"]] == ["NoneType", "NoneType", "UnevenRoute", "NoneType"]
            assert res["sums"] == [everyone[6:9].tolist()] * 2
            continue
        assert res["kinds"] == [("HierarchicalRoute", "HierarchicalRoute"), ("SecondaryShardsRoute",
                                "SecondaryShardsRoute"), ("UnevenRoute", "UnevenRoute"), ("UnevenRoute", "UnevenRoute")]
        assert res["shared"] == (True, True)
        lo = {0: 0, 1: 4, 3: 7}[rank]
        mine = total[lo:lo + [4, 3, 0, 5][rank]].tolist()
        whole = everyone[3 * rank:3 * rank + 3].tolist()
        assert res["sums"] == [mine, mine, whole, mine] * 2, rank
