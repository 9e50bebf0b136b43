"""Saved activations of a virtual device: every tensor autograd saves for backward, counted
once per storage (``torch.autograd.graph.saved_tensors_hooks``), released from the count when
autograd drops it. Parameters and views of them are model states (counted from the runtime's
``memory_report``), not activations: tensors that are ``nn.Parameter`` (or views of one) and
tensors in the storages the parameters live in (``param_keys``, set at each forward start) are
passed through uncounted.

Activation checkpointing: tensors saved inside a checkpointed module never reach these hooks
(torch's checkpoint saves its own placeholders), only the module's inputs do, which is the
memory saved for real. Their recomputation in backward saves them again through torch's own
hooks, which detach each one: ``recomputed()`` is a dispatch mode, entered around each
recomputation, that counts those detached tensors (once per storage) until autograd drops them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class _Saved:
    """What autograd keeps for one saved tensor: a detached alias (no reference cycle through the
    graph) and the storage it pins, released from the count when autograd drops it."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: "SavedTensors") -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        try:
            self.owner.unref(self.key)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class SavedTensors:
    """The count of saved-activation bytes; ``on_saved()`` runs after each newly counted tensor
    (the device's memory check)."""

    def __init__(self, on_saved: Callable[[], None], on_recomputed: Callable[[], None] | None = None) -> None:
        self.on_saved = on_saved
        self.on_recomputed = on_recomputed or on_saved  # after a tensor a recomputation saved
        self.bytes = 0
        self.param_keys: set[int] = set()  # storages of parameters (flat buffers), as of the forward start
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def unref(self, key: int) -> None:
        n = self._refs.get(key, 0) - 1
        if n <= 0:
            self._refs.pop(key, None)
            self.bytes -= self._sizes.pop(key, 0)
        else:
            self._refs[key] = n

    def recomputed(self) -> "RecomputeCounter":
        """A dispatch mode counting what a checkpointed module's recomputation saves."""
        return RecomputeCounter(self)

    def count(self, t: torch.Tensor) -> int | None:
        """Count ``t``'s storage once more; its key, or None for a tensor that is no activation."""
        base = t._base
        if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter) or t.device.type != "cpu":
            return None  # parameters (and views of them) are model states, counted already
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.param_keys:
            return None
        # an integer tensor (token ids, labels, masks) is an input, not an activation: the rank's
        # whole batch shares its storage, so count the micro-batch's own span, as the capacity
        # search (which runs one micro-batch alone) sees it
        nbytes = storage.nbytes() if t.is_floating_point() else min(storage.nbytes(), t.numel() * t.element_size())
        if key in self._refs:
            self._refs[key] += 1
        else:
            self._refs[key] = 1
            self._sizes[key] = nbytes
            self.bytes += nbytes
        return key

    def pack(self, t: torch.Tensor) -> Any:
        key = self.count(t)
        if key is None:
            return t
        handle = _Saved(t.detach(), key, self)
        self.on_saved()
        return handle

    @staticmethod
    def unpack(handle: Any) -> torch.Tensor:
        return handle.tensor if isinstance(handle, _Saved) else handle


class RecomputeCounter(TorchDispatchMode):
    """Counts each tensor torch's checkpoint detaches while it recomputes (what it saves), until
    the detached tensor is freed."""

    def __init__(self, owner: SavedTensors) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.detach.default and isinstance(out, torch.Tensor):
            key = self.owner.count(args[0])
            if key is not None:
                weakref.finalize(out, self.owner.unref, key)
                self.owner.on_recomputed()
        return out
