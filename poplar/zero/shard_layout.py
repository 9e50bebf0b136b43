"""Where each rank's shard of a flat buffer lies: contiguous ranges cut in proportion to the
ranks' shard weights (``RankPlan.shard_weight``).

``Shards`` is the ranks' weights as one value: the runtime takes it from its plan and hands it
down to every flat unit it builds, and each unit's ``ShardLayout`` is ``shards.layout(numel)``.

[Note: even and weighted layouts]
With equal weights the layout is ZeRO's usual one: the buffer is padded to a multiple of the
world size N and rank r owns ``[r*S, (r+1)*S)``, S = padded / N, so every collective is an even
one. With other weights, rank r owns ``[c_r, c_{r+1})`` where the cut points c_r are the
cumulative weights' share of the buffer, rounded to a multiple of ``align`` elements (16 bytes,
so every shard starts on a boundary the collectives' kernels handle without a fix-up copy). A
rank of weight 0 owns an empty range: it holds no state of the buffer but still takes part in
every collective. Padding is zero and stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from poplar.types.plans import shard_weights_problem, shares_of

ALIGN_BYTES = 16  # shard starts on 16-byte boundaries: what NCCL's vectorised copies want


@dataclass(frozen=True)
class ShardLayout:
    """The cut points of one flat buffer: rank r owns elements ``[bounds[r], bounds[r+1])``;
    ``bounds[-1]`` is the padded length."""

    bounds: tuple[int, ...]

    @classmethod
    def of(cls, numel: int, weights: Sequence[float], element_size: int = 4) -> "ShardLayout":
        """The layout of ``numel`` elements over ranks of these shard weights (one per rank)."""
        n = len(weights)
        problem = shard_weights_problem(weights)
        if problem is not None:
            raise ValueError(problem)
        if len(set(weights)) == 1:
            size = max(1, -(-numel // n))
            return cls(tuple(r * size for r in range(n + 1)))
        align = max(1, ALIGN_BYTES // element_size)
        padded = max(align, -(-numel // align) * align)
        total, running, cuts = float(sum(weights)), 0.0, [0]
        for w in weights[:-1]:
            running += w
            cuts.append(min(padded, max(cuts[-1], round(padded * running / total / align) * align)))
        cuts.append(padded)
        return cls(tuple(cuts))

    @property
    def world_size(self) -> int:
        return len(self.bounds) - 1

    @property
    def padded_numel(self) -> int:
        return self.bounds[-1]

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Every rank's shard length, in rank order."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    @cached_property
    def even(self) -> bool:
        """Every rank's shard has the same length (the collectives need no uneven form)."""
        return len(set(self.sizes)) == 1

    def range(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]

    def size(self, rank: int) -> int:
        return self.bounds[rank + 1] - self.bounds[rank]


@dataclass(frozen=True)
class Shards:
    """Each rank's shard weight, in rank order (``Plan.shard_weights``): every flat buffer of the
    sharded state is cut in proportion to them."""

    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.weights, tuple):
            raise TypeError(f"Shards takes a tuple of weights, one per rank, got {self.weights!r}")
        problem = shard_weights_problem(self.weights)
        if problem is not None:
            raise ValueError(problem)

    @classmethod
    def even(cls, world_size: int) -> "Shards":
        """Equal shares on ``world_size`` ranks: ZeRO's usual layout."""
        return cls((1.0,) * world_size)

    @property
    def world_size(self) -> int:
        return len(self.weights)

    def cuts_like(self, other: "Shards") -> bool:
        """Both give every rank the same share of the sum (the same weights up to a scale)."""
        return shares_of(self.weights) == shares_of(other.weights)

    def layout(self, numel: int, element_size: int = 4) -> ShardLayout:
        """The cut points of a flat buffer of ``numel`` elements of ``element_size`` bytes: rank
        r's range is ``layout(...).range(r)``."""
        return ShardLayout.of(numel, self.weights, element_size)
