"""Quantized reduce-scatter and all-gather (``poplar.comm.quantized``) on 4 gloo ranks as two nodes
(2 + 2 and 3 + 1), against exact collectives on the same inputs: uneven parts with an empty one,
fp32 and bf16, hierarchical (the exchange quantized), flat on a topology that spans nodes, and
weights at every step. Every element within the bound of the block scales, exactly equal where
the inputs are representable, a rank's own part (and, hierarchical, its node's parts of a
gather) exact; a non-finite value stays non-finite; the ledger's bytes are the quantized bytes
sent; a secondary shard gives the backward gather exactly what the forward one gave. The same
checks run on GPUs over NCCL where there is one (skipped otherwise)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from poplar.comm import Communicator
from poplar.comm.hierarchical import node_layout
from poplar.process.launch import spawn
from poplar.comm.quantize import blocks_of, window_nbytes, wire_nbytes
from poplar.types.compression import QuantBits, Quantization, QuantScope
from poplar.types.route import Collectives, Route
from poplar.types.topology import Link, Topology
from poplar.emulation.gpu_ranks import rank_gpu

CPU = torch.device("cpu")
TOPOLOGIES = {"2+2": Topology.of_sizes([2, 2]), "3+1": Topology.of_sizes([3, 1])}
SIZES = [(40, 12, 0, 28), (33, 33, 33, 33)]  # parts per rank: uneven with an empty one; even, odd length
BLOCK = 16
INT8 = Quantization(QuantBits.INT8, BLOCK)
INT4 = Quantization(QuantBits.INT4, BLOCK)
EVERY = Quantization(QuantBits.INT8, BLOCK, QuantScope.EVERY_STEP)
CUT = INT8.cut_at((0, 7, 30, 45, 61, 100))  # a buffer of parameters: blocks begin at each one too
SPECS = {"int8": INT8, "int4": INT4, "every": EVERY, "int8-cut": CUT}
SECONDARY = {"cross_node": INT8, "every_step": EVERY, "every_step-cut": EVERY.cut_at(CUT.tensor_starts)}
# the shares of a representable reduce-scatter: each node's sum, and each rank's slice, is levels x 2^k
SHARES = {"2+2": (0.5, 0.5, 0.5, 0.5), "3+1": (0.5, 0.25, 0.25, 1.0)}
DTYPES = (torch.float32, torch.bfloat16)


def floats(rank: int, total: int, dtype: torch.dtype, device: torch.device = CPU) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(total, generator=g) * (1 + rank)).to(device, dtype)


def representable_part(rank: int, n: int, levels: int, device: torch.device = CPU) -> torch.Tensor:
    """Integers with every block's absmax ``levels``: a gather of them is exact."""
    x = torch.randint(-levels, levels + 1, (n,), generator=torch.Generator().manual_seed(rank)).float()
    x[::BLOCK] = levels
    return x.to(device)


def representable_input(rank: int, total: int, name: str, levels: int, device: torch.device = CPU) -> torch.Tensor:
    """A shared ±1 pattern times this rank's share of ``levels``: every partial of it is exact."""
    signs = torch.randint(0, 2, (total,), generator=torch.Generator().manual_seed(7)).float() * 2 - 1
    return (signs * SHARES[name][rank] * levels).to(device)


def _wait(works: list) -> None:
    for w in works:
        if w is not None:
            w.wait()


def _pair(comm: Communicator, sizes: tuple, x: torch.Tensor, part: torch.Tensor, q: Quantization | None,
          rs: bool = True) -> tuple:
    """(reduce-scatter of ``x``, all-gather of ``part``), async, both in flight at once."""
    out = torch.zeros(sizes[comm.rank], dtype=x.dtype, device=x.device)
    full = torch.zeros(sum(sizes), dtype=part.dtype, device=x.device)
    works = [comm.reduce_scatter(out, x, async_op=True, sizes=sizes, quantization=q) if rs else None,
             comm.all_gather(full, part, async_op=True, sizes=sizes, quantization=q)]
    _wait(works[::-1])
    return out, full


