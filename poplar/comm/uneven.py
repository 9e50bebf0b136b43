"""All-gather and reduce-scatter over parts of different lengths, one per rank.

Uneven shards (``RankPlan.shard_weight``) give every rank its own part of a flat buffer; the
buffer is the parts back to back, in rank order. torch's tensor collectives
(``all_gather_into_tensor``, ``reduce_scatter_tensor``) take equal parts only, so an uneven
call is built one of these ways:

- ``UnevenMethod.LISTED``: torch's list collectives with one view per rank into the flat
  buffer (``all_gather(list, t)``, ``reduce_scatter(t, list)``). NCCL runs them as grouped
  broadcasts / reduces straight into the views: the wire carries the buffer's own bytes and
  nothing is allocated or copied.
- ``UnevenMethod.BROADCASTS`` (all-gather only): one broadcast per rank, from that rank, into
  its view; the same bytes and no staging, as N calls.
- ``UnevenMethod.PADDED``: every part padded to the longest, one even collective on a staging
  buffer, then copied out. The wire carries N x the longest part, and the staging buffer is an
  extra N x longest elements for the collective's duration.

[Note: which method]
LISTED wherever the backend runs it: no extra memory (the point of uneven shards is memory) and
no padded bytes. gloo's list all-gather refuses parts of different sizes, so on gloo the
all-gather is BROADCASTS or PADDED, whichever ``bench/uneven_collectives.py`` measures faster
(``GLOO_ALL_GATHER``); docs/design.md §3.9 gives the bytes on the wire of each.

[Note: even parts on gloo]
gloo's tensor collectives are slower than these methods even where every part is the same
length (``bench/uneven_collectives.py --weights 1,1``, 2 ranks, 6.5 M fp32: the list
reduce-scatter 0.51 x ``reduce_scatter_tensor``'s time, the broadcasts 0.78 x
``all_gather_into_tensor``'s), so on gloo even calls take the same methods (``even_method``);
the bytes on the wire are the same. Other backends (NCCL) keep torch's tensor collectives.

Each function returns an ``UnevenCall``: the collective to run, what to do once it is done, and
the bytes it puts on the wire (what the ledger records).
"""

from __future__ import annotations

from enum import Enum
from itertools import accumulate
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; older releases only have the old names
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class UnevenMethod(Enum):
    LISTED = "listed"  # torch's list collectives on per-rank views: no staging, no padding
    BROADCASTS = "broadcasts"  # all-gather as one broadcast per rank into its view
    PADDED = "padded"  # parts padded to the longest, one even collective on a staging buffer


# gloo's uneven all-gather, chosen on CPU by bench/uneven_collectives.py (3 ranks, 5:1:2 of 4M fp32:
# broadcasts 1.05x the even all-gather's time, padded 2.9x); gloo serves the tests and the emulator
GLOO_ALL_GATHER = UnevenMethod.BROADCASTS


class AllWorks:
    """Several torch works waited on as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


class UnevenCall(NamedTuple):
    """An uneven collective ready to issue: ``run(async_op)`` starts it (returns torch's work or
    None), ``finish()`` completes it once it is done, ``wire_bytes`` is what it sends. The input
    is read when ``run`` is called, not when the call is built: a hierarchical collective builds
    its later steps before the earlier ones have written their inputs. A route's call of one rank
    alone has ``run`` None: it was done where it was built (``poplar.comm.routes``)."""

    run: Callable[[bool], Any] | None
    finish: Callable[[], None] | None
    wire_bytes: int


def method_for(backend: str, op: str) -> UnevenMethod:
    """The method of ``op`` ("all_gather" / "reduce_scatter") on ``backend`` (Note above)."""
    if backend == "gloo" and op == "all_gather":
        return GLOO_ALL_GATHER
    return UnevenMethod.LISTED


def even_method(backend: str, op: str) -> UnevenMethod | None:
    """The method of ``op`` over equal parts on ``backend``; None: torch's tensor collective
    (Note: even parts on gloo)."""
    return method_for(backend, op) if backend == "gloo" else None


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each part starts in the parts laid back to back."""
    return list(accumulate(sizes, initial=0))[:-1]


def run_p2p(ops: list[Any], async_op: bool) -> Any:
    """Point-to-point ``ops`` (``dist.P2POp``) as one batch: an ``AllWorks`` when ``async_op``,
    else done on return; None when there are none."""
    if not ops:
        return None
    works = dist.batch_isend_irecv(ops)
    if async_op:
        return AllWorks(works)
    for w in works:
        w.wait()
    return None


def all_gather(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int, group: Any,
               method: UnevenMethod) -> UnevenCall:
    """``output`` (the parts back to back) gets every rank's ``input`` (``sizes[rank]`` long)."""
    element = output.element_size()
    if method is UnevenMethod.LISTED:
        views = list(output.split(list(sizes)))
        return UnevenCall(lambda a: dist.all_gather(views, input, group=group, async_op=a), None,
                          sum(sizes) * element)
    if method is UnevenMethod.BROADCASTS:
        views = list(output.split(list(sizes)))
        if input.data_ptr() != views[rank].data_ptr():  # an input that is its own part is in place
            views[rank].copy_(input)

        def run(async_op: bool) -> Any:
            ranks = [r for r, size in enumerate(sizes) if size]  # an empty part has nothing to send
            works = [dist.broadcast(views[r], dist.get_global_rank(group, r) if group is not None else r,
                                    group=group, async_op=async_op) for r in ranks]
            return AllWorks(works) if async_op else None
        return UnevenCall(run, None, sum(sizes) * element)
    longest, n = max(sizes), len(sizes)
    source = torch.zeros(longest, dtype=input.dtype, device=input.device)
    staged = torch.empty(n * longest, dtype=output.dtype, device=output.device)

    def run(async_op: bool) -> Any:
        source[:sizes[rank]].copy_(input)  # read when issued: a step before it may write the input
        return all_gather_tensor(staged, source, group=group, async_op=async_op)

    def finish() -> None:
        for r, (at, size) in enumerate(zip(offsets(sizes), sizes)):
            output[at:at + size].copy_(staged[r * longest:r * longest + size])
    return UnevenCall(run, finish, n * longest * element)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], rank: int, group: Any,
                   method: UnevenMethod) -> UnevenCall:
    """``output`` (``sizes[rank]`` long) gets this rank's part of the sum of ``input`` over ranks."""
    element = input.element_size()
    if method is UnevenMethod.LISTED:
        parts = list(input.split(list(sizes)))
        return UnevenCall(lambda a: dist.reduce_scatter(output, parts, op=dist.ReduceOp.SUM, group=group,
                                                        async_op=a), None, sum(sizes) * element)
    longest, n = max(sizes), len(sizes)
    staged = torch.zeros(n * longest, dtype=input.dtype, device=input.device)
    mine = torch.empty(longest, dtype=output.dtype, device=output.device)

    def run(async_op: bool) -> Any:
        for r, (at, size) in enumerate(zip(offsets(sizes), sizes)):  # read when issued, as the all-gather
            staged[r * longest:r * longest + size].copy_(input[at:at + size])
        return reduce_scatter_tensor(mine, staged, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def finish() -> None:
        output.copy_(mine[:sizes[rank]])
    return UnevenCall(run, finish, n * longest * element)
