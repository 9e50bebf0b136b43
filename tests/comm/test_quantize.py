"""Block-wise quantization (``poplar.comm.quantize``) in one process: every element within half
its block's scale, exact where the values are representable, zeros exact, non-finite blocks
non-finite, int4 packed two per byte, a partial last block, windows of a quantized tensor, and
blocks cut at the parameters of a buffer (no block holds two parameters)."""

from __future__ import annotations

import pytest
import torch

from poplar.comm.quantize import (blocks_of, dequantize, from_wire, pack_window, quantize, to_wire, unpack_window,
                                  window_nbytes, wire_nbytes)
from poplar.types.compression import QuantBits, Quantization

SPECS = [Quantization(QuantBits.INT8, 16), Quantization(QuantBits.INT4, 16), Quantization(QuantBits.INT8, 256)]


def _block_scales(x: torch.Tensor, spec: Quantization) -> torch.Tensor:
    """Each element's block scale, computed here from its definition (absmax / levels)."""
    out = torch.empty(x.numel())
    for lo in range(0, x.numel(), spec.block_size):
        block = x.reshape(-1)[lo:lo + spec.block_size].float()
        out[lo:lo + block.numel()] = block.abs().max() / spec.bits.levels
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.bits.value}-{s.block_size}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_within_half_a_step(spec: Quantization, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, generator=g) * torch.rand(1000, generator=g) * 10).to(dtype)  # 1000: a partial last block
    q = quantize(x, spec)
    assert q.scales.numel() == -(-1000 // spec.block_size) and q.scales.dtype == torch.float32
    assert q.values.dtype == torch.uint8 and q.values.numel() == 1000 * spec.bits.bits // 8
    back = dequantize(q)
    scale = _block_scales(x, spec)
    error = (back - x.float()).abs()
    # half a step, and fp32's rounding of the division and the product (a few ulps of x)
    assert torch.all(error <= scale / 2 + x.float().abs() * 2 ** -22), (error - scale / 2).max()
    assert error.max() > scale.max() / 100  # it does quantize: not a copy
    assert torch.equal(from_wire(to_wire(x, spec), 1000, spec), back)
    assert to_wire(x, spec).numel() == spec.wire_bytes(1000)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.bits.value}-{s.block_size}")
def test_exact_where_representable(spec: Quantization) -> None:
    levels, n = spec.bits.levels, 3 * spec.block_size + 5
    x = torch.randint(-levels, levels + 1, (n,), generator=torch.Generator().manual_seed(1)).float()
    x[::spec.block_size] = levels  # every block's absmax is ``levels``: scale 1, every integer exact
    assert torch.equal(dequantize(quantize(x, spec)), x)
    halves = x * 0.5  # absmax levels / 2: scale 1/2, exact in binary
    assert torch.equal(dequantize(quantize(halves, spec)), halves)


def test_zero_blocks_and_nonfinite_blocks() -> None:
    spec = Quantization(QuantBits.INT8, 16)
    x = torch.randn(64)
    x[:16] = 0.0  # block 0 all zero
    x[20] = float("inf")  # block 1 holds inf
    x[40] = float("nan")  # block 2 holds NaN
    q = quantize(x, spec)
    back = dequantize(q)
    assert q.scales[0] == 0 and torch.equal(back[:16], torch.zeros(16))
    assert not torch.isfinite(back[16:48]).any()  # every element of a non-finite block
    scale = _block_scales(x[48:], spec)
    assert torch.all((back[48:] - x[48:]).abs() <= scale / 2 + x[48:].abs() * 2 ** -22)
    assert torch.equal(dequantize(quantize(torch.zeros(0), spec)), torch.zeros(0))


def test_int4_packs_two_per_byte() -> None:
    spec = Quantization(QuantBits.INT4, 16)
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, -3.0] + [0.0] * 12)  # 17: an odd count, a block of one
    q = quantize(x, spec)
    assert q.values.numel() == 9
    assert q.values[0].item() == (7 + 8) | ((-7 + 8) << 4)  # element 0 low nibble, element 1 high
    assert q.values[1].item() == (1 + 8) | ((0 + 8) << 4)
    assert torch.equal(dequantize(q), x)
    assert spec.wire_bytes(17) == 9 + 2 * 4


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s.bits.value)
def test_windows_of_a_quantized_tensor(spec: Quantization) -> None:
    x = torch.randn(77, generator=torch.Generator().manual_seed(2))
    q = quantize(x, spec)
    whole = dequantize(q)
    for a, b in ((0, 77), (3, 40), (17, 18), (15, 33), (32, 77), (5, 5)):
        payload = pack_window(q, a, b)
        assert payload.numel() == window_nbytes(a, b, spec.bits, q.layout)
        assert torch.equal(unpack_window(payload, a, b, spec.bits, q.layout), whole[a:b])
    with pytest.raises(ValueError, match="INT8 or INT4"):
        quantize(x, Quantization(QuantBits.NONE))


def test_blocks_begin_at_the_window_and_at_every_parameter() -> None:
    spec = Quantization(QuantBits.INT8, 16).cut_at([50, 0, 10, 10])
    assert spec.tensor_starts == (0, 10, 50)
    layout = blocks_of(spec, 5, 60)  # elements 5..64: parameters start at 10 and 50 inside it
    assert layout.cuts == (0, 5, 45) and layout.firsts == (0, 1, 4) and layout.nblocks == 5
    assert [layout.block_of(i) for i in (0, 4, 5, 20, 21, 44, 45, 59)] == [0, 0, 1, 1, 2, 3, 4, 4]
    assert blocks_of(Quantization(QuantBits.INT8, 16), 5, 60).cuts == (0,)  # no parameters: from the start
    assert spec.within(10).tensor_starts == (40,)


def _param_scales(x: torch.Tensor, spec: Quantization, cuts: list[int]) -> torch.Tensor:
    """Each element's block scale with blocks cut at ``cuts`` (from the definition)."""
    return torch.cat([_block_scales(x[c:e], spec) for c, e in zip(cuts, cuts[1:] + [x.numel()])])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.bits.value}-{s.block_size}")
def test_no_block_holds_two_parameters(spec: Quantization) -> None:
    """A norm's gain (ones) beside a projection of std 0.008: cut at the parameters, the
    projection is quantized on its own scale; cut only from the window's start, a block holding
    both rounds the projection's elements to steps of 1/levels (the test fails that way)."""
    g = torch.Generator().manual_seed(3)
    gain, proj = torch.ones(40), torch.randn(700, generator=g) * 0.008
    x = torch.cat([torch.randn(30, generator=g) * 0.02, gain, proj])
    at = 13  # the window's start in its buffer, off the block grid
    cut = spec.cut_at([at, at + 30, at + 70, at + 770])  # a parameter past the window is ignored
    back = dequantize(quantize(x, cut, at))
    bound = _param_scales(x, spec, [0, 30, 70]) / 2 + x.abs() * 2 ** -22
    assert torch.all((back - x).abs() <= bound)
    assert torch.equal(back[30:70], gain)  # ones: representable on their own scale
    straddled = (dequantize(quantize(x, spec, at)) - x).abs()
    assert not torch.all(straddled <= bound)  # blocks from the window's start only break the bound
    assert to_wire(x, cut, at).numel() == wire_nbytes(cut, at, 770) == spec.wire_bytes(30) + \
        spec.wire_bytes(40) + spec.wire_bytes(700)
    assert torch.equal(from_wire(to_wire(x, cut, at), 770, cut, at), back)
    q = quantize(x, cut, at)
    for a, b in ((0, 770), (25, 75), (29, 31), (69, 300), (100, 101)):
        payload = pack_window(q, a, b)
        assert payload.numel() == window_nbytes(a, b, spec.bits, q.layout)
        assert torch.equal(unpack_window(payload, a, b, spec.bits, blocks_of(cut, at, 770)), back[a:b])