def _records(comm: Communicator) -> list:
    return [(r.op, r.bytes, r.link) for r in comm.ledger.records]


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    return type(obj)(_cpu(o) for o in obj) if isinstance(obj, tuple) else obj


def collective_worker(rank: int, world: int, topology: Topology, name: str, gpu: bool = False) -> dict:
    """Every check's collectives on this rank (``gpu``: on its GPU, over NCCL); CPU results."""
    torch.set_num_threads(1)
    device = rank_gpu(rank, world) if gpu else CPU
    comm = Communicator(topology=topology, device=device)
    out: dict = {}
    for dtype in DTYPES:
        for sizes in SIZES:
            x, part = floats(rank, sum(sizes), dtype, device), floats(10 + rank, sizes[rank], dtype, device)
            for hier, modes in ((True, ("int8", "int4", "every", "int8-cut")), (False, ("int8", "int8-cut"))):
                comm.configure(Route(collectives=Collectives.HIERARCHICAL if hier else Collectives.FLAT))
                for label in modes:
                    q = SPECS[label]
                    comm.ledger.clear()
                    out[(str(dtype), sizes, hier, label)] = (
                        _pair(comm, sizes, x, part, q, rs=q.scope is QuantScope.CROSS_NODE), _records(comm))
                comm.ledger.clear()
                out[(str(dtype), sizes, hier, "exact")] = (_pair(comm, sizes, x, part, None), _records(comm))
    for hier in (True, False):  # representable inputs: exactly the exact collectives
        comm.configure(Route(collectives=Collectives.HIERARCHICAL if hier else Collectives.FLAT))
        sizes = SIZES[0]
        for q in (INT8, INT4):
            x = representable_input(rank, sum(sizes), name, q.bits.levels, device)
            part = representable_part(rank, sizes[rank], q.bits.levels, device)
            out[("representable", hier, q.bits.value)] = (_pair(comm, sizes, x, part, q), _pair(comm, sizes, x, part,
                                                                                                None))
    comm.configure(Route(collectives=Collectives.SECONDARY_SHARDS))
    for label, q in SECONDARY.items():  # the secondary shard reproduces the forward's gather inside the node
        sizes = SIZES[0]
        part = floats(20 + rank, sizes[rank], torch.float32, device)
        keep = torch.zeros(comm.secondary_numel(sizes, 0, 4), device=device)
        full, again = torch.zeros(sum(sizes), device=device), torch.zeros(sum(sizes), device=device)
        comm.all_gather_keeping(full, part, keep, async_op=True, sizes=sizes, quantization=q).wait()
        comm.ledger.clear()
        comm.all_gather_within_nodes(again, part, keep, async_op=True, sizes=sizes, quantization=q).wait()
        links = {r.link for r in comm.ledger.records}
        plain = torch.zeros(sum(sizes), device=device)
        comm.all_gather(plain, part, sizes=sizes, quantization=q)
        out[("secondary", label)] = (full, again, plain, links)
    for hier in (True, False):  # a non-finite value sent quantized stays non-finite at its owner
        comm.configure(Route(collectives=Collectives.HIERARCHICAL if hier else Collectives.FLAT))
        sizes = SIZES[0]
        x = floats(rank, sum(sizes), torch.float32, device)
        if rank == 3:
            x[5] = float("inf")  # in rank 0's part, from the other node
        got = torch.zeros(sizes[rank], device=device)
        comm.reduce_scatter(got, x, sizes=sizes, quantization=INT8)
        out[("nonfinite", hier)] = got
    one_node = Communicator(device=device)  # a topology of one node: nothing crosses, CROSS_NODE is exact
    x = floats(rank, 20, torch.float32, device)
    a, b = torch.zeros(5, device=device), torch.zeros(5, device=device)
    one_node.reduce_scatter(a, x, quantization=INT8)
    one_node.reduce_scatter(b, x)
    out["one node"] = (a, b)
    return {k: _cpu(v) for k, v in out.items()}


