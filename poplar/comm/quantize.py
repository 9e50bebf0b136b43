"""Block-wise symmetric quantization, and the bytes a quantized collective sends.

A tensor of n elements is cut into blocks of at most ``block_size`` consecutive elements. Each
block gets one fp32 scale, ``absmax / levels`` (``levels`` = 127 for int8, 7 for int4), and each
element the integer ``round(x / scale)`` clamped to ``[-levels, levels]``. The value sent back is
``q * scale``, so an element's error is at most ``scale / 2`` (half a step; plus fp32's rounding
of the division and the product, a few ulps of the value), and a block's scale depends on that
block alone: one outlier coarsens only its own block.

Where blocks begin (``BlockLayout``): at the tensor's start, at every parameter's start inside
it (``Quantization.tensor_starts``), and every ``block_size`` elements after either. A block
therefore never holds two parameters.

[Note: blocks do not straddle parameters]
A flat buffer of a model puts parameters of very different magnitudes side by side: a norm's
gain (values near 1) next to an output projection initialised at std 0.008. A block that held
both would take its scale from the gain, and the projection's elements in it would be rounded
to steps of 1/127: most of them to 0. On llama-tiny with blocks of 256 cut from a part's start
regardless of parameters, that made the relative error of whole projection matrices 5-9 %,
against at most 0.7 % with blocks cut at the parameters. Cutting at the parameters costs at most
one more scale (4 bytes) per parameter boundary inside a transfer.

- Exact where representable: a block whose values are integer multiples of its scale (e.g.
  integers with block absmax = ``levels``) dequantizes to the same values.
- An all-zero block has scale 0 and dequantizes to exact zeros (no 0 / 0).
- A block holding inf or NaN has a non-finite scale and dequantizes to NaN in every element: a
  quantized collective never hides a non-finite value from the runtime's non-finite check.
- int4 packs two values per byte (element 2i in the low nibble, 2i + 1 in the high one), each
  stored as ``q + 8``.

Coordinates: a collective quantizes windows ``[at, at + n)`` of one buffer (a rank's part, a
transfer's piece); ``at`` places the window in the buffer so that its blocks begin where the
buffer's parameters do. Sender and receiver compute the same ``BlockLayout`` from the same
``(spec, at, n)``.

The wire format of a *window* ``[a, b)`` of a quantized tensor (what one transfer sends) is one
uint8 tensor: the fp32 scales of the blocks the window touches, then the value bytes covering it
(int4: from the byte holding element ``a``). A window of a whole tensor is exactly
``wire_nbytes(spec, at, n)`` bytes; a window cut out of a larger tensor mid-block carries the
scales of the blocks it touches (and at most one extra int4 value).
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

import torch

from poplar.types.compression import QuantBits, Quantization


class BlockLayout(NamedTuple):
    """The blocks of a tensor of ``numel`` elements: segments start at ``cuts`` (0 first; each a
    parameter's start or the tensor's), each cut into blocks of ``block`` elements from its start
    (its last block may be shorter); ``firsts[i]`` is the index of segment i's first block."""

    cuts: tuple[int, ...]
    firsts: tuple[int, ...]
    numel: int
    block: int
    nblocks: int

    def segments(self) -> list[tuple[int, int, int]]:
        """(start, end, index of its first block) of every segment."""
        ends = self.cuts[1:] + (self.numel,)
        return list(zip(self.cuts, ends, self.firsts))

    def block_of(self, i: int) -> int:
        """The index of the block holding element ``i``."""
        s = bisect.bisect_right(self.cuts, i) - 1
        return self.firsts[s] + (i - self.cuts[s]) // self.block


