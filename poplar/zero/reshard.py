"""Moving a running stage's optimizer state to other shard weights, between iterations.

Each optimizer parameter of stages 1-3 is one unit's shard, so its per-element state (momentum,
Adam's moments: tensors shaped like the shard) is the same kind of thing as the shard itself:
gathered over the old layout into the unit's full flat, then cut by the new one. Other state
(Adam's ``step``) is the same on every rank and is kept. Every rank calls these together.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
from torch import nn

from poplar.comm import Communicator, DistributedError
from poplar.zero.flat import FlatUnit


def per_element(value: Any, shard: torch.Tensor) -> bool:
    """Whether an optimizer state value has one element per element of its shard parameter."""
    return torch.is_tensor(value) and value.dim() == 1 and value.shape == shard.shape


class UnitState(NamedTuple):
    """One unit's optimizer state over the whole unit: per-element values as full flats (the
    old layout's padded length), and the rest as it was."""

    flats: dict[str, torch.Tensor]
    other: dict[str, Any]


def gather_state(comm: Communicator, optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit],
                 shards: Sequence[nn.Parameter]) -> list[UnitState]:
    """Per unit, its optimizer state over the whole unit (a collective, every rank together).
    A rank that holds no part of a unit and has not stepped it (one a plan left out of the step,
    docs/design.md §3.12) holds no state for it: it takes the state's kinds from the ranks that do."""
    keys = [sorted(k for k, v in optimizer.state.get(sp, {}).items() if per_element(v, sp)) for sp in shards]
    stepped = [sp in optimizer.state for sp in shards]
    everyone = comm.all_gather_object((keys, stepped, [sp.numel() for sp in shards]), tag="reshard:keys")
    holders = [r for r, (_, s, _) in enumerate(everyone) if any(s)]
    if any(everyone[r][0] != everyone[holders[0]][0] for r in holders) or any(
            not any(s) and any(sizes) for _, s, sizes in everyone if holders):
        raise DistributedError("re-sharding: ranks hold different optimizer state (one has stepped, another not); "
                               "call set_plan on every rank between the same iterations")
    other_of = [{k: v for k, v in optimizer.state.get(sp, {}).items() if k not in ks} for sp, ks in zip(shards, keys)]
    if holders and len(holders) < comm.world_size:  # a rank that sat out takes the rest of the state too
        keys = everyone[holders[0]][0]
        other_of = comm.all_gather_object(other_of, tag="reshard:other")[holders[0]]
    out = []
    for u, sp, unit_keys, other in zip(units, shards, keys, other_of):
        state = optimizer.state.get(sp, {})
        flats = {}
        for k in unit_keys:
            value = state[k] if k in state else torch.zeros(0, dtype=sp.dtype, device=sp.device)
            flat = torch.zeros(u.padded_numel, dtype=value.dtype, device=value.device)
            comm.all_gather(flat, value.detach().contiguous(), tag=f"reshard:unit{u.index}", sizes=u.part_sizes)
            flats[k] = flat
        out.append(UnitState(flats, dict(other)))
    return out


def cut_state(optimizer: torch.optim.Optimizer, units: Sequence[FlatUnit], old: Sequence[nn.Parameter],
              new: Sequence[nn.Parameter], full: Sequence[UnitState]) -> None:
    """Give each new shard parameter its part of the unit's full state (new layout); drop the old."""
    for sp in old:
        optimizer.state.pop(sp, None)
    for u, sp, state in zip(units, new, full):
        if not state.flats and not state.other:
            continue
        cut: dict[str, Any] = dict(state.other)
        for k, flat in state.flats.items():
            cut[k] = shard_from(flat, u)
        optimizer.state[sp] = cut


def shard_from(flat: torch.Tensor, unit: FlatUnit) -> torch.Tensor:
    """This rank's shard (new layout) of a unit's full flat of another layout's padded length:
    the values it has, zeros beyond them (padding)."""
    lo, hi = unit.shard_range
    part = torch.zeros(hi - lo, dtype=flat.dtype, device=flat.device)
    have = flat[lo:min(hi, flat.numel())]
    part[:have.numel()].copy_(have)
    return part