def _offsets(sizes: tuple) -> list[int]:
    return [sum(sizes[:r]) for r in range(len(sizes))]


def _gather_bound(parts: list[torch.Tensor], q: Quantization, dtype: torch.dtype) -> torch.Tensor:
    """Per element of the gathered buffer: half its block's step (blocks from each part's start
    and each parameter's, ``q.tensor_starts``), fp32's rounding, and (bf16) the output's rounding."""
    bounds, at = [], 0
    for p in parts:
        p = p.float()
        scale = torch.zeros_like(p)
        cuts = [0] + [c - at for c in q.tensor_starts if at < c < at + p.numel()] + [p.numel()]
        at += p.numel()
        for c, e in zip(cuts, cuts[1:]):
            for lo in range(c, e, q.block_size):
                hi = min(lo + q.block_size, e)
                scale[lo:hi] = p[lo:hi].abs().max() / q.bits.levels
        rounding = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -22
        bounds.append(scale / 2 + p.abs() * rounding + scale * rounding)
    return torch.cat(bounds)


def _check_gather(name: str, key: tuple, results: list[dict], q: Quantization, hier: bool) -> None:
    dtype, sizes = getattr(torch, key[0].split(".")[1]), key[1]
    topology = TOPOLOGIES[name]
    parts = [floats(10 + r, sizes[r], dtype) for r in range(4)]
    bound, truth = _gather_bound(parts, q, dtype), torch.cat(parts).float()
    for rank, res in enumerate(results):
        full = res[key][0][1].float()
        node = topology.nodes[topology.node_of(rank)]
        exact_parts = node if hier and q.scope is QuantScope.CROSS_NODE else (rank,)
        exact = torch.zeros(sum(sizes), dtype=torch.bool)
        for r in exact_parts:
            exact[_offsets(sizes)[r]:_offsets(sizes)[r] + sizes[r]] = True
        assert torch.equal(full[exact], truth[exact]), (key, rank)  # never quantized
        error = (full - truth).abs()
        assert torch.all(error <= bound), (key, rank, (error - bound).max())
        assert error[~exact].max() > 0, (key, rank)  # the others' parts were quantized


def _check_reduce(name: str, key: tuple, results: list[dict], q: Quantization, hier: bool) -> None:
    dtype, sizes = getattr(torch, key[0].split(".")[1]), key[1]
    topology = TOPOLOGIES[name]
    inputs = [floats(r, sum(sizes), dtype).double() for r in range(4)]
    truth = torch.stack(inputs).sum(0)
    if hier:  # each node's partial is quantized once on its way to an owner in another node
        partials = [sum(inputs[r] for r in node) for node in topology.nodes]
        step = max(p.abs().max() for p in partials) / q.bits.levels
        crossings = topology.node_count - 1
    else:  # every other rank's slice is quantized
        step = max(x.abs().max() for x in inputs) / q.bits.levels
        crossings = 3
    magnitude = torch.stack(inputs).abs().sum(0)
    rounding = magnitude * (2 ** -6 if dtype == torch.bfloat16 else 2 ** -20)
    for rank, res in enumerate(results):
        lo, n = _offsets(sizes)[rank], sizes[rank]
        got = res[key][0][0].double()
        error = (got - truth[lo:lo + n]).abs()
        assert torch.all(error <= crossings * step / 2 + rounding[lo:lo + n]), (key, rank, error.max(), step)
        if n:
            exact = res[key[:3] + ("exact",)][0][0].double()
            assert not torch.equal(got, exact), (key, rank)  # it did quantize


def _cross_bytes(records: list) -> int:
    return sum(b for op, b, link in records if link is Link.CROSS)


