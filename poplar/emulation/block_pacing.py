"""Block boundaries of a ZeRO-3 model for a virtual device's per-block speed padding.

At ZeRO-3 every wrapped block is an all-gather in the forward and an all-gather plus a
reduce-scatter in the backward, so the ranks meet once per block. A real GPU reaches each of
those points when its own speed says; a virtual device that pads a pass once at its end makes
the ranks meet at their real CPU compute instead. ``BlockHooks`` tells the device when a block
is about to run forward and when its backward begins, both *before* the stage's own hooks (the
ones that wait for the block's gather), so the device can sleep first and the rank arrives at
the collective on the emulated curve.

The hooks are ordinary module hooks, prepended: a forward pre-hook per block (boundary before
its forward) and a forward hook that registers a gradient hook on the block's outputs, which
fires when the block's backward begins (before the stage's own, registered later).

``Fractions`` learns where the boundaries fall: the share of a pass's real compute done before
each boundary, per micro-step size (an average over micro-steps). The device pads boundary k to
that share of the pass's emulated time. Measured real compute, not parameter counts, because
the compute outside blocks (the embedding, a language-model head, the loss) and inside them
(attention grows with the sequence, parameters do not) is not proportional to parameters, and
the CPU's time splits like the GPU's FLOPs do for matmul-bound models.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

LEARN_WEIGHT = 0.3  # weight of the newest micro-step in the learned shares


class BlockPaced(Protocol):
    """What ``BlockHooks`` calls: the device's pacing points."""

    def block_forward(self) -> None:
        ...

    def block_forward_end(self) -> bool:
        """A block's forward returned; True: call ``block_backward`` when its backward begins."""
        ...

    def block_backward(self) -> None:
        ...


class Fractions:
    """Per micro-step size, the share of a pass's real compute done before each boundary, and
    the pass's real compute (averages over the passes seen)."""

    def __init__(self) -> None:
        self._by_batch: dict[tuple[int, int], list[float]] = {}
        self._total: dict[tuple[int, int], float] = {}

    def get(self, batch: int, count: int) -> list[float] | None:
        """The learned shares for ``count`` boundaries at ``batch`` samples (None: none yet),
        made non-decreasing from the right: one pass that stalled before a boundary must not
        pace that boundary beyond the ones after it."""
        shares = self._by_batch.get((batch, count))
        if shares is None:
            return None
        out, low = [], 1.0
        for share in reversed(shares):
            low = min(low, share)
            out.append(low)
        return out[::-1]

    def real_s(self, batch: int, count: int) -> float | None:
        """The pass's learned real compute seconds (None: none yet)."""
        return self._total.get((batch, count))

    def learn(self, batch: int, marks: list[float], total: float) -> None:
        """Record one pass: real compute seconds at each boundary, and in the whole pass."""
        if not marks or total <= 0:
            return
        key = (batch, len(marks))
        new = [min(max(m / total, 0.0), 1.0) for m in marks]
        seen = self._by_batch.get(key)
        self._by_batch[key] = new if seen is None else [
            (1 - LEARN_WEIGHT) * s + LEARN_WEIGHT * n for s, n in zip(seen, new)]
        old = self._total.get(key)
        self._total[key] = total if old is None else (1 - LEARN_WEIGHT) * old + LEARN_WEIGHT * total


class BlockHooks:
    """Prepended hooks on the blocks named ``names`` (``ZeroStage.block_names()``) of ``module``;
    ``remove()`` takes them off."""

    def __init__(self, module: nn.Module, names: list[str], paced: BlockPaced) -> None:
        self.count = len(names)
        self._paced = paced
        self._handles: list[Any] = []
        for name in names:
            block = module.get_submodule(name)
            self._handles.append(block.register_forward_pre_hook(self._pre, prepend=True))
            self._handles.append(block.register_forward_hook(self._post, prepend=True))

    def _pre(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._paced.block_forward()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors and self._paced.block_forward_end():
            register_multi_grad_hook(tensors, partial(_backward_begins, self._paced), mode="any")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _backward_begins(paced: BlockPaced, grad: Any) -> None:
    paced.block_backward()
