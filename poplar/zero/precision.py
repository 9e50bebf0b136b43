"""Mixed precision inside the ZeRO stages: the dtypes a stage keeps and sends, and the model's
tensors that are not trained (frozen parameters, buffers) in the compute dtype.

A policy (``poplar.types.precision.MixedPrecision``) below fp32 gives each stage a separate
master: the trained parameters the model sees are low-precision copies (views into a flat
compute buffer at stages 0-2, the gathered buffer at stage 3) and the fp32 values the optimizer
steps are kept apart (docs/design.md §3.7). ``StagePrecision`` is what a stage needs of the
policy; without one every field is None and every stage runs its fp32 code unchanged.

``ModelCast`` puts frozen parameters and floating-point buffers into the compute dtype, so
the whole forward runs in one dtype, and keeps what ``full_state_dict`` must return in the
model's own dtypes: frozen parameters exactly (their originals), buffers cast back (they may
change in training, e.g. running statistics). ``cast_inputs`` casts the model's floating-point
inputs likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from poplar.types.precision import MixedPrecision


@dataclass(frozen=True)
class StagePrecision:
    """``compute``: dtype of the parameters forward and backward see (None: the trained dtype
    itself, no separate master). ``reduce``: dtype gradients travel in (None: their own)."""

    compute: torch.dtype | None = None
    reduce: torch.dtype | None = None
    buffers: torch.dtype | None = None

    @classmethod
    def of(cls, policy: MixedPrecision | None) -> "StagePrecision":
        if policy is None:
            return cls()
        compute = policy.param_dtype if policy.low_precision else None
        reduce = policy.reduce_dtype if policy.reduce_dtype != torch.float32 else None
        buffers = policy.buffer_dtype if policy.buffer_dtype != torch.float32 else None
        return cls(compute, reduce, buffers)

    @property
    def separate_master(self) -> bool:
        return self.compute is not None

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        return master if self.compute is None else self.compute

    def reduce_dtype(self, grad: torch.dtype) -> torch.dtype:
        return grad if self.reduce is None else self.reduce

    def for_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` as the collective sends it: itself, or a copy in the reduce dtype."""
        return grad if self.reduce is None or grad.dtype == self.reduce else grad.to(self.reduce)


class ModelCast:
    """Frozen parameters and floating-point buffers of ``model`` moved to the compute dtypes."""

    def __init__(self, model: nn.Module, precision: StagePrecision) -> None:
        assert precision.compute is not None
        self.frozen: dict[int, torch.Tensor] = {}  # id(parameter) -> its value in the model's own dtype
        self.buffer_dtypes: dict[int, torch.dtype] = {}  # id(buffer) -> the model's own dtype
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad and p.is_floating_point():
                    self.frozen[id(p)] = p.data
                    p.data = p.data.to(precision.compute)
            for b in model.buffers() if precision.buffers is not None else ():
                if b.is_floating_point() and id(b) not in self.buffer_dtypes:
                    self.buffer_dtypes[id(b)] = b.dtype
                    b.data = b.data.to(precision.buffers)

    @property
    def master_bytes(self) -> int:
        """Bytes of the frozen parameters' originals (the compute copies count as parameters)."""
        return sum(t.numel() * t.element_size() for t in self.frozen.values())

    def owns(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.frozen or id(tensor) in self.buffer_dtypes

    def original(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (a model parameter or buffer) in the model's own dtype."""
        if id(tensor) in self.frozen:
            return self.frozen[id(tensor)].clone()
        dtype = self.buffer_dtypes.get(id(tensor), tensor.dtype)
        return tensor.detach().to(dtype, copy=True)

    def original_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        """The dtype ``original`` gives ``tensor``."""
        if id(tensor) in self.frozen:
            return self.frozen[id(tensor)].dtype
        return self.buffer_dtypes.get(id(tensor), tensor.dtype)

    def load(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``tensor`` (a model parameter or buffer) from ``value``, originals included."""
        if id(tensor) in self.frozen:
            self.frozen[id(tensor)].copy_(value)
        tensor.detach().copy_(value)


def cast_inputs(dtype: torch.dtype) -> Any:
    """A forward pre-hook (``with_kwargs=True``) casting floating-point inputs to ``dtype``."""

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook
