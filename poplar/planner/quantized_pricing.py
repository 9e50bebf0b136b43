"""Quantized collectives priced: the bytes a block-quantized reduce-scatter or all-gather puts on
the wire, and the work of quantizing and dequantizing them (docs/design.md §5.2).

A collective of ``numel`` elements that a ``CommPolicy`` quantizes sends
``Quantization.wire_bytes(numel)`` (packed values and one fp32 scale per block) where it would
send ``numel`` x the element size. Which bytes: with ``QuantScope.CROSS_NODE`` those of the
cross-node step of a hierarchical collective, or the whole of a flat collective on a topology that
spans nodes (nothing on one node); with ``QuantScope.EVERY_STEP`` every byte. Which collectives:
ZeRO-3's parameter all-gathers (``weights``, compute dtype) and the gradient reduce-scatters of
ZeRO-2/3 (``gradients``, the reduce dtype). A policy reaches the cost model only at a stage it
admits (``CommPolicy.problem``), so there every all-gather is a parameter gather (ZeRO-3) and every
reduce-scatter a gradient reduction (ZeRO-2/3); ZeRO-2's all-gather of updated parameters and
every all-reduce stay exact.

[Note: the conversion cost]
Quantizing and dequantizing is work the exact collective does not do: the sender reads the exact
values and writes the packed ones, every receiver reads the packed values and writes exact ones
(at ZeRO-2/3 it also adds them into an fp32 sum). That is memory-bound elementwise work of about
``2 (itemsize + 1)`` bytes per element, and the model charges it on the whole buffer, per
collective, at ``CONVERSION_BYTES_PER_S``: an upper bound (a rank converts its part and the parts
it receives, not always all of them), so a lossy option must win on the link by more than it.
250 GB/s is about three quarters of the memory bandwidth of the slowest card in the presets
(T4, 320 GB/s); an elementwise kernel reaches that, and a faster card does the work sooner, so
on any of the presets' GPUs the model overstates it. It is not measured by the profiler and was
not tuned on the CPU emulator (whose conversions run on the host's cores at their own speed): a
GPU user pays at most this. Over a slow link it is small beside the bytes saved (10 Gbit/s: an
fp32 element takes 3.2 ns to send, its conversion 0.04 ns); over a link as fast as a card's
memory it outweighs them, and the exact collective is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from poplar.types.compression import EXACT, CommPolicy, Quantization, QuantScope

CONVERSION_BYTES_PER_S = 250e9  # Note: the conversion cost


@dataclass(frozen=True)
class QuantizedWire:
    """One quantized collective's pricing: its quantization and the element size of its exact
    buffer (bytes of the buffer over ``itemsize``: its elements)."""

    quantization: Quantization
    itemsize: float

    @property
    def every_step(self) -> bool:
        return self.quantization.scope is QuantScope.EVERY_STEP

    def numel(self, nbytes: float) -> int:
        return max(0, round(nbytes / self.itemsize))

    def bytes(self, nbytes: float) -> float:
        """The wire bytes of an exact buffer of ``nbytes`` bytes, quantized."""
        return float(self.quantization.wire_bytes(self.numel(nbytes)))

    def conversion_s(self, nbytes: float) -> float:
        """Quantizing and dequantizing the buffer (Note: the conversion cost)."""
        return self.numel(nbytes) * 2 * (self.itemsize + 1) / CONVERSION_BYTES_PER_S


@dataclass(frozen=True)
class Compression:
    """A plan's quantized collectives as the cost model prices them: the ``policy`` and the
    element sizes of the buffers it quantizes: ZeRO-3's gathered parameters (the compute dtype),
    the reduced gradients (the reduce dtype), and the formulas' buffers (``param_bytes`` over
    ``param_count``: the model's full copy, where the profile recorded no collectives)."""

    policy: CommPolicy = EXACT
    gather_itemsize: float = 4.0
    reduce_itemsize: float = 4.0
    table_itemsize: float = 4.0

    @classmethod
    def of(cls, profile: object, policy: CommPolicy) -> "Compression":
        """``policy`` on the buffers of ``profile`` (its precision, reduce dtype and model size)."""
        precision = getattr(profile, "precision", "fp32")
        mixed = getattr(profile, "mixed_precision", None) or {}
        reduce = 2.0 if str(mixed.get("reduce_dtype", "fp32")) in ("bf16", "fp16") else 4.0
        count = getattr(profile, "param_count", 0) or 0
        table = float(getattr(profile, "param_bytes", 0)) / count if count > 0 else 4.0
        return cls(policy, 2.0 if precision in ("bf16", "fp16") else 4.0, reduce, table or 4.0)

    @property
    def lossy(self) -> bool:
        return self.policy.lossy

    def exact(self) -> "Compression":
        """The same buffers, sent exact."""
        return Compression(EXACT, self.gather_itemsize, self.reduce_itemsize, self.table_itemsize)

    def wire(self, op: str, table: bool = False) -> QuantizedWire | None:
        """How collective ``op`` is quantized (None: exact); ``table``: a buffer of the formulas."""
        quant = {"all_gather": self.policy.weight_quantization,
                 "reduce_scatter": self.policy.gradient_quantization}.get(op)
        if quant is None:
            return None
        itemsize = self.table_itemsize if table else (
            self.gather_itemsize if op == "all_gather" else self.reduce_itemsize)
        return QuantizedWire(quant, itemsize)


NO_COMPRESSION = Compression()
