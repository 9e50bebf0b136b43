"""Routes: how a plan's collectives run, as one typed value (docs/design.md §3.10).

A ``Route`` says three things, all chosen by the plan and fixed for it: which ranks take part in
the training step (a plan may leave ranks out, §3.12), how the reduce-scatters and all-gathers
cross nodes (``Collectives``), and what they send quantized (``CommPolicy``). The planner
chooses the way, the plan carries it (``Plan.collectives``, ``Plan.route``), the profile records
the way its exposure was measured under (``CommProfile.collectives``), the cost model prices it
and the communicator builds the route object of that way once per plan
(``Communicator.configure``, ``poplar.comm.routes``). The value is the same enum everywhere.

[Note: a share held]
Crossing nodes once per iteration holds memory: ZeRO-3's secondary shards for the whole
iteration and the fp32 node accumulators of ZeRO-2/3's gradients (``planner.link_pricing.held_bytes``).
Where that would displace too much of a rank's batch, or leave it none, a plan holds it for a
share of the parameters only (``Route.held_share``): the stage's pieces (ZeRO-3's blocks,
ZeRO-2's units) in the stage's own order, as many as add up to at most that share of its
elements, cross once per iteration; the others cross per micro-step, as hierarchical collectives
do (each of their gathers crosses, each reduce-scatter runs both steps). The pieces in order, not
the best-fitting set: every rank derives the same pieces from the same model with no agreement,
and the planner prices the share itself (the pieces hold at most that share, so the memory is
never under-priced; they cross at most one piece more than priced).

[Note: files written before routes]
Plans, profiles and checkpoint indexes written before held the way as two booleans,
``hierarchical`` and ``secondary_shards``. ``read_collectives`` reads them into the enum when a
file is read; it is the one place their pair is checked (secondary shards without hierarchical
collectives is no way at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Sequence

from poplar.types.compression import EXACT, CommPolicy


class RouteError(ValueError):
    """A way of running the collectives that does not exist; the message names the fix."""


class Collectives(str, Enum):
    """How a plan's reduce-scatters and all-gathers cross nodes (compares equal to its value).
    The order of the members is the planner's order of preference within its tie: simpler first."""

    FLAT = "flat"  # one ring over every rank
    HIERARCHICAL = "hierarchical"  # a step inside each node, one across nodes
    SECONDARY_SHARDS = "secondary_shards"  # hierarchical; ZeRO-3's backward re-gather stays inside each node
    ONCE_PER_ITERATION = "once_per_iteration"  # hierarchical; across nodes once per iteration, not per micro-step

    @property
    def hierarchical(self) -> bool:
        """Whether the collectives cross nodes in two tiers (inside each node, then across)."""
        return self is not Collectives.FLAT

    @property
    def secondary_shards(self) -> bool:
        """Whether each rank keeps its node-local shard of ZeRO-3's gathered parameters from
        forward to backward (``ONCE_PER_ITERATION`` keeps it longer, through its route objects:
        ``Routes.keeps_secondary``; this stays False for it, so a plan of it at ZeRO-2 is valid)."""
        return self is Collectives.SECONDARY_SHARDS

    @classmethod
    def of(cls, hierarchical: bool, secondary_shards: bool, error: type[Exception] = RouteError) -> "Collectives":
        """The way two booleans of a file written before routes name (Note: files written before
        routes); ``error`` (a ``RouteError`` unless given) for the invalid pair."""
        if secondary_shards and not hierarchical:
            raise error("secondary_shards=True but hierarchical=False; secondary shards are kept by the "
                             "hierarchical all-gather: set hierarchical=True too (collectives=\"secondary_shards\"), "
                             "or secondary_shards=False")
        return cls.SECONDARY_SHARDS if secondary_shards else cls.HIERARCHICAL if hierarchical else cls.FLAT

    @classmethod
    def named(cls, value: Any, error: type[Exception] = RouteError) -> "Collectives":
        """The way named ``value`` (a member or its value), or ``error`` listing them."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise error(f"collectives must be one of {', '.join(repr(c.value) for c in cls)}, "
                             f"got {value!r}") from None

    def applies(self, stage: int) -> bool:
        """Whether the collectives of ``stage`` can run so: hierarchical from ZeRO-1 (ZeRO-0's
        all-reduce stays flat), secondary shards at ZeRO-3 only; once per iteration at every stage
        (ZeRO-0: its all-reduce hierarchical; ZeRO-1, which reduces once per iteration already:
        hierarchical)."""
        if self is Collectives.ONCE_PER_ITERATION:
            return True
        return self is Collectives.FLAT or (stage >= 1 and (not self.secondary_shards or stage == 3))

    def __str__(self) -> str:
        return self.value


_OLD_KEYS = ("hierarchical", "secondary_shards")


def read_collectives(d: Mapping[str, Any], error: type[Exception] = RouteError) -> dict[str, Any]:
    """``d`` (a plan's or a ``CommProfile``'s JSON object) with its way as ``collectives``, read
    from the two booleans of a file written before routes where it has them (Note: files written
    before routes); ``error`` for the invalid pair, or for both forms at once."""
    out = dict(d)
    if not any(k in out for k in _OLD_KEYS):
        return out
    if "collectives" in out:
        raise error("give the way as collectives alone, not with hierarchical / secondary_shards")
    old = [out.pop(k, False) for k in _OLD_KEYS]
    if not all(isinstance(v, bool) for v in old):
        raise error(f"hierarchical and secondary_shards must be true or false, got {old[0]!r}, {old[1]!r}")
    out["collectives"] = Collectives.of(*old, error=error)
    return out


@dataclass(frozen=True)
class Route:
    """How one plan's collectives run: over the ranks ``step_ranks`` (None: every rank) during
    the training step, crossing nodes as ``collectives``, quantized as ``compression``. The
    communicator builds its route object once per route (``Communicator.configure``)."""

    step_ranks: tuple[int, ...] | None = None
    collectives: Collectives = Collectives.FLAT
    compression: CommPolicy = EXACT
    held_share: float = 1.0  # across nodes once per iteration: the share of the parameters held so (Note: a share held)

    def __post_init__(self) -> None:
        object.__setattr__(self, "collectives", Collectives.named(self.collectives))
        if (problem := held_share_problem(self.held_share, self.collectives)) is not None:
            raise RouteError(problem)
        if self.step_ranks is not None:
            ranks = tuple(sorted(self.step_ranks))
            if not ranks or ranks[0] < 0 or len(set(ranks)) != len(ranks):
                raise RouteError(f"step ranks must be distinct ranks >= 0, at least one, got {self.step_ranks}")
            object.__setattr__(self, "step_ranks", ranks)
        if not isinstance(self.compression, CommPolicy):
            raise RouteError(f"a route's compression must be a CommPolicy, got {self.compression!r}")

    def held(self, numels: Sequence[int]) -> tuple[bool, ...]:
        """Which of a stage's pieces, of ``numels`` elements in the stage's order, hold what
        crossing nodes once per iteration keeps (Note: a share held): every one at a share of 1,
        else the longest prefix whose elements are at most ``held_share`` of them all."""
        if self.held_share >= 1:
            return (True,) * len(numels)
        budget, total, out = self.held_share * sum(numels), 0, []
        for n in numels:
            total += n
            out.append(total <= budget and (not out or out[-1]))
        return tuple(out)

    def ranks_in_step(self, world_size: int) -> tuple[int, ...]:
        """The ranks in the step on a world of ``world_size`` (a ``RouteError`` for a rank outside it)."""
        ranks = tuple(range(world_size)) if self.step_ranks is None else self.step_ranks
        if ranks[-1] >= world_size:
            raise RouteError(f"step ranks must be ranks of the world of {world_size}, got {ranks}")
        return ranks


def held_share_problem(share: Any, collectives: Collectives) -> str | None:
    """Why ``share`` cannot be a plan's held share (Note: a share held) with ``collectives``, or None."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) \
            or not 0 < share <= 1:
        return (f"held_share must be a number in (0, 1], the share of the parameters that cross nodes once per "
                f"iteration, got {share!r}; a share of 0 is collectives=\"hierarchical\"")
    if share < 1 and collectives is not Collectives.ONCE_PER_ITERATION:
        return (f"held_share={share} applies to collectives=\"once_per_iteration\" only (the share of the "
                f"parameters that cross nodes once per iteration), not {collectives.value!r}; set it to 1.0")
    return None
