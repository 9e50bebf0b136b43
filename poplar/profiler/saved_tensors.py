"""Saved activations of a virtual device: every tensor autograd saves for backward, counted
once per storage (``torch.autograd.graph.saved_tensors_hooks``), released from the count when
autograd drops it. Parameters and views of them are model states (counted from the runtime's
``memory_report``), not activations: tensors that are ``nn.Parameter`` (or views of one) and
tensors in the storages the parameters live in (``param_keys``, set at each forward start) are
passed through uncounted.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


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

    def __init__(self, on_saved: Callable[[], None]) -> None:
        self.on_saved = on_saved
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

    def pack(self, t: torch.Tensor) -> Any:
        base = t._base
        if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter) or t.device.type != "cpu":
            return t  # parameters (and views of them) are model states, counted already
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.param_keys:
            return t
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
        handle = _Saved(t.detach(), key, self)
        self.on_saved()
        return handle

    @staticmethod
    def unpack(handle: Any) -> torch.Tensor:
        return handle.tensor if isinstance(handle, _Saved) else handle
