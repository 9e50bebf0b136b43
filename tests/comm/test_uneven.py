"""Uneven all-gather and reduce-scatter on 3 gloo ranks (parts 5:1:2 and one empty part): every
method gives the right values, sync and async, and the ledger records the bytes each sends."""

from __future__ import annotations

import pytest
import torch

from poplar.comm import Communicator
from poplar.comm import uneven
from poplar.process.launch import spawn

SIZES = [(10, 2, 4), (0, 3, 5)]


def _part(rank: int, size: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.float32) + 100 * (rank + 1)


def uneven_worker(rank: int, world: int) -> dict:
    comm = Communicator()
    out: dict = {}
    for sizes in SIZES:
        total = sum(sizes)
        for method in (uneven.UnevenMethod.BROADCASTS, uneven.UnevenMethod.PADDED):
            flat = torch.zeros(total)
            call = uneven.all_gather(flat, _part(rank, sizes[rank]), sizes, rank, None, method)
            call.run(False)
            if call.finish is not None:
                call.finish()
            out[("all_gather", sizes, method.value)] = (flat, call.wire_bytes)
        for method in (uneven.UnevenMethod.LISTED, uneven.UnevenMethod.PADDED):
            mine = torch.zeros(sizes[rank])
            call = uneven.reduce_scatter(mine, torch.arange(total, dtype=torch.float32) * (rank + 1), sizes, rank,
                                         None, method)
            call.run(False)
            if call.finish is not None:
                call.finish()
            out[("reduce_scatter", sizes, method.value)] = (mine, call.wire_bytes)
        # through the communicator, async: the ledger records what the chosen method sent
        flat, mine = torch.zeros(total), torch.zeros(sizes[rank])
        comm.all_gather(flat, _part(rank, sizes[rank]), tag="ag", async_op=True, sizes=sizes).wait()
        comm.reduce_scatter(mine, torch.arange(total, dtype=torch.float32) * (rank + 1), tag="rs", async_op=True,
                            sizes=sizes).wait()
        out[("comm", sizes)] = (flat, mine, {r.tag: r.bytes for r in comm.ledger.records})
    return out


@pytest.mark.multiprocess
def test_uneven_collectives_give_every_part() -> None:
    results = spawn(uneven_worker, 3, timeout_s=60)
    for sizes in SIZES:
        total, longest = sum(sizes), max(sizes)
        gathered = torch.cat([_part(r, s) for r, s in enumerate(sizes)])
        summed = torch.arange(total, dtype=torch.float32) * 6  # ranks contribute x1, x2, x3
        starts = [sum(sizes[:r]) for r in range(3)]
        for rank, res in enumerate(results):
            mine = summed[starts[rank]:starts[rank] + sizes[rank]]
            for method, wire in (("broadcasts", total), ("padded", 3 * longest)):
                flat, sent = res[("all_gather", sizes, method)]
                assert torch.equal(flat, gathered) and sent == 4 * wire, (sizes, method, rank)
            for method, wire in (("listed", total), ("padded", 3 * longest)):
                part, sent = res[("reduce_scatter", sizes, method)]
                assert torch.equal(part, mine) and sent == 4 * wire, (sizes, method, rank)
            flat, part, ledger = res[("comm", sizes)]
            assert torch.equal(flat, gathered) and torch.equal(part, mine)
            assert ledger == {"ag": 4 * total, "rs": 4 * total}  # gloo's choices send no padding
