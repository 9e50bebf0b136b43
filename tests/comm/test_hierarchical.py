"""Hierarchical reduce-scatter and all-gather (``poplar.comm.hierarchical``) on 4 gloo ranks as two
nodes (2 + 2 and 3 + 1): the same values as the flat collectives on the same inputs (uneven parts,
an empty part, fp32 and bf16, sync and async, several in flight at once), each ledger record
tagged with its link, a node's cross-node bytes (1 - its own share) of the buffer, and the
secondary-shard gather that stays inside the node; across nodes once per iteration, in-node steps
into a node accumulator and one exchange, and ZeRO-0's hierarchical all-reduce, equal the flat
sums. The layouts themselves without processes."""

from __future__ import annotations

import pytest
import torch

from poplar.comm import Communicator, hierarchical
from poplar.comm.hierarchical import node_layout, pieces, staging_numel
from poplar.comm.uneven import UnevenMethod
from poplar.process.launch import RankFailure, spawn
from poplar.types.route import Collectives, Route
from poplar.types.topology import Link, Topology, Wire

TOPOLOGIES = {"2+2": Topology.of_sizes([2, 2]), "3+1": Topology.of_sizes([3, 1])}
SIZES = [(40, 12, 0, 28), (9, 9, 9, 9), (0, 17, 33, 6)]  # parts per rank: uneven, one empty; even; odd


