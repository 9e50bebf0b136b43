"""Flat parameter units: the layout every ZeRO stage shards.

A ``FlatUnit`` is a list of parameters of one optimizer param group (one dtype, one device)
laid out back to back in one flat buffer, padded; rank r owns the contiguous slice its
``ShardLayout`` gives it, cut by the unit's ``Shards`` (``poplar.zero.shard_layout``:
``[r*S, (r+1)*S)`` with S = padded / N under even shard weights, a share in proportion to the
weight otherwise). Stages 0-2 cut the model into units by
a bucket size (the units are the gradient buckets); stage 3 makes one unit per wrapped block.
Padding is zero and stays zero (its gradient is zero), so it never changes a norm or a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from poplar.zero.shard_layout import ShardLayout, Shards


@dataclass
class FlatUnit:
    params: list[nn.Parameter]
    names: list[str]
    group_index: int  # optimizer param group the unit's parameters belong to
    shards: Shards  # how the unit is cut among the ranks
    rank: int
    index: int = 0
    shapes: list[torch.Size] = field(init=False)
    offsets: list[int] = field(init=False)
    numel: int = field(init=False)
    padded_numel: int = field(init=False)
    layout: ShardLayout = field(init=False)

    def __post_init__(self) -> None:
        self.shapes = [p.shape for p in self.params]
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        p0 = self.params[0]
        self.dtype, self.device = p0.dtype, p0.device
        if not 0 <= self.rank < self.shards.world_size:
            raise ValueError(f"rank {self.rank} of a unit cut among {self.shards.world_size} ranks")
        self.layout = self.shards.layout(off, p0.element_size())
        self.padded_numel = self.layout.padded_numel
        self.slot_of = {id(p): i for i, p in enumerate(self.params)}

    def set_shards(self, shards: Shards) -> None:
        """Cut the unit by other shards (the padded length may change with them)."""
        self.shards = shards
        self.layout = shards.layout(self.numel, self.element_size)
        self.padded_numel = self.layout.padded_numel

    @property
    def world_size(self) -> int:
        return self.shards.world_size

    @property
    def shard_numel(self) -> int:
        """This rank's shard length."""
        return self.layout.size(self.rank)

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's slice [lo, hi) of the flat buffer."""
        return self.layout.range(self.rank)

    @property
    def part_sizes(self) -> tuple[int, ...] | None:
        """Every rank's shard length for the collectives; None where they are all alike (the
        even collectives, with no per-call check)."""
        return None if self.layout.even else self.layout.sizes

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def new_flat(self, zero: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
        make = torch.zeros if zero else torch.empty
        return make(self.padded_numel, dtype=dtype or self.dtype, device=self.device)

    def new_shard(self, dtype: torch.dtype | None = None, zero: bool = True) -> torch.Tensor:
        """This rank's shard of a flat buffer, zeros (``zero=False``: uninitialised, for a
        collective's output that overwrites every element)."""
        make = torch.zeros if zero else torch.empty
        return make(self.shard_numel, dtype=dtype or self.dtype, device=self.device)

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full flat buffer (a view)."""
        lo, hi = self.shard_range
        return flat[lo:hi]

    def slot(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's region of a full flat buffer, shaped like the parameter (a view)."""
        off = self.offsets[i]
        return flat[off:off + self.shapes[i].numel()].view(self.shapes[i])

    def copy_params_into(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.slot(flat, i).copy_(p.detach())

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into ``flat`` (no copy)."""
        for i, p in enumerate(self.params):
            p.data = self.slot(flat, i)


def split_into_units(groups: list[list[tuple[str, nn.Parameter]]], shards: Shards, rank: int,
                     max_unit_numel: int | None) -> list[FlatUnit]:
    """Cut each param group into units of at most ``max_unit_numel`` elements (a parameter is
    never split; None = one unit per group and dtype). Units are ordered so the last parameters
    of the model come first, roughly the order in which backward produces their gradients."""
    units: list[FlatUnit] = []
    for gi, named in enumerate(groups):
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
        for name, p in named:
            by_kind.setdefault((p.dtype, p.device), []).append((name, p))
        for members in by_kind.values():
            current: list[tuple[str, nn.Parameter]] = []
            size = 0
            for name, p in reversed(members):
                if current and max_unit_numel is not None and size + p.numel() > max_unit_numel:
                    units.append(_unit(current, gi, shards, rank, len(units)))
                    current, size = [], 0
                current.append((name, p))
                size += p.numel()
            if current:
                units.append(_unit(current, gi, shards, rank, len(units)))
    return units


def gradient_buckets(model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], shards: Shards, rank: int,
                     bucket_size_mb: float) -> list[FlatUnit]:
    """The units of stages 0-2: each group cut at ``bucket_size_mb`` (of the parameters' own
    dtype), in backward order, roughly, numbered in that order."""
    element = next(model.parameters()).element_size()
    max_numel = max(1, int(bucket_size_mb * 2**20 / element))
    units = split_into_units(groups, shards, rank, max_numel)
    order = {id(p): i for i, p in enumerate(model.parameters())}
    units.sort(key=lambda u: -max(order[id(p)] for p in u.params))
    for i, u in enumerate(units):
        u.index = i
    return units


def _unit(named: list[tuple[str, nn.Parameter]], gi: int, shards: Shards, rank: int, index: int) -> FlatUnit:
    return FlatUnit([p for _, p in named], [n for n, _ in named], gi, shards, rank, index)
