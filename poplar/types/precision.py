"""Mixed-precision policies: in which dtype a rank computes, reduces gradients and keeps state.

``MixedPrecision(param_dtype, reduce_dtype, loss_scale, buffer_dtype)``: forward and backward run
on copies of the parameters in ``param_dtype``; master weights, gradient accumulation and
optimizer state stay fp32; gradients are reduced across ranks in ``reduce_dtype``; floating-point
buffers (rotary tables, running statistics) live in ``buffer_dtype`` (default ``param_dtype``, so
a model written for one dtype runs unchanged). fp16 needs loss scaling
(``LossScaleConfig``; dynamic by default, DeepSpeed's defaults); bf16 has fp32's range and
does not. ``resolve_precision`` turns the engine's ``mixed_precision=`` argument (``None``,
``"fp32"``, ``"bf16"``, ``"fp16"`` or a policy) into a policy or ``None`` (plain fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class Precision(str, Enum):
    """The compute precision of a policy, by its usual name."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}[self]

    @classmethod
    def of(cls, dtype: torch.dtype) -> "Precision":
        for p in cls:
            if p.dtype == dtype:
                return p
        raise ValueError(f"no precision for dtype {dtype}; use torch.float32, torch.bfloat16 or torch.float16")

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling. ``static_scale`` set: a fixed scale; otherwise dynamic: start at
    ``initial_scale``; an overflow (a non-finite gradient on any rank) skips the step and
    multiplies the scale by ``backoff`` (not below ``min_scale``) once ``hysteresis``
    consecutive overflows were seen; ``growth_interval`` overflow-free steps in a row multiply it
    by ``growth_factor``. Defaults are DeepSpeed's (``initial_scale_power`` 16,
    ``loss_scale_window`` 1000, ``hysteresis`` 2, ``min_loss_scale`` 1)."""

    initial_scale: float = 2.0 ** 16
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff: float = 0.5
    hysteresis: int = 2
    min_scale: float = 1.0
    static_scale: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.initial_scale > 0:
            problems.append(f"initial_scale must be > 0, got {self.initial_scale}")
        if self.growth_interval < 1:
            problems.append(f"growth_interval must be >= 1, got {self.growth_interval}")
        if not self.growth_factor > 1:
            problems.append(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff < 1:
            problems.append(f"backoff must be in (0, 1), got {self.backoff}")
        if self.hysteresis < 1:
            problems.append(f"hysteresis must be >= 1, got {self.hysteresis}")
        if not self.min_scale > 0:
            problems.append(f"min_scale must be > 0, got {self.min_scale}")
        if self.static_scale is not None and not self.static_scale > 0:
            problems.append(f"static_scale must be > 0 or None, got {self.static_scale}")
        if problems:
            raise ValueError("LossScaleConfig: " + "; ".join(problems))

    @property
    def dynamic(self) -> bool:
        return self.static_scale is None


@dataclass(frozen=True)
class MixedPrecision:
    """A precision policy (see the module docstring). ``loss_scale`` None means no loss scaling
    (right for fp32 and bf16); fp16 without it gets dynamic scaling with the defaults.
    ``buffer_dtype`` None means ``param_dtype``."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    loss_scale: LossScaleConfig | None = field(default=None)
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        Precision.of(self.param_dtype)
        Precision.of(self.reduce_dtype)
        if self.buffer_dtype is None:
            object.__setattr__(self, "buffer_dtype", self.param_dtype)
        Precision.of(self.buffer_dtype)
        if self.param_dtype == torch.float16 and self.loss_scale is None:
            object.__setattr__(self, "loss_scale", LossScaleConfig())

    @property
    def precision(self) -> Precision:
        return Precision.of(self.param_dtype)

    @property
    def low_precision(self) -> bool:
        """True when compute runs below fp32 (the runtime keeps separate fp32 master weights)."""
        return self.param_dtype != torch.float32

    def to_dict(self) -> dict[str, Any]:
        scale = self.loss_scale
        return {"param_dtype": str(Precision.of(self.param_dtype)), "reduce_dtype": str(Precision.of(self.reduce_dtype)),
                "buffer_dtype": str(Precision.of(self.buffer_dtype)),
                "loss_scale": None if scale is None else scale.__dict__.copy()}


def resolve_precision(value: Any) -> MixedPrecision | None:
    """The engine's ``mixed_precision=`` argument as a policy (None: plain fp32). Raises
    ValueError naming the accepted values."""
    if value is None or isinstance(value, MixedPrecision):
        return None if isinstance(value, MixedPrecision) and not value.low_precision and value.loss_scale is None \
            and value.reduce_dtype == torch.float32 and value.buffer_dtype == torch.float32 else value
    if isinstance(value, str):
        try:
            precision = Precision(value.lower())
        except ValueError:
            raise ValueError(f"mixed_precision={value!r}: use None, 'fp32', 'bf16', 'fp16' or a "
                             "poplar.MixedPrecision(param_dtype=..., reduce_dtype=...)") from None
        return None if precision is Precision.FP32 else MixedPrecision(param_dtype=precision.dtype)
    raise ValueError(f"mixed_precision must be None, 'bf16', 'fp16' or a poplar.MixedPrecision, got "
                     f"{type(value).__name__}")


def precision_of(value: Any) -> Precision:
    """The compute precision of ``value``: None (fp32), a ``Precision``, its name, or a
    ``MixedPrecision`` policy (its ``param_dtype``). ValueError naming the accepted values."""
    policy = resolve_precision(value)
    return Precision.FP32 if policy is None else policy.precision


def precision_unsupported_message(precision: Any, devices: dict[str, list[int]]) -> str:
    """The error for ``devices`` (device name -> its ranks, may be empty) that cannot compute in
    ``precision``: names them and what to use instead."""
    p = precision_of(precision)
    named = ", ".join(f"{name} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks
                      else name for name, ranks in devices.items())
    why = " (bf16 arithmetic needs compute capability 8.0: Ampere or newer)" if p is Precision.BF16 else ""
    return (f"{p} is not supported on {named}{why}. Use fp16 instead (mixed_precision=\"fp16\", with dynamic "
            f"loss scaling; in a DeepSpeed config \"fp16\": {{\"enabled\": true}}), or fp32, or leave those "
            "devices out")
