"""The speed curves a virtual device pads its compute to: seconds of one micro-step of ``b``
samples. Picklable (spawned ranks get them inside their devices).

- ``SaturatingCurve``: the presets' shape with explicit numbers (tests, custom devices); the
  same at every precision.
- ``PresetCurve``: a preset's curve (``poplar.emulation.presets``) at a precision, times a scale;
  fp16 / bf16 divide the throughput part by the preset's dtype factor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from poplar.types.precision import Precision
from poplar.emulation.presets import get_preset


@dataclass(frozen=True)
class SaturatingCurve:
    """t(b) = overhead_s + (b + half_batch) / peak_speed: speed rises with the batch and flattens
    at ``peak_speed`` (the shape of the presets' curves)."""

    overhead_s: float
    half_batch: float
    peak_speed: float

    def __call__(self, batch: int) -> float:
        return 0.0 if batch <= 0 else self.overhead_s + (batch + self.half_batch) / self.peak_speed


@dataclass(frozen=True)
class PresetCurve:
    """A preset's speed curve at ``precision`` with its times multiplied by ``time_scale``."""

    preset: str
    time_scale: float
    precision: Precision = Precision.FP32

    def __call__(self, batch: int) -> float:
        return get_preset(self.preset).time_s(batch, precision=self.precision) * self.time_scale

    def at(self, precision: Precision) -> "PresetCurve":
        """The same device's curve at ``precision`` (PresetError if the preset lacks it)."""
        get_preset(self.preset).dtype_factor(precision)
        return replace(self, precision=precision)
