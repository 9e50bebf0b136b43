"""fp16 loss scaling: the scale the loss is multiplied by before backward, and its updates.

fp16 holds numbers from about 6e-8 to 65504, and small gradients underflow to zero. The runtime
multiplies the loss by ``scale`` before backward, so every gradient is ``scale`` times larger
while in fp16, and multiplies the reduced fp32 gradients by 1/scale once before clipping and the
step. Too large a scale overflows: some gradient becomes inf or NaN on some rank. That verdict
travels in the iteration's status reduction (docs/design.md §3.4), so every rank skips the same
step and updates its scaler the same way; the scale is the same float on every rank.

Dynamic scaling (``LossScaleConfig``, DeepSpeed's rule): an overflow backs the scale off by
``backoff`` (not below ``min_scale``) once ``hysteresis`` overflows came in a row (the ones before
skip the step and keep the scale); ``growth_interval`` overflow-free steps in a row multiply it
by ``growth_factor``. A static scale never changes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from poplar.types.precision import LossScaleConfig


@dataclass
class LossScaleState:
    """What a checkpoint keeps of a scaler."""

    scale: float
    good_steps: int = 0  # overflow-free steps since the last overflow or growth
    hysteresis_left: int = 1  # overflows still tolerated before the next back-off


class LossScaler:
    """The loss scale of one run (the same on every rank)."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        initial = config.initial_scale if config.static_scale is None else config.static_scale
        self.state = LossScaleState(float(initial), 0, config.hysteresis)

    @property
    def scale(self) -> float:
        return self.state.scale

    @property
    def at_minimum(self) -> bool:
        """True when an overflow can no longer be answered by a smaller scale (a static scale
        never gets smaller): the overflow is then a real problem, not the scaler's business."""
        return not self.config.dynamic or self.state.scale <= self.config.min_scale

    def on_overflow(self) -> None:
        """A step skipped for a non-finite gradient or loss on some rank."""
        c, s = self.config, self.state
        if not c.dynamic:
            return
        s.good_steps = 0
        if s.hysteresis_left > 1:
            s.hysteresis_left -= 1
        else:
            s.scale = max(s.scale * c.backoff, c.min_scale)

    def on_good_step(self) -> None:
        """A step taken with finite gradients everywhere."""
        c, s = self.config, self.state
        if not c.dynamic:
            return
        s.hysteresis_left = c.hysteresis
        s.good_steps += 1
        if s.good_steps >= c.growth_interval:
            s.scale *= c.growth_factor
            s.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s result (of a run with any world size or stage)."""
        self.state = LossScaleState(float(state["scale"]), int(state["good_steps"]), int(state["hysteresis_left"]))
