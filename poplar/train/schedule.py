"""Learning-rate schedules: linear or log warmup, then cosine, linear or no decay.

``LRSchedule.lr_at(k)`` is the learning rate of iteration k, a function of k and the schedule's
settings alone; ``fit(..., lr_schedule=...)`` sets it on every param group before iteration k.
Being a pure function of the iteration, a resumed run continues it exactly; what a checkpoint
holds (``state_dict``, JSON) is the settings, so a resume restores the schedule the run was
started with even when the caller builds another one (DeepSpeed and ``torch.optim`` restore a
scheduler's state the same way).

Shapes, with w = ``warmup_steps``, T = ``total_steps``, lo = ``min_lr``, hi = ``max_lr``:

- warmup, k < w: ``linear`` lo + (hi - lo)·k / w; ``log`` lo + (hi - lo)·log(k + 1) / log(w)
  (DeepSpeed's default ``warmup_type``);
- after it, ``cosine``: lo + (hi - lo)·(1 + cos(π·p)) / 2 with p = (k - w) / (T - w), clamped
  to [0, 1]; ``linear``: lo + (hi - lo)·(1 - p); ``constant``: hi.

DeepSpeed config schedulers map onto it (``from_deepspeed``): ``WarmupLR`` (warmup, then
constant), ``WarmupDecayLR`` (warmup, then linear decay back to
``warmup_min_lr`` at ``total_num_steps``) and ``WarmupCosineLR`` (warmup from ``warmup_min_ratio``·lr to lr,
then cosine to ``cos_min_ratio``·lr; its lr is the optimizer's).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class Decay(str, Enum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"


class Warmup(str, Enum):
    LINEAR = "linear"
    LOG = "log"


@dataclass(frozen=True)
class LRSchedule:
    """Warmup to ``max_lr`` over ``warmup_steps`` iterations, then ``decay`` to ``min_lr`` at
    ``total_steps`` (not needed for ``constant``)."""

    max_lr: float
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr: float = 0.0
    decay: Decay = Decay.COSINE
    warmup: Warmup = Warmup.LINEAR
    warmup_start_lr: float | None = None  # the lr at iteration 0 of the warmup; default min_lr

    def __post_init__(self) -> None:
        object.__setattr__(self, "decay", Decay(self.decay))
        object.__setattr__(self, "warmup", Warmup(self.warmup))
        for name in ("max_lr", "min_lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"LRSchedule: {name} must be a number >= 0, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"LRSchedule: warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.decay is not Decay.CONSTANT:
            if self.total_steps is None:
                raise ValueError(f"LRSchedule: {self.decay.value} decay needs total_steps (the iteration at which "
                                 "the lr reaches min_lr); use decay='constant' for none")
            if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) or \
                    self.total_steps < self.warmup_steps:
                raise ValueError(f"LRSchedule: total_steps must be an int >= warmup_steps ({self.warmup_steps}), "
                                 f"got {self.total_steps!r}")

    def lr_at(self, iteration: int) -> float:
        """The learning rate of ``iteration`` (0-based)."""
        hi, lo = float(self.max_lr), float(self.min_lr)
        w = self.warmup_steps
        if iteration < w:
            start = lo if self.warmup_start_lr is None else float(self.warmup_start_lr)
            if self.warmup is Warmup.LOG:
                frac = math.log(iteration + 1) / math.log(w) if w > 1 else 1.0
            else:
                frac = iteration / w
            return start + (hi - start) * frac
        if self.decay is Decay.CONSTANT:
            return hi
        span = max(1, int(self.total_steps or w) - w)
        p = min(1.0, max(0.0, (iteration - w) / span))
        if self.decay is Decay.COSINE:
            return lo + (hi - lo) * 0.5 * (1.0 + math.cos(math.pi * p))
        return lo + (hi - lo) * (1.0 - p)

    __call__ = lr_at

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The settings, JSON-safe."""
        d = asdict(self)
        d["decay"], d["warmup"] = self.decay.value, self.warmup.value
        return d

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "LRSchedule":
        return cls(**state)

    # ------------------------------------------------------------------ DeepSpeed configs
    @classmethod
    def from_deepspeed(cls, kind: str, params: dict[str, Any], optimizer_lr: float | None = None) -> "LRSchedule":
        """The schedule of a DeepSpeed ``scheduler`` section (see the module doc); ``optimizer_lr``
        is the optimizer's lr, which ``WarmupCosineLR`` scales."""
        p = dict(params)
        steps = int(p.get("warmup_num_steps", 1000))
        warmup = Warmup(p.get("warmup_type", "log"))
        if kind in ("WarmupLR", "WarmupDecayLR"):
            lo, hi = float(p.get("warmup_min_lr", 0.0)), float(p.get("warmup_max_lr", 1e-3))
            if kind == "WarmupLR":
                return cls(max_lr=hi, warmup_steps=steps, min_lr=lo, decay=Decay.CONSTANT, warmup=warmup)
            total = int(p["total_num_steps"])
            return cls(max_lr=hi, warmup_steps=steps, total_steps=max(total, steps), min_lr=lo, decay=Decay.LINEAR,
                       warmup=warmup)
        if kind == "WarmupCosineLR":
            lr = 1e-3 if optimizer_lr is None else float(optimizer_lr)
            total = int(p["total_num_steps"])
            return cls(max_lr=lr, warmup_steps=steps, total_steps=max(total, steps),
                       min_lr=lr * float(p.get("cos_min_ratio", 1e-4)), decay=Decay.COSINE, warmup=warmup,
                       warmup_start_lr=lr * float(p.get("warmup_min_ratio", 0.0)))
        raise ValueError(f"unknown scheduler {kind!r}; use WarmupLR, WarmupDecayLR or WarmupCosineLR")


def apply_lr(optimizer: Any, lr: float) -> None:
    """Set ``lr`` on every param group of ``optimizer``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