@functools.lru_cache(maxsize=4096)
def blocks_of(spec: Quantization, at: int, n: int) -> BlockLayout:
    """The blocks of the window ``[at, at + n)`` of a buffer whose parameters start at
    ``spec.tensor_starts`` (module doc): the same on the sender and the receiver."""
    starts, block = spec.tensor_starts, spec.block_size
    inside = starts[bisect.bisect_right(starts, at):bisect.bisect_left(starts, at + n)]
    cuts = (0,) + tuple(s - at for s in inside) if n > 0 else ()
    firsts, count = [], 0
    for c, e in zip(cuts, cuts[1:] + (n,)):
        firsts.append(count)
        count += -(-(e - c) // block)
    return BlockLayout(cuts, tuple(firsts), n, block, count)


class Quantized(NamedTuple):
    """A block-quantized tensor: ``values`` (uint8: int8's bytes, or two int4 per byte),
    ``scales`` (fp32, one per block of ``layout``), and what they describe."""

    values: torch.Tensor
    scales: torch.Tensor
    layout: BlockLayout
    bits: QuantBits

    @property
    def numel(self) -> int:
        return self.layout.numel


def _check(spec: Quantization) -> None:
    if spec.bits is QuantBits.NONE:
        raise ValueError("quantize needs QuantBits.INT8 or INT4; QuantBits.NONE sends values as they are")


def _padded(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``x`` as fp32 rows of ``block`` elements, one per block, each segment from a row's start
    (the rest of a segment's last row is 0)."""
    block = layout.block
    rows = torch.zeros(layout.nblocks * block, dtype=torch.float32, device=x.device)
    flat = x.reshape(-1)
    for c, e, k in layout.segments():
        rows[k * block:k * block + e - c].copy_(flat[c:e])
    return rows.view(layout.nblocks, block)


def _unpadded(rows: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The elements of ``_padded``'s rows back in the tensor's order."""
    flat, block = rows.reshape(-1), layout.block
    if len(layout.cuts) <= 1:
        return flat[:layout.numel]
    return torch.cat([flat[k * block:k * block + e - c] for c, e, k in layout.segments()])


def quantize(x: torch.Tensor, spec: Quantization, at: int = 0) -> Quantized:
    """``x`` (any float dtype, any shape; read flat), the window at ``at`` of its buffer (module
    doc: coordinates), block-quantized by ``spec``."""
    _check(spec)
    n, levels = x.numel(), spec.bits.levels
    layout = blocks_of(spec, at, n)
    rows = _padded(x, layout)
    # amax propagates NaN and inf: such a block's scale is non-finite (module doc)
    scales = rows.abs().amax(dim=1) / levels if layout.nblocks else torch.zeros(0, device=x.device)
    usable = (scales > 0) & torch.isfinite(scales)
    safe = torch.where(usable, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-levels, levels)
    q = _unpadded(torch.where(usable[:, None], q, torch.zeros_like(q)), layout).to(torch.int8)
    if spec.bits is QuantBits.INT8:
        values = q.view(torch.uint8)
    else:
        u = (q.to(torch.int16) + 8).to(torch.uint8)
        if n % 2:
            u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=x.device)])
        values = u[0::2] | (u[1::2] << 4)
    return Quantized(values, scales, layout, spec.bits)


def _integers(values: torch.Tensor, bits: QuantBits) -> torch.Tensor:
    """The signed integers of ``values`` (int4: two per byte, low nibble first), as fp32."""
    if bits is QuantBits.INT8:
        return values.view(torch.int8).to(torch.float32)
    pairs = torch.stack([values & 15, values >> 4], dim=1).reshape(-1)
    return pairs.to(torch.float32) - 8


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 values ``q`` stands for (``numel`` long)."""
    return _scaled(_integers(q.values, q.bits)[:q.numel], q.scales, q.layout, 0, 0)


def _scaled(ints: torch.Tensor, scales: torch.Tensor, layout: BlockLayout, a: int, first: int) -> torch.Tensor:
    """``ints`` (elements ``[a, a + len)`` of a tensor of ``layout``) times their blocks' scales;
    ``scales[0]`` is block ``first``'s."""
    n, block = ints.numel(), layout.block
    if not n:
        return ints
    b, per = a + n, []
    for c, e, k in layout.segments():
        lo, hi = max(a, c), min(b, e)
        if lo < hi:
            k0 = k + (lo - c) // block - first
            k1 = k + (hi - 1 - c) // block + 1 - first
            skip = (lo - c) % block
            per.append(scales[k0:k1].repeat_interleave(block)[skip:skip + hi - lo])
    # 0 * inf or 0 * NaN is NaN: a non-finite block stays non-finite in every element
    return ints * (per[0] if len(per) == 1 else torch.cat(per))


def _window_blocks(a: int, b: int, layout: BlockLayout) -> tuple[int, int]:
    return layout.block_of(a), layout.block_of(b - 1) + 1


def _window_value_bytes(a: int, b: int, bits: QuantBits) -> tuple[int, int]:
    return (a, b) if bits is QuantBits.INT8 else (a // 2, -(-b // 2))


def window_nbytes(a: int, b: int, bits: QuantBits, layout: BlockLayout) -> int:
    """Bytes of the wire form of elements ``[a, b)`` of a quantized tensor of ``layout`` (0 when
    empty)."""
    if b <= a:
        return 0
    lo, hi = _window_blocks(a, b, layout)
    va, vb = _window_value_bytes(a, b, bits)
    return 4 * (hi - lo) + vb - va


def wire_nbytes(spec: Quantization, at: int, n: int) -> int:
    """Bytes of the wire form of the whole window ``[at, at + n)`` of a buffer, quantized."""
    return window_nbytes(0, n, spec.bits, blocks_of(spec, at, n))


def pack_window(q: Quantized, a: int, b: int) -> torch.Tensor:
    """The wire form of elements ``[a, b)`` of ``q``: its blocks' scales, then the value bytes."""
    if b <= a:
        return torch.empty(0, dtype=torch.uint8, device=q.values.device)
    lo, hi = _window_blocks(a, b, q.layout)
    va, vb = _window_value_bytes(a, b, q.bits)
    return torch.cat([q.scales[lo:hi].contiguous().view(torch.uint8), q.values[va:vb]])


def unpack_window(payload: torch.Tensor, a: int, b: int, bits: QuantBits, layout: BlockLayout) -> torch.Tensor:
    """The fp32 values of elements ``[a, b)`` of a tensor of ``layout`` from their wire form
    (``pack_window``'s)."""
    if b <= a:
        return torch.empty(0, dtype=torch.float32, device=payload.device)
    lo, hi = _window_blocks(a, b, layout)
    scales = payload[:4 * (hi - lo)].clone().view(torch.float32)  # clone: the slice may sit unaligned
    ints = _integers(payload[4 * (hi - lo):], bits)
    skip = a - 2 * (a // 2) if bits is QuantBits.INT4 else 0
    return _scaled(ints[skip:skip + b - a], scales, layout, a, lo)


def to_wire(x: torch.Tensor, spec: Quantization, at: int = 0) -> torch.Tensor:
    """``x``, the window at ``at`` of its buffer, quantized and packed whole:
    ``wire_nbytes(spec, at, x.numel())`` bytes."""
    return pack_window(quantize(x, spec, at), 0, x.numel())


def from_wire(payload: torch.Tensor, numel: int, spec: Quantization, at: int = 0) -> torch.Tensor:
    """The fp32 values of ``to_wire``'s ``payload`` of ``numel`` elements at ``at``."""
    return unpack_window(payload, 0, numel, spec.bits, blocks_of(spec, at, numel))