def _check_bytes(name: str, key: tuple, results: list[dict], q: Quantization) -> None:
    """The ledger records the quantized bytes each rank sent across (values and scales)."""
    sizes, element = key[1], 4 if key[0] == "torch.float32" else 2
    layout = node_layout(tuple(sizes), TOPOLOGIES[name], element)
    rs = sum(wire_nbytes(q, t.at, t.length) for t in layout.transfers)
    ag = sum(window_nbytes(t.at - layout.offsets[t.owner], t.at - layout.offsets[t.owner] + t.length, q.bits,
                           blocks_of(q, layout.offsets[t.owner], sizes[t.owner])) for t in layout.transfers)
    sent = sum(_cross_bytes(res[key][1]) for res in results)
    assert sent == rs + ag, (key, sent, rs + ag)
    exact = sum(_cross_bytes(res[key[:3] + ("exact",)][1]) for res in results)
    assert exact == 2 * layout.cross_elements() * element
    intra = [sorted(b for op, b, link in res[key][1] if link is Link.INTRA) for res in results]
    assert intra == [sorted(b for op, b, link in res[key[:3] + ("exact",)][1] if link is Link.INTRA)
                     for res in results]  # the in-node steps are exact


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.multiprocess
def test_quantized_collectives_within_their_bound(name: str) -> None:
    _check_results(name, spawn(collective_worker, 4, (TOPOLOGIES[name], name), timeout_s=120))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.multiprocess
def test_quantized_collectives_on_nccl(name: str) -> None:
    """The same checks with every rank on a GPU over NCCL (ranks share a GPU where there are
    fewer than four: ``poplar.emulation.gpu_ranks``): the byte all-gather and the all-to-all of
    ``batch_isend_irecv`` as NCCL runs them."""
    _check_results(name, spawn(collective_worker, 4, (TOPOLOGIES[name], name, True), backend="nccl", timeout_s=240))


def _check_exact(key: tuple, results: list[dict]) -> None:
    """The exact collectives beside the quantized ones: the gather is the parts, the
    reduce-scatter the sum (to the dtype's rounding)."""
    dtype, sizes = getattr(torch, key[0].split(".")[1]), key[1]
    truth = torch.cat([floats(10 + r, sizes[r], dtype) for r in range(4)])
    summed = torch.stack([floats(r, sum(sizes), dtype).double() for r in range(4)]).sum(0)
    tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    for rank, res in enumerate(results):
        (out, full), lo = res[key][0], _offsets(sizes)[rank]
        assert torch.equal(full, truth), (key, rank)
        torch.testing.assert_close(out.double(), summed[lo:lo + sizes[rank]], rtol=tol, atol=tol * 4)


def _check_results(name: str, results: list[dict]) -> None:
    for key in results[0]:
        if isinstance(key, tuple) and len(key) == 4 and key[3] == "exact":
            _check_exact(key, results)
        if not isinstance(key, tuple) or len(key) != 4 or key[3] == "exact":
            continue
        q, hier = SPECS[key[3]], key[2]
        _check_gather(name, key, results, q, hier)
        if q.scope is QuantScope.CROSS_NODE:
            _check_reduce(name, key, results, q, hier)
        if hier and q.scope is QuantScope.CROSS_NODE:
            _check_bytes(name, key, results, q)
        if not hier:  # flat: the whole buffer, quantized, on the flat link
            flat = [b for op, b, link in results[0][key][1] if link is Link.FLAT]
            offsets = _offsets(key[1])
            assert flat == [sum(wire_nbytes(q, lo, s) for lo, s in zip(offsets, key[1]))] * 2, (key, flat)
    for rank, res in enumerate(results):
        for hier in (True, False):
            for bits in ("int8", "int4"):
                (qo, qf), (eo, ef) = res[("representable", hier, bits)]
                assert torch.equal(qo, eo) and torch.equal(qf, ef), (rank, hier, bits)
        for label in SECONDARY:
            full, again, plain, links = res[("secondary", label)]
            assert torch.equal(full, again) and torch.equal(full, plain), (rank, label)
            assert links <= {Link.INTRA}, (rank, label, links)  # the backward gather stays in the node
        for hier in (True, False):
            got = res[("nonfinite", hier)]
            assert (not torch.isfinite(got[5]).item()) if rank == 0 else torch.isfinite(got).all(), (rank, hier)
        a, b = res["one node"]
        assert torch.equal(a, b)
