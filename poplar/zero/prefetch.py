"""The fixed sequence of collectives of one ZeRO-3 pass, and prefetch.

Every rank must issue the same collectives in the same order (on one process group), and a
rank with fewer micro-steps replays a micro-step it does not have. So a pass never issues
collectives in the order its hooks happen to ask: it walks a fixed ``Schedule`` — the same list
on every rank — with one cursor:

- forward:  AG(root), AG(F0), AG(F1), ...                       (AG = all-gather)
- backward: AG(G0), AG(G1), RS(G0), AG(G2), RS(G1), ..., AG(Gn-1), RS(Gn-2), RS(Gn-1), RS(root)
  (RS = reduce-scatter; block i's reduce-scatter sits right after the next block's gather, so
  one block ahead can be gathered while the previous one reduces).

``need(b)`` issues everything up to b's gather (gathers before it stay gathered until their
turn — correct, at the cost of memory, when a rank visits blocks in another order); a
reduce-scatter it must pass whose block is not complete yet is issued early with what the block
has, and gradients arriving later are reduced once per iteration (``late_flats`` in ``Stage3``).
``prefetch_after(b)`` issues up to the next gather but never passes an incomplete block's
reduce-scatter; ``ready(b)`` issues up to b's reduce-scatter once b's gradients are complete.
``flush()`` issues what is left, keeping at most two gathers alive, and releases gathers that
were never used. Each rank therefore issues exactly this list once per pass, whatever its hooks
did: no mismatch, and no hang (a rank only ever waits on collectives it has issued, and every
rank issues the same list in the same order).

A ``Pass`` is one forward (``PassKind.EVAL``) or one micro-step (``PassKind.TRAIN``): its
forward and backward schedules and how far its forward has come (``PassState``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol


class Op(Enum):
    """The collective of a schedule item."""

    ALL_GATHER = "ag"
    REDUCE_SCATTER = "rs"


@dataclass(frozen=True)
class Item:
    """One collective of a pass: ``op`` of ``block``."""

    op: Op
    block: Any

    def __repr__(self) -> str:
        return f"{self.op.value}({getattr(self.block, 'name', self.block)})"


@dataclass
class PendingGather:
    """A gather issued ahead of its use: the block and the Gatherer's handle for it."""

    block: Any
    handle: Any


class Gatherer(Protocol):
    def start_gather(self, block: Any, again: bool) -> Any: ...
    def finish_gather(self, block: Any, handle: Any, use: bool) -> None: ...
    def free_gather(self, block: Any) -> None: ...
    def gathered_hook(self, block: Any) -> None: ...
    def reduce(self, block: Any) -> None: ...


def forward_items(root: Any, order: list[Any]) -> list[Item]:
    blocks = ([root] if root is not None else []) + order
    return [Item(Op.ALL_GATHER, b) for b in blocks]


def backward_items(root: Any, order: list[Any]) -> list[Item]:
    items: list[Item] = []
    for i, b in enumerate(order):
        items.append(Item(Op.ALL_GATHER, b))
        if i > 0:
            items.append(Item(Op.REDUCE_SCATTER, order[i - 1]))
    if order:
        items.append(Item(Op.REDUCE_SCATTER, order[-1]))
    if root is not None:
        items.append(Item(Op.REDUCE_SCATTER, root))
    return items


