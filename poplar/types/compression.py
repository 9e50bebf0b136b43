"""Compressed collectives: which of ZeRO's collectives send block-quantized values, and where.

Two directions, one switch each (``CommPolicy``):

- ``weights``: ZeRO-3's parameter all-gathers (the forward and backward gathers of a block's
  parameters). Only the gathered copy used for compute is quantized; the sharded master
  parameters, and the all-gathers of updated parameters at ZeRO-1/2, stay exact.
- ``gradients``: the gradient reduce-scatters of ZeRO-2/3. Each rank quantizes what it sends;
  the receiver dequantizes every part and sums them in fp32 (never in the quantized type).

``scope`` says which bytes are quantized: ``CROSS_NODE`` only those that cross between nodes
(the exchange of a hierarchical collective, or the whole of a flat collective on a topology that
spans nodes; nothing on one node), ``EVERY_STEP`` every byte of the collective (weights only: a
gradient quantized inside a node would be quantized twice).

Quantization is lossy: the step is no longer exactly the step of the whole global batch. It is
off unless a user turns it on (``Plan.compression``, the DeepSpeed keys
``zero_quantized_weights`` / ``zero_quantized_gradients``), and auto mode chooses it only with
``AutoOptions(allow_lossy=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Iterable


class CompressionError(ValueError):
    """A compression setting that cannot be used; the message names the fix."""


class QuantBits(Enum):
    """The values a quantized collective sends: none (exact), or signed integers of 8 or 4 bits
    with one fp32 scale per block."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        return {QuantBits.NONE: 0, QuantBits.INT8: 8, QuantBits.INT4: 4}[self]

    @property
    def levels(self) -> int:
        """The largest magnitude a quantized value takes: 127 (int8), 7 (int4)."""
        return (1 << (self.bits - 1)) - 1 if self.bits else 0


class QuantScope(Enum):
    """Which bytes of a quantized collective are quantized (module doc)."""

    CROSS_NODE = "cross_node"
    EVERY_STEP = "every_step"


# A block of 256 elements with one fp32 scale each: the scales add 1/64 to int8's bytes (4 / 256)
# while a block stays small enough that one outlier coarsens only its own 256 neighbours.
DEFAULT_BLOCK = 256


@dataclass(frozen=True)
class Quantization:
    """One collective's quantization: the type sent, the elements per scale, and the scope.
    ``tensor_starts``: where each parameter of the collective's buffer starts (sorted); blocks
    begin there, so no block holds two parameters (``poplar.comm.quantize``, Note: blocks do not
    straddle parameters). Empty: blocks from each quantized window's start only."""

    bits: QuantBits = QuantBits.INT8
    block_size: int = DEFAULT_BLOCK
    scope: QuantScope = QuantScope.CROSS_NODE
    tensor_starts: tuple[int, ...] = ()

    def cut_at(self, starts: Iterable[int]) -> "Quantization":
        """This quantization on a buffer whose parameters start at ``starts``."""
        return replace(self, tensor_starts=tuple(sorted(set(starts))))

    def within(self, lo: int) -> "Quantization":
        """This quantization on the sub-buffer that starts at element ``lo`` of its buffer."""
        return replace(self, tensor_starts=tuple(s - lo for s in self.tensor_starts if s > lo))

    def wire_bytes(self, numel: int) -> int:
        """Bytes on the wire for ``numel`` quantized elements: the packed values and one fp32
        scale per block (a partial last block has its own). A buffer cut at its parameters
        (``tensor_starts``) sends at most one more scale per parameter boundary: the planner
        prices with this, the ledger records what was sent."""
        if numel <= 0:
            return 0
        blocks = -(-numel // self.block_size)
        return -(-numel * self.bits.bits // 8) + 4 * blocks


def _enum(kind: type[Enum], value: Any, field: str) -> Any:
    if isinstance(value, kind):
        return value
    try:
        return kind(str(value).lower())
    except ValueError:
        names = ", ".join(repr(k.value) for k in kind)
        raise CompressionError(f"CommPolicy {field}={value!r}: give one of {names}") from None


@dataclass(frozen=True)
class CommPolicy:
    """Which collectives are quantized (module doc). ``CommPolicy()`` is exact: every collective
    sends the values as they are. Strings are accepted for the enums (``weights="int8"``)."""

    weights: QuantBits = QuantBits.NONE
    gradients: QuantBits = QuantBits.NONE
    weights_scope: QuantScope = QuantScope.CROSS_NODE
    block_size: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        # the constructor is a door: names become enums here, once
        object.__setattr__(self, "weights", _enum(QuantBits, self.weights, "weights"))
        object.__setattr__(self, "gradients", _enum(QuantBits, self.gradients, "gradients"))
        object.__setattr__(self, "weights_scope", _enum(QuantScope, self.weights_scope, "weights_scope"))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 16 \
                or self.block_size % 16:
            raise CompressionError(f"CommPolicy block_size={self.block_size!r}: give a multiple of 16 elements, "
                                   f"at least 16 (default {DEFAULT_BLOCK})")

    @property
    def lossy(self) -> bool:
        """Whether any collective is quantized."""
        return self.weights is not QuantBits.NONE or self.gradients is not QuantBits.NONE

    @property
    def weight_quantization(self) -> Quantization | None:
        """The quantization of ZeRO-3's parameter all-gathers, or None (exact)."""
        if self.weights is QuantBits.NONE:
            return None
        return Quantization(self.weights, self.block_size, self.weights_scope)

    @property
    def gradient_quantization(self) -> Quantization | None:
        """The quantization of the gradient reduce-scatters (cross-node only), or None (exact)."""
        if self.gradients is QuantBits.NONE:
            return None
        return Quantization(self.gradients, self.block_size, QuantScope.CROSS_NODE)

    def problem(self, zero_stage: int | None) -> str | None:
        """Why this policy cannot run at ``zero_stage`` (None: not known yet), or None."""
        if zero_stage is None:
            return None
        if self.weights is not QuantBits.NONE and zero_stage != 3:
            return (f"quantized weights (CommPolicy weights={self.weights.value!r}) quantize ZeRO-3's parameter "
                    f"gathers, but the stage is ZeRO-{zero_stage}: use zero_stage=3, or weights='none'")
        if self.gradients is not QuantBits.NONE and zero_stage not in (2, 3):
            return (f"quantized gradients (CommPolicy gradients={self.gradients.value!r}) quantize the gradient "
                    f"reduce-scatter of ZeRO-2/3, but the stage is ZeRO-{zero_stage}: use zero_stage=2 or 3, or "
                    "gradients='none'")
        return None

    def describe(self) -> str:
        """A short line for plan tables: what is quantized, or "exact"."""
        if not self.lossy:
            return "exact"
        parts = []
        if self.weights is not QuantBits.NONE:
            where = "" if self.weights_scope is QuantScope.CROSS_NODE else ", every step"
            parts.append(f"weights {self.weights.value}{where}")
        if self.gradients is not QuantBits.NONE:
            parts.append(f"gradients {self.gradients.value}")
        return "quantized " + " and ".join(parts) + f" (blocks of {self.block_size})"

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights.value, "gradients": self.gradients.value,
                "weights_scope": self.weights_scope.value, "block_size": self.block_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CommPolicy":
        try:
            return cls(**d)
        except TypeError as e:
            raise CompressionError(f"malformed compression record: {e}; give weights, gradients, weights_scope "
                                   "and block_size") from None


EXACT = CommPolicy()
