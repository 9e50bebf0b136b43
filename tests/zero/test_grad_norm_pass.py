"""The gradient norm's pass (``zero.runtime.square_sum``): rows of fp32 norms summed in float64
agree with a float64 pass over every element, for buffers of any length and dtype."""

from __future__ import annotations

import torch

from poplar.zero.runtime import NORM_ROW, square_sum

CPU = torch.device("cpu")


def _float64(grads: list[torch.Tensor]) -> float:
    return sum(float(g.double().pow(2).sum()) for g in grads)


def test_the_row_norms_agree_with_a_float64_pass() -> None:
    gen = torch.Generator().manual_seed(0)
    # one buffer longer than a single fp32 reduction holds to 1e-6 (it was 1.4e-3 off at 25 M
    # elements), one with a partial last row, one shorter than a row, one empty, a 2-D one
    grads = [torch.randn(3_000_000, generator=gen) * 1e-3, torch.randn(5 * NORM_ROW + 7, generator=gen),
             torch.randn(10, generator=gen), torch.zeros(0), torch.randn(33, 65, generator=gen)]
    got = square_sum(grads, CPU)
    assert got.dtype == torch.float64 and got.shape == ()
    assert abs(float(got) / _float64(grads) - 1) < 1e-8


def test_two_byte_and_float64_buffers_and_no_buffers() -> None:
    g16 = torch.randn(3 * NORM_ROW + 1, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert abs(float(square_sum([g16], CPU)) / _float64([g16]) - 1) < 1e-6
    g64 = torch.randn(2 * NORM_ROW, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert abs(float(square_sum([g64], CPU)) / _float64([g64]) - 1) < 1e-12
    assert float(square_sum([], CPU)) == 0.0
