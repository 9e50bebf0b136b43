"""ZeRO stage 1: every rank holds the full parameters and accumulates full flat gradients; each
unit's gradient is reduce-scattered once per iteration, the optimizer steps this rank's shard (of
the optimizer state and, under mixed precision, of the fp32 master), and the updated shards are
all-gathered.

[Note: the closing reduction overlaps the last backward]
In the engine's ``train_step`` the runtime says which micro-step is this rank's last
(``last_micro_step``). In its backward each unit's flat gradient is final as soon as its
gradients (and those of every earlier unit) have arrived, so it is reduce-scattered then,
asynchronously, in the fixed unit order, as stage 2 does in every micro-step: the sum travels
while backward computes the earlier layers, as DDP's buckets do. What backward did not reach
(unused parameters), a rank with no micro-step, one whose micro-step failed, and loops of the
user's own (``backward``/``step``) send the rest in ``close_micro_steps``, before the iteration's
status reduction; so every rank issues the same reduce-scatters in the same order, once per
iteration. The reduced shards are kept apart until the status is agreed: the non-finite check
reads the local gradients, and an iteration that fails or skips drops them. The reduce-scatters
are stamped as the iteration's closing collectives in the ledger, as before: they are once per
iteration, whatever micro-step they overlap.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from poplar.comm import PendingCollective, Phase
from poplar.zero.replicated import LocalGrads


class SentReduce(NamedTuple):
    """A reduce-scatter in flight (None: already complete) and the bytes of its wire copy (and of
    what a hierarchical call stages)."""

    work: PendingCollective | None
    wire_bytes: int


class Stage1(LocalGrads):
    stage = 1
    grads_sharded = True
    master_sharded = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shard_params = self._shard_params()
        self._reset_reduction()

    def _reset_reduction(self) -> None:
        self._overlapping = False  # in this rank's last micro-step: units go out as backward fills them
        self._ready = [0] * len(self.units)
        self._next = 0  # the next unit to reduce-scatter
        self._in_flight: list[SentReduce] = []
        self._reduced: list[torch.Tensor | None] = [None] * len(self.units)

    def last_micro_step(self) -> None:
        self._overlapping = True

    def _grad_ready(self, ui: int, si: int, grad: torch.Tensor) -> None:
        if ui < self._next:
            raise RuntimeError(
                f"a gradient of '{self.units[ui].names[si]}' arrived after its unit was reduced; at ZeRO-1 "
                "train_step runs one backward per micro-step of the plan's row")
        super()._grad_ready(ui, si, grad)
        if self._overlapping:
            self._ready[ui] += 1
            while self._next < len(self.units) and self._ready[self._next] >= len(self.units[self._next].params):
                self._issue(self._next)

    def _issue(self, ui: int) -> None:
        """Reduce-scatter unit ``ui``'s flat gradient into a shard kept apart (async)."""
        u, g = self.units[ui], self.flat_grads[ui]
        self._settle(ui)
        wire = self.precision.for_reduce(g)  # the gradient itself, or its copy in the reduce dtype
        out = u.new_shard(wire.dtype, zero=False)  # the reduce-scatter writes all of it
        wire_bytes = wire.numel() * wire.element_size() if wire is not g else 0
        wire_bytes += self.comm.staging_bytes("reduce_scatter", u.part_sizes, u.shard_numel, wire.element_size())
        self._hold(out.numel() * out.element_size() + wire_bytes)
        with self.comm.ledger.scope(Phase.STEP, micro_step=-1):  # the iteration's closing reduction
            work = self.comm.reduce_scatter(out, wire, tag=f"unit{u.index}", async_op=True, sizes=u.part_sizes)
        self._in_flight.append(SentReduce(work, wire_bytes))
        self._reduced[ui] = out
        self._next = ui + 1

    def end_micro_step(self) -> None:
        if self._overlapping:  # unused parameters: their gradients are final too
            while self._next < len(self.units):
                self._issue(self._next)

    def close_micro_steps(self) -> None:
        while self._next < len(self.units):
            self._issue(self._next)
        for work, wire_bytes in self._in_flight:
            if work is not None:
                work.wait()
            self._release(wire_bytes)
        self._in_flight = []

    def reduce_gradients(self) -> None:
        for ui, (u, g, s) in enumerate(zip(self.units, self.flat_grads, self.shard_params)):
            out = self._reduced[ui]
            assert out is not None, "close_micro_steps runs before the reduction is read"
            shard = u.shard_of(g)
            shard.copy_(out)
            self._release(out.numel() * out.element_size())
            s.grad = shard
        self._reduced = [None] * len(self.units)

    def grad_tensors(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shard_params]

    def optimizer_step(self) -> None:
        self.offload.step()
        self.sync_params()

    def zero_grad(self) -> None:
        super().zero_grad()
        for s in self.shard_params:
            s.grad = None
        for out in self._reduced:  # a skipped or failed iteration's reduced shards
            if out is not None:
                self._release(out.numel() * out.element_size())
        self._reset_reduction()
