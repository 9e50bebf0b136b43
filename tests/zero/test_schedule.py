"""``poplar.zero.prefetch``: the fixed collective sequence of a ZeRO-3 pass, driven by a fake
Gatherer that records every call (no process group, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from poplar.zero.prefetch import (Item, Op, Pass, PassKind, PassState, PendingGather, Schedule, backward_items,
                                  forward_items)

AG, RS = Op.ALL_GATHER, Op.REDUCE_SCATTER


@dataclass(frozen=True)
class FakeBlock:
    index: int
    name: str


@dataclass
class FakeGatherer:
    """Records issued collectives as (op, block index) and checks the gather life cycle."""

    issued: list[tuple[Op, int]] = field(default_factory=list)
    alive: set[int] = field(default_factory=set)  # gathered and not yet freed
    max_alive: int = 0
    handles: dict[int, object] = field(default_factory=dict)  # started, not yet finished
    finished: list[tuple[int, bool]] = field(default_factory=list)  # (block, use)
    hooks: list[int] = field(default_factory=list)

    def start_gather(self, block: FakeBlock, again: bool = False) -> object:
        assert block.index not in self.alive, f"{block.name} gathered twice"
        self.issued.append((AG, block.index))
        self.alive.add(block.index)
        self.max_alive = max(self.max_alive, len(self.alive))
        handle = self.handles[block.index] = object()
        return handle

    def finish_gather(self, block: FakeBlock, handle: object, use: bool) -> None:
        assert self.handles.pop(block.index) is handle, f"{block.name}: finished with another gather's handle"
        self.finished.append((block.index, use))

    def free_gather(self, block: FakeBlock) -> None:
        self.alive.discard(block.index)

    def gathered_hook(self, block: FakeBlock) -> None:
        self.hooks.append(block.index)

    def reduce(self, block: FakeBlock) -> None:
        self.issued.append((RS, block.index))


def blocks(n: int) -> list[FakeBlock]:
    return [FakeBlock(i, f"b{i}") for i in range(n)]


def as_pairs(items: list[Item]) -> list[tuple[Op, int]]:
    return [(it.op, it.block.index) for it in items]


ROOT = FakeBlock(0, "root")
B1, B2, B3, B4 = blocks(5)[1:]


def backward(order: list[FakeBlock] = [B1, B2, B3, B4]) -> tuple[Schedule, FakeGatherer]:  # noqa: B006
    g = FakeGatherer()
    return Schedule(backward_items(ROOT, order), g), g


# ------------------------------------------------------------------ the item lists
def test_forward_items_gather_root_then_blocks_in_order() -> None:
    assert as_pairs(forward_items(ROOT, [B2, B1, B3])) == [(AG, 0), (AG, 2), (AG, 1), (AG, 3)]
    assert as_pairs(forward_items(None, [B3, B1])) == [(AG, 3), (AG, 1)]
    assert forward_items(None, []) == []


def test_backward_items_put_each_reduce_after_the_next_gather() -> None:
    assert as_pairs(backward_items(ROOT, [B3, B2, B1])) == [
        (AG, 3), (AG, 2), (RS, 3), (AG, 1), (RS, 2), (RS, 1), (RS, 0)]
    assert as_pairs(backward_items(None, [B1])) == [(AG, 1), (RS, 1)]
    assert as_pairs(backward_items(ROOT, [])) == [(RS, 0)]
    assert backward_items(None, []) == []


def test_items_are_typed_values() -> None:
    item = backward_items(None, [B1])[1]
    assert item == Item(Op.REDUCE_SCATTER, B1) and item.op is Op.REDUCE_SCATTER and item.block is B1
    assert repr(item) == "rs(b1)"
    with pytest.raises(AttributeError):
        item.op = Op.ALL_GATHER  # type: ignore[misc]


# ------------------------------------------------------------------ flush
@pytest.mark.parametrize("make", [lambda: forward_items(ROOT, [B1, B2, B3, B4]),
                                  lambda: backward_items(ROOT, [B4, B3, B2, B1])])
def test_flush_issues_every_item_once_in_order_with_two_gathers_alive_at_most(make) -> None:
    items = make()
    g = FakeGatherer()
    s = Schedule(items, g)
    s.flush()
    assert g.issued == as_pairs(items)
    assert g.max_alive == 2
    assert g.alive == set() and s.pending == {} and g.handles == {}
    assert all(not use for _, use in g.finished)
    assert g.hooks == [b for op, b in as_pairs(items) if op is AG]
    s.flush()  # nothing left to issue
    assert g.issued == as_pairs(items)


def test_flush_releases_gathers_issued_ahead_but_never_used() -> None:
    s, g = backward()
    assert s.need(B1)
    s.prefetch_after(B1)  # B2 gathered ahead
    assert set(s.pending) == {2}
    s.flush()
    assert g.issued == as_pairs(s.items) and g.alive == {1}  # B1 was used: its owner frees it
    assert (2, False) in g.finished


# ------------------------------------------------------------------ need / prefetch_after / ready
def test_in_order_backward_with_prefetch_issues_the_schedule_exactly() -> None:
    s, g = backward()
    for b in [B1, B2, B3, B4]:
        assert s.need(b)
        s.prefetch_after(b)
        s.ready(b)
    s.ready(ROOT)
    assert g.issued == as_pairs(s.items)
    assert s.next == len(s.items) and not s.deviated
    assert g.max_alive == 2  # the block in backward and the one prefetched
    s.flush()
    assert g.issued == as_pairs(s.items)


def test_prefetch_gathers_the_next_block_before_it_is_needed() -> None:
    s, g = backward()
    s.need(B1)
    assert g.issued == [(AG, 1)]
    s.prefetch_after(B1)
    assert g.issued == [(AG, 1), (AG, 2)] and set(s.pending) == {2}
    s.need(B2)  # uses the prefetched gather: nothing new issued
    assert g.issued == [(AG, 1), (AG, 2)] and g.finished == [(1, True), (2, True)]


def test_prefetch_never_passes_an_incomplete_reduce_scatter() -> None:
    s, g = backward()
    s.need(B1)
    s.prefetch_after(B1)
    s.need(B2)
    s.prefetch_after(B2)  # AG(B3) lies behind RS(B1), and B1 is not complete
    assert g.issued == [(AG, 1), (AG, 2)]
    s.ready(B1)  # issues RS(B1), but not beyond it
    assert g.issued == [(AG, 1), (AG, 2), (RS, 1)]
    s.prefetch_after(B2)
    assert g.issued == [(AG, 1), (AG, 2), (RS, 1), (AG, 3)]


def test_ready_stops_before_an_earlier_incomplete_reduce_scatter() -> None:
    s, g = backward()
    s.ready(B2)  # up to RS(B2): the gathers before it go out, RS(B1) holds it back (B1 incomplete)
    assert g.issued == [(AG, 1), (AG, 2)] and 2 in s.complete
    s.ready(B1)  # up to RS(B1) only
    assert g.issued == [(AG, 1), (AG, 2), (RS, 1)]
    s.need(B3)
    assert g.issued == [(AG, 1), (AG, 2), (RS, 1), (AG, 3)]
    s.ready(B3)  # up to RS(B3): RS(B2) (complete) and AG(B4) come first
    assert g.issued[4:] == [(RS, 2), (AG, 4), (RS, 3)]


def test_need_forces_an_early_reduce_scatter_of_an_incomplete_block() -> None:
    s, g = backward()
    s.need(B1)
    s.need(B3)  # a rank whose backward runs B3 before B1 is complete
    assert g.issued == [(AG, 1), (AG, 2), (RS, 1), (AG, 3)]
    assert s.deviated  # B2 is still waiting, gathered
    s.ready(B1)  # B1 completes late: its reduce-scatter is not issued again
    assert g.issued.count((RS, 1)) == 1
    s.flush()
    assert g.issued == as_pairs(s.items)


def test_need_of_a_block_already_used_or_not_in_the_schedule() -> None:
    s, g = backward()
    assert s.need(B1) and not s.need(B1)
    assert not s.need(ROOT)  # backward gathers no root: it stays gathered from forward
    assert not s.need(FakeBlock(9, "other"))
    assert g.issued == [(AG, 1)]


def test_ready_of_a_block_gathered_ahead_releases_it_unused() -> None:
    s, g = backward()
    s.need(B1)
    s.prefetch_after(B1)
    s.ready(B2)  # B2's gradients complete without its backward using the prefetched gather
    assert (2, False) in g.finished and 2 not in g.alive and s.pending == {}


def test_forward_need_out_of_order_keeps_earlier_gathers_pending() -> None:
    g = FakeGatherer()
    s = Schedule(forward_items(ROOT, [B1, B2, B3]), g)
    assert s.need(B2)
    assert g.issued == [(AG, 0), (AG, 1), (AG, 2)] and set(s.pending) == {0, 1}
    assert s.deviated
    assert s.need(B1) and g.issued == [(AG, 0), (AG, 1), (AG, 2)]  # its pending gather, not a new one
    assert isinstance(s.pending[0], PendingGather) and s.pending[0].block is ROOT


# ------------------------------------------------------------------ Pass
def test_pass_states() -> None:
    g = FakeGatherer()
    p = Pass(PassKind.TRAIN, Schedule(forward_items(None, [B1]), g), Schedule(backward_items(None, [B1]), g))
    assert p.train and p.state is PassState.IDLE and not p.state.forward_over
    p.finish_forward()  # no forward ran: the schedule is issued all the same
    assert p.state is PassState.SKIPPED and p.state.forward_over and g.issued == [(AG, 1)]
    e = Pass(PassKind.EVAL, Schedule(forward_items(None, [B1]), g), None)
    e.state = PassState.FORWARD
    e.finish_forward()
    assert not e.train and e.state is PassState.FORWARD_DONE and e.state.forward_over