class Schedule:
    """Walks ``items`` once with one cursor, issuing each through the Gatherer ``g``; ``again``:
    its gathers fetch what the pass's forward gathered already (the backward's)."""

    def __init__(self, items: list[Item], g: Gatherer, again: bool = False) -> None:
        self.items, self.g, self.again = items, g, again
        self.ag_pos = {it.block.index: i for i, it in enumerate(items) if it.op is Op.ALL_GATHER}
        self.rs_pos = {it.block.index: i for i, it in enumerate(items) if it.op is Op.REDUCE_SCATTER}
        self.next = 0  # items[:next] have been issued
        self.pending: dict[int, PendingGather] = {}  # gathers issued, not yet used, by block index
        self.complete: set[int] = set()  # blocks whose gradients are complete
        self.deviated = False  # a block was needed ahead of its turn

    def _gather(self, b: Any) -> None:
        self.pending[b.index] = PendingGather(b, self.g.start_gather(b, self.again))
        self.g.gathered_hook(b)

    def _advance(self, upto: int, force: bool) -> bool:
        """Issue items up to position ``upto``; without ``force`` stop before the reduce-scatter of
        an incomplete block. True if everything up to ``upto`` is issued."""
        while self.next <= upto:
            item = self.items[self.next]
            if item.op is Op.REDUCE_SCATTER and item.block.index not in self.complete and not force:
                return False
            self.next += 1
            if item.op is Op.ALL_GATHER:
                self._gather(item.block)
            else:
                self.g.reduce(item.block)
        return True

    def need(self, block: Any) -> bool:
        """Make ``block`` gathered and usable. False if its gather in this pass was already used."""
        i = self.ag_pos.get(block.index)
        if block.index not in self.pending:
            if i is None or i < self.next:
                return False
            self._advance(i, force=True)
        gather = self.pending.pop(block.index)
        self.deviated |= any(self.ag_pos[j] < i for j in self.pending)  # an earlier block is still waiting
        self.g.finish_gather(block, gather.handle, True)
        return True

    def prefetch_after(self, block: Any) -> None:
        """Issue the gather that follows ``block``'s, unless an incomplete reduce-scatter is in the way."""
        i = self.ag_pos.get(block.index)
        if i is None:
            return
        nxt = next((j for j in range(i + 1, len(self.items)) if self.items[j].op is Op.ALL_GATHER), None)
        if nxt is not None and nxt >= self.next:
            self._advance(nxt, force=False)

    def ready(self, block: Any) -> None:
        """``block``'s gradients are complete: release its gather, issue up to its reduce-scatter."""
        self.complete.add(block.index)
        if block.index in self.pending:  # gathered ahead but never used
            self.g.finish_gather(block, self.pending.pop(block.index).handle, False)
        self.g.free_gather(block)
        if block.index in self.rs_pos:
            self._advance(self.rs_pos[block.index], force=False)

    def flush(self) -> None:
        """Finish the pass: release unused gathers; issue (and release) everything not issued yet."""
        for gather in list(self.pending.values()):
            self._drop(gather)
        while self.next < len(self.items):
            item = self.items[self.next]
            self.next += 1
            if item.op is Op.REDUCE_SCATTER:
                self.g.reduce(item.block)
                continue
            self._gather(item.block)
            if len(self.pending) > 1:  # two gathers alive at most
                self._drop(next(iter(self.pending.values())))
        for gather in list(self.pending.values()):
            self._drop(gather)

    def _drop(self, gather: PendingGather) -> None:
        self.pending.pop(gather.block.index)
        self.g.finish_gather(gather.block, gather.handle, False)
        self.g.free_gather(gather.block)


class PassKind(Enum):
    TRAIN = "train"  # one micro-step: forward and backward
    EVAL = "eval"  # one forward under torch.no_grad()


class PassState(Enum):
    """How far a pass's forward has come."""

    IDLE = "idle"  # the model's forward has not started
    FORWARD = "forward"  # the model's forward is running
    FORWARD_DONE = "forward_done"  # the forward ran and its schedule is complete
    SKIPPED = "skipped"  # the forward schedule was completed without the model's forward starting

    @property
    def forward_over(self) -> bool:
        return self in (PassState.FORWARD_DONE, PassState.SKIPPED)


class Pass:
    """State of one forward (evaluation) or one micro-step (forward + backward)."""

    def __init__(self, kind: PassKind, fwd: Schedule, bwd: Schedule | None) -> None:
        self.kind, self.fwd, self.bwd = kind, fwd, bwd
        self.state = PassState.IDLE
        self.ran: set[int] = set()  # blocks whose forward ran
        self.pre_order: list[int] = []  # blocks in the order their forwards began
        self.post_order: list[int] = []  # ... and ended
        self.eval_scope = contextlib.ExitStack()  # an evaluation forward's ledger phase

    @property
    def train(self) -> bool:
        return self.kind is PassKind.TRAIN

    def finish_forward(self) -> None:
        """Issue what the forward schedule has left; the forward is over."""
        self.fwd.flush()
        self.state = PassState.FORWARD_DONE if self.state is PassState.FORWARD else PassState.SKIPPED
