"""Block-wise symmetric quantization, and the bytes a quantized collective sends.

A tensor of n elements is cut into blocks of ``block_size`` consecutive elements (the last may be
shorter). Each block gets one fp32 scale, ``absmax / levels`` (``levels`` = 127 for int8, 7 for
int4), and each element the integer ``round(x / scale)`` clamped to ``[-levels, levels]``. The
value sent back is ``q * scale``, so an element's error is at most ``scale / 2`` (half a step;
plus fp32's rounding of the division and the product, a few ulps of the value), and a block's scale depends on that block alone: one outlier coarsens only its own block.

- Exact where representable: a block whose values are integer multiples of its scale (e.g.
  integers with block absmax = ``levels``) dequantizes to the same values.
- An all-zero block has scale 0 and dequantizes to exact zeros (no 0 / 0).
- A block holding inf or NaN has a non-finite scale and dequantizes to NaN in every element: a
  quantized collective never hides a non-finite value from the runtime's non-finite check.
- int4 packs two values per byte (element 2i in the low nibble, 2i + 1 in the high one), each
  stored as ``q + 8``.

The wire format of a *window* ``[a, b)`` of a quantized tensor (what one transfer sends) is one
uint8 tensor: the fp32 scales of the blocks the window touches, then the value bytes covering it
(int4: from the byte holding element ``a``). A window of a whole tensor is exactly
``Quantization.wire_bytes(n)`` bytes; a window cut out of a larger tensor mid-block carries the
scales of the blocks it touches (and at most one extra int4 value).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from poplar.types.compression import QuantBits, Quantization


class Quantized(NamedTuple):
    """A block-quantized tensor: ``values`` (uint8: int8's bytes, or two int4 per byte),
    ``scales`` (fp32, one per block), and what they describe."""

    values: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: QuantBits
    block_size: int


def _check(spec: Quantization) -> None:
    if spec.bits is QuantBits.NONE:
        raise ValueError("quantize needs QuantBits.INT8 or INT4; QuantBits.NONE sends values as they are")


def quantize(x: torch.Tensor, spec: Quantization) -> Quantized:
    """``x`` (any float dtype, any shape; read flat) block-quantized by ``spec``."""
    _check(spec)
    n, block, levels = x.numel(), spec.block_size, spec.bits.levels
    blocks = -(-n // block)
    flat = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    flat[:n].copy_(x.reshape(-1))
    rows = flat.view(blocks, block)
    # amax propagates NaN and inf: such a block's scale is non-finite (module doc)
    scales = rows.abs().amax(dim=1) / levels if blocks else torch.zeros(0, device=x.device)
    usable = (scales > 0) & torch.isfinite(scales)
    safe = torch.where(usable, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-levels, levels)
    q = torch.where(usable[:, None], q, torch.zeros_like(q)).to(torch.int8).reshape(-1)[:n]
    if spec.bits is QuantBits.INT8:
        values = q.view(torch.uint8)
    else:
        u = (q.to(torch.int16) + 8).to(torch.uint8)
        if n % 2:
            u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=x.device)])
        values = u[0::2] | (u[1::2] << 4)
    return Quantized(values, scales, n, spec.bits, block)


def _integers(values: torch.Tensor, bits: QuantBits) -> torch.Tensor:
    """The signed integers of ``values`` (int4: two per byte, low nibble first), as fp32."""
    if bits is QuantBits.INT8:
        return values.view(torch.int8).to(torch.float32)
    pairs = torch.stack([values & 15, values >> 4], dim=1).reshape(-1)
    return pairs.to(torch.float32) - 8


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 values ``q`` stands for (``numel`` long)."""
    return _scaled(_integers(q.values, q.bits)[:q.numel], q.scales, 0, q.block_size)


def _scaled(ints: torch.Tensor, scales: torch.Tensor, offset: int, block: int) -> torch.Tensor:
    """``ints`` times their blocks' scales; ``ints[0]`` lies ``offset`` elements into the block of
    ``scales[0]``."""
    n = ints.numel()
    if not n:
        return ints
    per = scales.repeat_interleave(block)[offset:offset + n]
    # 0 * inf or 0 * NaN is NaN: a non-finite block stays non-finite in every element
    return ints * per


def _window_blocks(a: int, b: int, block: int) -> tuple[int, int]:
    return a // block, (b - 1) // block + 1


def _window_value_bytes(a: int, b: int, bits: QuantBits) -> tuple[int, int]:
    return (a, b) if bits is QuantBits.INT8 else (a // 2, -(-b // 2))


def window_nbytes(a: int, b: int, bits: QuantBits, block: int) -> int:
    """Bytes of the wire form of elements ``[a, b)`` of a quantized tensor (0 when empty)."""
    if b <= a:
        return 0
    lo, hi = _window_blocks(a, b, block)
    va, vb = _window_value_bytes(a, b, bits)
    return 4 * (hi - lo) + vb - va


def pack_window(q: Quantized, a: int, b: int) -> torch.Tensor:
    """The wire form of elements ``[a, b)`` of ``q``: its blocks' scales, then the value bytes."""
    if b <= a:
        return torch.empty(0, dtype=torch.uint8, device=q.values.device)
    lo, hi = _window_blocks(a, b, q.block_size)
    va, vb = _window_value_bytes(a, b, q.bits)
    return torch.cat([q.scales[lo:hi].contiguous().view(torch.uint8), q.values[va:vb]])


def unpack_window(payload: torch.Tensor, a: int, b: int, bits: QuantBits, block: int) -> torch.Tensor:
    """The fp32 values of elements ``[a, b)`` from their wire form (``pack_window``'s)."""
    if b <= a:
        return torch.empty(0, dtype=torch.float32, device=payload.device)
    lo, hi = _window_blocks(a, b, block)
    scales = payload[:4 * (hi - lo)].clone().view(torch.float32)  # clone: the slice may sit unaligned
    ints = _integers(payload[4 * (hi - lo):], bits)
    skip = a - 2 * (a // 2) if bits is QuantBits.INT4 else 0
    return _scaled(ints[skip:skip + b - a], scales, a - lo * block, block)


def to_wire(x: torch.Tensor, spec: Quantization) -> torch.Tensor:
    """``x`` quantized and packed whole: ``spec.wire_bytes(x.numel())`` bytes."""
    return pack_window(quantize(x, spec), 0, x.numel())


def from_wire(payload: torch.Tensor, numel: int, spec: Quantization) -> torch.Tensor:
    """The fp32 values of ``to_wire``'s ``payload`` of ``numel`` elements."""
    return unpack_window(payload, 0, numel, spec.bits, spec.block_size)
