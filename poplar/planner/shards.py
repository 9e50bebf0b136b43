"""Shard weights chosen together with the batches (docs/design.md §5.1).

A rank's memory is a part that does not depend on its shard, its share of the sharded state and
its activations. The profile measured every rank at even shards: its largest micro-batch
``mbs``, its ``shard_bytes`` (its 1/N of the sharded state) and ``bytes_per_sample``. At a
share s instead of 1/N the sharded state changes by ``shard_bytes * (N s - 1)``, and the
largest micro-batch by that over ``bytes_per_sample``, rounded towards fewer samples (the
measured ``mbs`` may have had room to spare; it is not counted). So the capacity of any
(shard, batch) pair follows from the profile without a trial per pair.

Candidates: even shards, and shares in proportion to the memory each rank gives to sharded
state and activations at even shards (``shard_bytes + mbs * bytes_per_sample``: a card with
twice the room holds twice the state), blended with even in quarters. Each candidate's batches
are planned as usual on the ``mbs`` it allows, and priced with the optimizer step on the
largest shard: the iteration's fixed overhead, measured at 1/N each and mostly the optimizer
step, is scaled by N times the largest share (an upper bound: the rest of it does not grow
with the shard). The collectives are priced as the even ones of
the same buffers: they move the same bytes (§3.9). The fastest prediction wins; even shards
are kept when another candidate is not faster by more than the plan's tie.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

from poplar.types.plans import PlanError, shares_of
from poplar.types.profiles import Profile

BLENDS = (0.25, 0.5, 0.75, 1.0)  # steps from even (0) to memory-proportional (1) shares


@dataclass(frozen=True)
class ShardCandidate:
    """One set of shard weights the planner prices (``name``: how it was made)."""

    name: str
    weights: tuple[float, ...]


def memory_weights(room: Sequence[float]) -> tuple[float, ...]:
    """Shard weights in proportion to each rank's room for sharded state (what its memory holds
    besides what does not move with the shard), scaled to a mean of 1; a rank without room: 0."""
    room = [max(0.0, float(x)) for x in room]
    if sum(room) <= 0:
        raise PlanError("no rank has room for the sharded state; the model does not fit this cluster at any "
                        "shard weights: use a higher ZeRO stage or a smaller model")
    mean = sum(room) / len(room)
    return tuple(round(x / mean, 6) for x in room)


def knows_shard_memory(profile: Profile) -> bool:
    """Whether the profile says what a shard costs each rank (profiles measured before shard
    weights existed, and synthetic ones without the field, do not)."""
    return profile.zero_stage >= 1 and all(
        r.shard_bytes is not None and r.shard_bytes > 0 and r.bytes_per_sample for r in profile.ranks)


def candidates(profile: Profile) -> list[ShardCandidate]:
    """Even shards first, then blends towards memory-proportional ones (duplicates dropped)."""
    n = profile.world_size
    even = ShardCandidate("even", (1.0,) * n)
    if not knows_shard_memory(profile):
        return [even]
    ranks = sorted(profile.ranks, key=lambda r: r.rank)
    proportional = memory_weights([r.shard_bytes + r.mbs * r.bytes_per_sample for r in ranks])
    out, seen = [even], {even.weights}
    for blend in BLENDS:
        weights = tuple(round((1 - blend) + blend * x, 6) for x in proportional)
        if weights not in seen:
            seen.add(weights)
            out.append(ShardCandidate(f"memory x{blend:g}", weights))
    return out


def mbs_at(profile: Profile, weights: Sequence[float]) -> list[int]:
    """Every rank's largest micro-batch with these shard weights (from the even-shard profile)."""
    if len(weights) != profile.world_size:
        raise PlanError(f"{len(weights)} shard weights for a profile of {profile.world_size} ranks; give one per rank")
    if not knows_shard_memory(profile):
        if len(set(weights)) > 1:
            raise PlanError("the profile does not say what a shard costs each rank (no shard_bytes: measured before "
                            "shard weights, or at ZeRO-0); profile again, or plan with even shards")
        return [r.mbs for r in sorted(profile.ranks, key=lambda r: r.rank)]
    n, shares = profile.world_size, shares_of(tuple(weights))
    out = []
    for r in sorted(profile.ranks, key=lambda r: r.rank):
        extra = r.shard_bytes * (n * shares[r.rank] - 1)  # more state than at even shards (< 0: less)
        out.append(max(0, r.mbs + math.floor(-extra / r.bytes_per_sample)))
    return out


def step_scale(weights: Sequence[float]) -> float:
    """How much longer the optimizer step takes on the largest shard than on an even one."""
    return len(weights) * max(shares_of(tuple(weights)))


def reshaped(profile: Profile, weights: Sequence[float]) -> Profile | None:
    """The profile as these shard weights would have measured it: each rank's ``mbs`` and the
    iteration's fixed overhead (the optimizer step on the largest shard). None if a rank would
    fit no sample."""
    mbs = mbs_at(profile, weights)
    if min(mbs) < 1:
        return None
    out = copy.deepcopy(profile)
    for r in out.ranks:
        r.mbs = mbs[r.rank]
        r.points = [p for p in r.points if p.batch <= r.mbs]  # a batch that no longer fits is no point
        if not r.points:
            return None
    if out.comm.iteration_overhead_s is not None:
        out.comm.iteration_overhead_s *= step_scale(weights)
    return out
