"""A rank's memory as a function of its shard weight, from what the profile measured
(docs/design.md §5.1): a part that does not move with the shard, its share of the sharded state
and its activations. The planner prices shard weights with it (``planner.shards``), and the
profiler asks it how far each rank's micro-batch could grow (``profiler.shard_room``): pure
arithmetic on a ``Profile``, no trial per (shard, batch) pair.
"""

from __future__ import annotations

import math
from typing import Sequence

from poplar.types.plans import PlanError, shares_of
from poplar.types.profiles import Profile


def memory_weights(room: Sequence[float]) -> tuple[float, ...]:
    """Shard weights in proportion to each rank's room for sharded state (what its memory holds
    besides what does not move with the shard), scaled to a mean of 1; a rank without room: 0."""
    room = [max(0.0, float(x)) for x in room]
    if sum(room) <= 0:
        raise PlanError("no rank has room for the sharded state; the model does not fit this cluster at any "
                        "shard weights: use a higher ZeRO stage or a smaller model")
    mean = sum(room) / len(room)
    return tuple(round(x / mean, 6) for x in room)


def measured_shares(profile: Profile) -> tuple[float, ...]:
    """Each rank's share of the sharded state when the profile was measured."""
    n = profile.world_size
    return shares_of(tuple(profile.shard_weights)) if profile.shard_weights else (1.0 / n,) * n


def sharded_bytes(profile: Profile) -> int:
    """The whole sharded state: every rank's measured shard, summed."""
    return sum(r.shard_bytes or 0 for r in profile.ranks)


def activation_bytes(profile: Profile) -> float:
    """Bytes one more sample adds to a step, for every rank: those of the rank whose fitted
    batches span the most samples (the largest ``mbs``).

    [Note: one slope for every rank]
    A rank measures its bytes per sample as the slope of the peaks of the steps that fitted. A
    step's peak is the largest of its phases' (the optimizer step's, forward's, backward's), so a
    rank that fitted one or two batches measures a slope between peaks that can lie in different
    phases (the optimizer step's at batch 1, backward's at batch 2): several times the true
    slope, which would price a freed shard byte at a fraction of a sample. The activations of a
    sample are the model's at this stage, precision and sequence shape, the same on every card,
    so every rank's capacity at another shard is priced with the slope measured over the widest
    range of batches."""
    widest = max(profile.ranks, key=lambda r: (r.mbs, -r.rank))
    return float(widest.bytes_per_sample)


def knows_shard_memory(profile: Profile) -> bool:
    """Whether the profile says what a shard costs each rank (profiles measured before shard
    weights existed, and synthetic ones without the field, do not)."""
    return profile.zero_stage >= 1 and sharded_bytes(profile) > 0 and all(
        r.shard_bytes is not None and r.shard_bytes >= 0 and r.bytes_per_sample for r in profile.ranks)


def proportional_weights(profile: Profile) -> tuple[float, ...]:
    """Shares in proportion to the memory each rank gives to sharded state and activations as
    measured (its shard plus ``mbs`` samples' bytes): a card with twice the room holds twice the
    state, and every card keeps the same fraction of its room for activations."""
    total, shares, per_sample = sharded_bytes(profile), measured_shares(profile), activation_bytes(profile)
    return memory_weights([shares[r.rank] * total + r.mbs * per_sample
                           for r in sorted(profile.ranks, key=lambda r: r.rank)])


def emptied_blend(proportional: Sequence[float]) -> float | None:
    """The blend from even (0) through ``proportional`` (1) at which the rank with the least room
    holds no state; None when every rank has the same room."""
    return 1.0 / (1.0 - min(proportional)) if min(proportional) < 1.0 else None


def blended(proportional: Sequence[float], blend: float) -> tuple[float, ...]:
    """Weights ``blend`` of the way from even to ``proportional`` (past 1: beyond it), none below 0."""
    return tuple(max(0.0, round((1 - blend) + blend * x, 6)) for x in proportional)


def mbs_at(profile: Profile, weights: Sequence[float]) -> list[int]:
    """Every rank's largest micro-batch with these shard weights (from the measured profile)."""
    if len(weights) != profile.world_size:
        raise PlanError(f"{len(weights)} shard weights for a profile of {profile.world_size} ranks; give one per rank")
    measured = measured_shares(profile)
    if not knows_shard_memory(profile):
        if shares_of(tuple(weights)) != measured:
            raise PlanError("the profile does not say what a shard costs each rank (no shard_bytes: measured before "
                            "shard weights, or at ZeRO-0); profile again, or plan at the weights it was measured at")
        return [r.mbs for r in sorted(profile.ranks, key=lambda r: r.rank)]
    total, shares, per_sample = sharded_bytes(profile), shares_of(tuple(weights)), activation_bytes(profile)
    out = []
    for r in sorted(profile.ranks, key=lambda r: r.rank):
        extra = total * (shares[r.rank] - measured[r.rank])  # more state than measured (< 0: less)
        out.append(max(0, r.mbs + math.floor(-extra / per_sample + 1e-9)))
    return out