class Recorder:
    """A collective observer that keeps what it heard."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, int, Wire]] = []

    def issued(self, op: str, nbytes: int, wire: Wire) -> int:
        self.heard.append((op, nbytes, wire))
        return len(self.heard)

    def done(self, ticket: int) -> None:
        pass


def _input(rank: int, total: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers: every sum is exact in bf16 too, so flat and hierarchical must agree bit for bit."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-8, 9, (total,), generator=g).to(dtype)


def _floats(rank: int, total: int) -> torch.Tensor:
    return torch.randn(total, generator=torch.Generator().manual_seed(10 + rank))


def _run(comm: Communicator, sizes: tuple[int, ...], rank: int, dtype: torch.dtype, asynchronous: bool) -> dict:
    total, out = sum(sizes), {}
    for name, x in (("int", _input(rank, total, dtype)), ("float", _floats(rank, total).to(dtype))):
        parts = [torch.zeros(sizes[rank], dtype=dtype) for _ in range(3)]
        works = [comm.reduce_scatter(p, x * (i + 1), tag=f"rs{i}", async_op=asynchronous, sizes=sizes)
                 for i, p in enumerate(parts)]  # three in flight at once
        _wait(works)
        gathered = [torch.zeros(total, dtype=dtype) for _ in range(2)]
        _wait([comm.all_gather(g, parts[i] + i, tag=f"ag{i}", async_op=asynchronous, sizes=sizes)
               for i, g in enumerate(gathered)])
        out[name] = (parts, gathered)
    return out


def _wait(works: list) -> None:
    for w in works:
        if w is not None:
            w.wait()


def collective_worker(rank: int, world: int, topology: Topology) -> dict:
    torch.set_num_threads(1)
    comm = Communicator(topology=topology)
    recorder = Recorder()
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        for sizes in SIZES:
            for asynchronous in (False, True):
                comm.configure(Route())
                flat = _run(comm, sizes, rank, dtype, asynchronous)
                comm.configure(Route(collectives=Collectives.HIERARCHICAL))
                comm.ledger.clear()
                with comm.observed(recorder):
                    hier = _run(comm, sizes, rank, dtype, asynchronous)
                records = [(r.op, r.bytes, r.link, r.tag) for r in comm.ledger.records]
                out[(str(dtype), sizes, asynchronous)] = (flat, hier, records)
    # the secondary shard kept by a gather, and the gather from it that stays in the node
    comm.configure(Route(collectives=Collectives.SECONDARY_SHARDS))
    sizes = SIZES[0]
    part = _floats(rank, sizes[rank])
    keep = torch.zeros(comm.secondary_numel(sizes, 0, 4))
    full, again = torch.zeros(sum(sizes)), torch.zeros(sum(sizes))
    comm.all_gather_keeping(full, part, keep, async_op=True, sizes=sizes).wait()
    comm.ledger.clear()
    comm.all_gather_within_nodes(again, part, keep, tag="within", async_op=True, sizes=sizes).wait()
    out["secondary"] = (full, again, keep.numel(), [(r.op, r.link) for r in comm.ledger.records])
    # ranks that wait in different orders still issue every step in one order (and get the sums)
    total, x = sum(sizes), _input(rank, sum(sizes), torch.float32)
    parts, full = [torch.zeros(sizes[rank]) for _ in range(2)], torch.zeros(total)
    with comm.observed(recorder):
        first = comm.reduce_scatter(parts[0], x, tag="order", async_op=True, sizes=sizes)
        if rank % 2:  # these ranks wait before the next call, the others after the last
            first.wait()
        works = [first, comm.all_gather(full, part, tag="order", async_op=True, sizes=sizes),
                 comm.reduce_scatter(parts[1], 2 * x, tag="order", async_op=True, sizes=sizes)]
        _wait(works[::-1])
    out["order"] = (parts, full)
    out["heard"] = recorder.heard
    return out


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.multiprocess
def test_hierarchical_collectives_equal_flat(name: str) -> None:
    topology = TOPOLOGIES[name]
    results = spawn(collective_worker, 4, (topology,), timeout_s=120)
    for key in results[0]:
        if key in ("secondary", "heard", "order"):
            continue
        dtype, sizes, _ = key
        for rank, res in enumerate(results):
            flat, hier, records = res[key]
            for (fp, fg), (hp, hg) in ((flat["int"], hier["int"]),):
                assert all(torch.equal(a, b) for a, b in zip(fp + fg, hp + hg)), (name, key, rank)
            (fp, fg), (hp, hg) = flat["float"], hier["float"]
            # summation order only: a few ulps of the sums (bf16 sums are rounded at every add)
            tol = 1e-6 if dtype == "torch.float32" else 3e-2
            for a, b in zip(fp + fg, hp + hg):
                torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol * 8)
            assert {link for *_, link, _ in records} <= {Link.INTRA, Link.CROSS}, records
    summed = sum(_input(r, sum(SIZES[0]), torch.float32) for r in range(4))
    lo = [sum(SIZES[0][:r]) for r in range(4)]
    for rank, res in enumerate(results):
        parts, full = res["order"]
        mine = summed[lo[rank]:lo[rank] + SIZES[0][rank]]
        assert torch.equal(parts[0], mine) and torch.equal(parts[1], 2 * mine), rank
        assert torch.equal(full, results[0]["secondary"][0]), rank
    _check_cross_bytes(results, topology)
    _check_secondary(results, topology)
    _check_observer(results, topology)


def method_worker(rank: int, world: int, topology: Topology, cases: list) -> list:
    """``hierarchical.all_gather`` / ``reduce_scatter`` with each uneven method, steps issued one
    by one as the communicator issues them (the backend picks one method; this runs them all)."""
    torch.set_num_threads(1)
    groups = Communicator(topology=topology).node_groups
    out = []
    for sizes, method in cases:
        gathered, reduced = torch.zeros(sum(sizes)), torch.zeros(sizes[rank])
        for call in (hierarchical.all_gather(gathered, _floats(rank, sizes[rank]), sizes, rank, groups, method),
                     hierarchical.reduce_scatter(reduced, _input(rank, sum(sizes), torch.float32), sizes, rank,
                                                 groups, method)):
            for step in call.steps:
                work = step.run(True)
                if work is not None:
                    work.wait()
                if step.finish is not None:
                    step.finish()
            if call.finish is not None:
                call.finish()
        out.append((gathered, reduced))
    return out


@pytest.mark.multiprocess
def test_each_uneven_method_reads_what_the_exchange_wrote() -> None:
    """The in-node gather after the exchange reads the pieces the exchange received: with a method
    that copies its input (LISTED, NCCL's; PADDED) that copy is taken when the step is issued.
    gloo lists only equal parts, so LISTED runs on even ones."""
    cases = [((8, 8, 8, 8), UnevenMethod.LISTED), ((40, 12, 0, 28), UnevenMethod.PADDED),
             ((40, 12, 0, 28), UnevenMethod.BROADCASTS)]
    results = spawn(method_worker, 4, (TOPOLOGIES["2+2"], cases), timeout_s=120)
    for i, (sizes, method) in enumerate(cases):
        truth = torch.cat([_floats(r, sizes[r]) for r in range(4)])
        summed = sum(_input(r, sum(sizes), torch.float32) for r in range(4))
        lo = [sum(sizes[:r]) for r in range(4)]
        for rank, res in enumerate(results):
            gathered, reduced = res[i]
            assert torch.equal(gathered, truth), (method, rank)
            assert torch.equal(reduced, summed[lo[rank]:lo[rank] + sizes[rank]]), (method, rank)


def _check_cross_bytes(results: list[dict], topology: Topology) -> None:
    """A node sends (1 - its own share) of the buffer across at the reduce-scatter's exchange, and
    receives (1 - its own share) at the all-gather's (two nodes: what the other node sends)."""
    for key in results[0]:
        if key in ("secondary", "heard", "order"):
            continue
        dtype, sizes, _ = key
        element = 4 if dtype == "torch.float32" else 2
        buffer = sum(sizes) * element
        for k, node in enumerate(topology.nodes):
            own = sum(sizes[r] for r in node) * element
            other = topology.nodes[1 - k]
            for op, sender in (("rs0", node), ("ag0", other)):
                crossed = sum(b for r in sender for (_, b, link, tag) in results[r][key][2]
                              if link is Link.CROSS and tag == op) // 2  # the int and the float rounds
                assert crossed == pytest.approx(buffer - own, rel=0.05), (key, k, op)
                assert crossed == buffer - own, (key, k, op)


def _check_secondary(results: list[dict], topology: Topology) -> None:
    sizes = SIZES[0]
    for rank, res in enumerate(results):
        full, again, kept, records = res["secondary"]
        assert torch.equal(full, again), rank
        assert all(link is Link.INTRA for _, link in records), records  # nothing crosses a node
        node = topology.nodes[topology.node_of(rank)]
        foreign = sum(sizes) - sum(sizes[r] for r in node)
        assert abs(kept - foreign / len(node)) <= 8, (rank, kept)  # its piece of every other region
    reference = torch.cat([_floats(r, s) for r, s in enumerate(sizes)])
    assert torch.equal(results[0]["secondary"][0], reference)


def _check_observer(results: list[dict], topology: Topology) -> None:
    """Every rank hears the exchange with the same bytes (all nodes summed) on a wire of every
    rank; an in-node step on its node's ranks."""
    heard = [res["heard"] for res in results]
    exchanges = [[(op, n) for op, n, w in h if op == "exchange"] for h in heard]
    assert exchanges[0] and all(e == exchanges[0] for e in exchanges)
    for node in topology.nodes:  # the ranks of a node hear one sequence, steps in one order
        assert all(heard[r] == heard[node[0]] for r in node), node
    for rank, h in enumerate(heard):
        node = topology.nodes[topology.node_of(rank)]
        for op, _, wire in h:
            if op == "exchange":
                assert wire == Wire(Link.CROSS, (0, 1, 2, 3))
            else:
                assert wire == Wire(Link.INTRA, node) and len(node) > 1


# ---------------------------------------------------------------- layouts (no processes)
def test_pieces_cut_evenly_on_aligned_bounds() -> None:
    assert pieces(40, 3, 4) == (12, 16, 12)
    assert pieces(3, 3, 4) == (0, 0, 3)  # cuts on 4-element bounds: the last piece takes the rest
    assert pieces(0, 2, 4) == (0, 0)
    for length in range(0, 50):
        for n in (1, 2, 3, 5):
            cut = pieces(length, n, 4)
            assert sum(cut) == length and len(cut) == n and all(c >= 0 for c in cut)


@pytest.mark.parametrize("sizes", [(40, 12, 0, 28), (0, 17, 33, 6), (5, 0, 0, 0)])
@pytest.mark.parametrize("nodes", [(2, 2), (3, 1), (1, 3), (1, 1, 2)])
def test_every_foreign_element_crosses_once(sizes: tuple[int, ...], nodes: tuple[int, ...]) -> None:
    topology = Topology.of_sizes(nodes)
    layout = node_layout(sizes, topology, 4)
    covered = [0] * sum(sizes)
    for t in layout.transfers:
        assert topology.node_of(t.holder) != topology.node_of(t.owner)
        lo = layout.offsets[t.owner]
        assert lo <= t.at and t.at + t.length <= lo + sizes[t.owner]  # inside the owner's part
        for i in range(t.at, t.at + t.length):
            covered[i] += 1
    # each element crosses once per node it is not in: (K - 1) times over the exchange
    owner_node = [topology.node_of(r) for r, s in enumerate(sizes) for _ in range(s)]
    assert covered == [topology.node_count - 1] * len(owner_node)
    assert layout.cross_elements() == (topology.node_count - 1) * sum(sizes)
    # a node's port sends what lies outside its region (once) and receives its region from each
    # other node: the busiest port, what the emulator's exchange is paced by, as the planner prices it
    regions = [sum(sizes[r] for r in node) for node in topology.nodes]
    busiest = max(max(sum(sizes) - g, (topology.node_count - 1) * g) for g in regions)
    assert layout.busiest_port_elements(topology) == busiest


def mismatched_worker(rank: int, world: int) -> None:
    Communicator(topology=Topology.of_sizes([3, 1] if rank == 3 else [2, 2]))


@pytest.mark.multiprocess
def test_ranks_with_different_topologies_fail_before_making_groups() -> None:
    with pytest.raises(RankFailure) as failure:
        spawn(mismatched_worker, 4, timeout_s=60)
    assert all("ranks were given different topologies" in failure.value.failures[r] for r in range(4))


def test_staging_is_the_pieces_and_the_partials_received() -> None:
    sizes = (40, 12, 0, 28)
    two, lone = Topology.of_sizes([2, 2]), Topology.of_sizes([3, 1])
    layout = node_layout(sizes, two, 4)
    assert layout.step_sizes[0][1] == (16, 12)  # node 1's region (28) in two 16-byte-aligned pieces
    assert staging_numel("reduce_scatter", layout, two, 0, True) == 16 + 40  # its piece, and node 1's partial
    assert staging_numel("all_gather", layout, two, 0, True) == 0  # broadcasts send from the output
    assert staging_numel("all_gather", layout, two, 0, False) == 16 + 40  # else copies of its pieces
    alone = node_layout(sizes, lone, 4)
    assert staging_numel("reduce_scatter", alone, lone, 3, True) == 28  # a node of one holds views, receives one


def once_worker(rank: int, world: int, topology: Topology) -> dict:
    """Across nodes once per iteration: three in-node reduce-scatters summed into a node accumulator
    and one exchange, against the flat reduce-scatter of the three inputs' sum; ZeRO-0's
    hierarchical all-reduce against the flat one (integer inputs: bit-equal)."""
    torch.set_num_threads(1)
    comm = Communicator(topology=topology)
    out: dict = {}
    for sizes in SIZES:
        xs = [_input(10 * i + rank, sum(sizes), torch.float32) for i in range(3)]
        comm.configure(Route())
        want = torch.zeros(sizes[rank])
        comm.reduce_scatter(want, xs[0] + xs[1] + xs[2], sizes=sizes)
        summed = (xs[0] + xs[1]).clone()
        comm.all_reduce(summed)
        routes = comm.configure(Route(collectives=Collectives.ONCE_PER_ITERATION))
        comm.ledger.clear()
        acc = torch.zeros(comm.accumulator_numel(sizes, 0))
        for x in xs:
            partials = torch.empty_like(acc)
            _wait([comm.reduce_scatter_in_node(partials, x, async_op=True, sizes=sizes)])
            acc.add_(partials)
        in_node = {r.link for r in comm.ledger.records}
        got = torch.zeros(sizes[rank])
        _wait([comm.exchange_accumulated(got, acc, async_op=True, sizes=sizes)])
        reduced = (xs[0] + xs[1]).clone()
        _wait([comm.all_reduce_gradients(reduced, async_op=True)])
        out[sizes] = (torch.equal(got, want), bool((acc == 0).all()), in_node, torch.equal(reduced, summed),
                      routes.accumulates(None), {r.link for r in comm.ledger.records if r.op == "all_reduce"})
    return out


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.multiprocess
def test_node_partials_accumulated_cross_once_and_equal_the_flat_sums(name: str) -> None:
    node_sizes = TOPOLOGIES[name].sizes
    for rank, res in enumerate(spawn(once_worker, 4, (TOPOLOGIES[name],), timeout_s=120)):
        alone = node_sizes[TOPOLOGIES[name].node_of(rank)] == 1
        for sizes, (equal, zeroed, in_node, reduced, accumulates, all_reduce_links) in res.items():
            assert equal and zeroed and reduced and accumulates, (rank, sizes)
            assert in_node <= {Link.INTRA} and (alone or in_node == {Link.INTRA}), (rank, sizes, in_node)
            assert Link.CROSS in all_reduce_links, (rank, all_reduce_links)
            assert alone or Link.INTRA in all_reduce_links, (rank, all_reduce_links)
