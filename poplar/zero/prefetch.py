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
has, and gradients arriving later are reduced once per iteration (``late`` in ``Stage3``).
``prefetch_after(b)`` issues up to the next gather but never passes an incomplete block's
reduce-scatter; ``ready(b)`` issues up to b's reduce-scatter once b's gradients are complete.
``flush()`` issues what is left, keeping at most two gathers alive, and releases gathers that
were never used. Each rank therefore issues exactly this list once per pass, whatever its hooks
did: no mismatch, and no hang (a rank only ever waits on collectives it has issued, and every
rank issues the same list in the same order).
"""

from __future__ import annotations

from typing import Any, Protocol


class Gatherer(Protocol):
    def start_gather(self, block: Any) -> Any: ...
    def finish_gather(self, block: Any, handle: Any, use: bool) -> None: ...
    def free_gather(self, block: Any) -> None: ...
    def gathered_hook(self, block: Any) -> None: ...
    def reduce(self, block: Any) -> None: ...


def forward_items(root: Any, order: list[Any]) -> list[tuple[str, Any]]:
    return ([("ag", root)] if root is not None else []) + [("ag", b) for b in order]


def backward_items(root: Any, order: list[Any]) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for i, b in enumerate(order):
        items.append(("ag", b))
        if i > 0:
            items.append(("rs", order[i - 1]))
    if order:
        items.append(("rs", order[-1]))
    if root is not None:
        items.append(("rs", root))
    return items


class Schedule:
    def __init__(self, items: list[tuple[str, Any]], g: Gatherer) -> None:
        self.items, self.g = items, g
        self.ag_pos = {b.index: i for i, (op, b) in enumerate(items) if op == "ag"}
        self.rs_pos = {b.index: i for i, (op, b) in enumerate(items) if op == "rs"}
        self.next = 0  # items[:next] have been issued
        self.pending: dict[int, tuple[Any, Any]] = {}  # gathers issued, not yet used: index -> (block, handle)
        self.complete: set[int] = set()  # blocks whose gradients are complete
        self.deviated = False  # a block was needed ahead of its turn

    def _advance(self, upto: int, force: bool) -> bool:
        """Issue items up to position ``upto``; without ``force`` stop before the reduce-scatter of
        an incomplete block. True if everything up to ``upto`` is issued."""
        while self.next <= upto:
            op, b = self.items[self.next]
            if op == "ag":
                self.pending[b.index] = (b, self.g.start_gather(b))
                self.next += 1
                self.g.gathered_hook(b)
            else:
                if b.index not in self.complete and not force:
                    return False
                self.next += 1
                self.g.reduce(b)
        return True

    def need(self, block: Any) -> bool:
        """Make ``block`` gathered and usable. False if its gather in this pass was already used."""
        i = self.ag_pos.get(block.index)
        if block.index not in self.pending:
            if i is None or i < self.next:
                return False
            self._advance(i, force=True)
        _, handle = self.pending.pop(block.index)
        self.deviated |= any(self.ag_pos[j] < i for j in self.pending)  # an earlier block is still waiting
        self.g.finish_gather(block, handle, True)
        return True

    def prefetch_after(self, block: Any) -> None:
        """Issue the gather that follows ``block``'s, unless an incomplete reduce-scatter is in the way."""
        i = self.ag_pos.get(block.index)
        if i is None:
            return
        nxt = next((j for j in range(i + 1, len(self.items)) if self.items[j][0] == "ag"), None)
        if nxt is not None and nxt >= self.next:
            self._advance(nxt, force=False)

    def ready(self, block: Any) -> None:
        """``block``'s gradients are complete: release its gather, issue up to its reduce-scatter."""
        self.complete.add(block.index)
        if block.index in self.pending:  # gathered ahead but never used
            _, handle = self.pending.pop(block.index)
            self.g.finish_gather(block, handle, False)
        self.g.free_gather(block)
        if block.index in self.rs_pos:
            self._advance(self.rs_pos[block.index], force=False)

    def flush(self) -> None:
        """Finish the pass: release unused gathers; issue (and release) everything not issued yet."""
        for b, handle in list(self.pending.values()):
            self._drop(b, handle)
        while self.next < len(self.items):
            op, b = self.items[self.next]
            self.next += 1
            if op == "rs":
                self.g.reduce(b)
                continue
            self.pending[b.index] = (b, self.g.start_gather(b))
            self.g.gathered_hook(b)
            if len(self.pending) > 1:  # two gathers alive at most
                self._drop(*next(iter(self.pending.values())))
        for b, handle in list(self.pending.values()):
            self._drop(b, handle)

    def _drop(self, b: Any, handle: Any) -> None:
        self.pending.pop(b.index)
        self.g.finish_gather(b, handle, False)
        self.g.free_gather(b)
