"""Shard weights chosen together with the batches (docs/design.md §5.1).

A rank's memory is a part that does not depend on its shard, its share of the sharded state and
its activations. The profile measured every rank at its shard weights (even, unless no rank
could fit even shards: ``Profile.shard_weights``): its largest micro-batch ``mbs``, its
``shard_bytes`` and ``bytes_per_sample``. The sharded state is the sum of the ranks' shard bytes;
at a share s instead of the measured s0 a rank's state changes by that sum times (s - s0), and
its largest micro-batch by that over a sample's bytes (``activation_bytes``), rounded towards fewer samples (the
measured ``mbs`` may have had room to spare; it is not counted). So the capacity of any
(shard, batch) pair follows from the profile without a trial per pair.

Candidates: even shards, the measured weights, and shares in proportion to the memory each rank
gives to sharded state and activations as measured (its shard plus ``mbs`` samples' bytes: a
card with twice the room holds twice the state), blended with even in quarters, and past them
in thirds of the way to where the rank with the least room holds none (its memory all
activations, the state on the cards with room to spare). Each candidate's
batches are planned as usual on the ``mbs`` it allows, and priced with the optimizer step on the
largest shard: the iteration's fixed overhead, measured at the largest measured share and mostly
the optimizer step, is scaled by the ratio of the largest shares (an upper bound: the rest of it
does not grow with the shard). The collectives are priced as the even ones of the same buffers:
they move the same bytes (§3.9). The fastest prediction wins; even shards are kept when another
candidate is not faster by more than the plan's tie.

A model that fits no rank's batch 1 at even shards on some ranks can still fit uneven ones:
``weights_to_fit`` gives each rank a share in proportion to its room (its capacity less the
bytes of a batch-1 step that do not move with the shard, as a rank that fitted measured them).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

from poplar.types.plans import PlanError, shares_of
from poplar.types.profiles import Profile

BLENDS = (0.25, 0.5, 0.75, 1.0)  # steps from even (0) to memory-proportional (1) shares
# Past memory-proportional shares, thirds of the way to where the rank with the least room holds none:
# a card whose room goes to activations runs larger micro-batches (fewer micro-steps, and at ZeRO-2/3
# fewer rounds of collectives per sample) while the cards with room to spare hold its state.
BEYOND = (1 / 3, 2 / 3, 1.0)


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


def candidates(profile: Profile) -> list[ShardCandidate]:
    """Even shards first, the measured weights, then blends towards memory-proportional ones and
    past them to where the rank with the least room holds none (duplicates dropped)."""
    n = profile.world_size
    even = ShardCandidate("even", (1.0,) * n)
    if not knows_shard_memory(profile):
        return [even]
    out, seen = [even], {even.weights}
    if profile.shard_weights is not None and tuple(profile.shard_weights) not in seen:
        out.append(ShardCandidate("measured", tuple(float(w) for w in profile.shard_weights)))
        seen.add(out[-1].weights)
    ranks = sorted(profile.ranks, key=lambda r: r.rank)
    total, shares, per_sample = sharded_bytes(profile), measured_shares(profile), activation_bytes(profile)
    proportional = memory_weights([shares[r.rank] * total + r.mbs * per_sample for r in ranks])
    blends = list(BLENDS)
    if min(proportional) < 1.0:  # the blend at which the rank with the least room holds nothing
        empty = 1.0 / (1.0 - min(proportional))
        blends += [1.0 + f * (empty - 1.0) for f in BEYOND]
    for blend in blends:
        weights = tuple(max(0.0, round((1 - blend) + blend * x, 6)) for x in proportional)
        if weights not in seen:
            seen.add(weights)
            out.append(ShardCandidate(f"memory x{blend:.3g}", weights))
    return out


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


def step_scale(profile: Profile, weights: Sequence[float]) -> float:
    """How much longer the optimizer step takes on these weights' largest shard than on the
    largest shard the profile was measured at."""
    return max(shares_of(tuple(weights))) / max(measured_shares(profile))


def reshaped(profile: Profile, weights: Sequence[float]) -> Profile | None:
    """The profile as these shard weights would have measured it: each rank's ``mbs`` and the
    iteration's fixed overhead (the optimizer step on the largest shard). None if a rank would
    fit no sample."""
    return with_mbs(profile, weights, mbs_at(profile, weights))


def with_mbs(profile: Profile, weights: Sequence[float], mbs: Sequence[int]) -> Profile | None:
    """A copy of the profile at these shard weights with every rank's largest micro-batch ``mbs``
    (the points beyond it dropped) and the optimizer step on the largest shard; None if a rank
    would fit no sample."""
    if min(mbs) < 1:
        return None
    out = copy.deepcopy(profile)
    for r in out.ranks:
        r.mbs = mbs[r.rank]
        r.points = [p for p in r.points if p.batch <= r.mbs]  # a batch that no longer fits is no point
        if not r.points:
            return None
    if out.comm.iteration_overhead_s is not None:
        out.comm.iteration_overhead_s *= step_scale(profile, weights)
    out.shard_weights = [float(w) for w in weights]
    return out


def weights_to_fit(capacity: Sequence[int], fixed: Sequence[int | None], shard: Sequence[int | None]
                   ) -> tuple[float, ...] | None:
    """Shard weights under which every rank may fit a batch-1 step, from even-shard capacity
    searches: per rank its ``capacity`` bytes, the bytes of its batch-1 step that do not move
    with the shard (``fixed``; None where batch 1 did not fit) and its shard's bytes (None
    there too). The ranks that did not fit are taken to need the most any rank that fitted did
    (the same model and configuration), so each rank's room is its capacity less that; shares go
    in proportion to room. None when no rank fitted or the rooms cannot hold the whole state."""
    known = [f for f in fixed if f is not None]
    shards = [b for b in shard if b is not None]
    if not known or not shards:
        return None
    total = max(shards) * len(capacity)  # even shards: equal but for alignment
    room = [max(0.0, c - max(known)) for c in capacity]
    if sum(room) < total:
        return None
    return memory_weights(room)
