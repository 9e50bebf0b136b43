"""Clipping by the global gradient norm, with the step's gradient divisor folded in.

The gradients a rank holds after ``reduce_gradients`` are the full reduced gradients (stage 0)
or its shards (stages 1-3, whose squared norms are summed over ranks in one all-reduce). They
are ``divisor`` times the true gradients: the fp16 loss scale, times the global count when the
losses were (loss_sum, count) pairs (docs/design.md §2). The norm is divided by the divisor, and
the division and the clipping coefficient become one multiply of each buffer.
"""

from __future__ import annotations

import torch

from poplar.comm import Communicator


def clip_and_unscale(grads: list[torch.Tensor], comm: Communicator, sharded: bool, max_norm: float | None,
                     divisor: float = 1.0) -> float | None:
    """Divide ``grads`` by ``divisor`` and clip them to ``max_norm`` (None: no clipping), in place.
    Returns the global norm of the divided gradients before clipping (None without clipping)."""
    if max_norm is None:
        if divisor != 1.0:
            for g in grads:
                g.mul_(1.0 / divisor)
        return None
    sq = torch.zeros((), dtype=torch.float64, device=comm.device)
    for g in grads:
        sq += g.detach().double().pow(2).sum()
    if sharded:
        sq = sq.reshape(1)
        comm.all_reduce(sq, tag="grad_norm")
    norm = float(sq.sum().sqrt()) / divisor
    coef = max_norm / (norm + 1e-6)
    factor = min(coef, 1.0) / divisor
    if factor != 1.0:
        for g in grads:
            g.mul_(factor)
    return norm
