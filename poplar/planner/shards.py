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
from dataclasses import dataclass, replace
from typing import Sequence

from poplar.types.plans import shares_of
from poplar.types.profiles import Profile
from poplar.planner.shard_memory import (activation_bytes, blended, emptied_blend, knows_shard_memory, mbs_at,
                                       measured_shares, memory_weights, proportional_weights, sharded_bytes)

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
    proportional = proportional_weights(profile)
    blends = list(BLENDS)
    empty = emptied_blend(proportional)
    if empty is not None:
        blends += [1.0 + f * (empty - 1.0) for f in BEYOND]
    for blend in blends:
        weights = blended(proportional, blend)
        if weights not in seen:
            seen.add(weights)
            out.append(ShardCandidate(f"memory x{blend:.3g}", weights))
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
    (``RankProfile.at_mbs``) and the optimizer step on the largest shard; None if a rank would
    fit no sample."""
    if min(mbs) < 1:
        return None
    out = copy.deepcopy(profile)
    out.ranks = [r.at_mbs(mbs[r.rank]) for r in out.ranks]
    if not all(r.points for r in out.ranks):
        return None
    overhead = out.comm.exposure.overhead_s
    if overhead is not None:
        out.comm.exposure = replace(out.comm.exposure, overhead_s=overhead * step_scale(profile, weights))
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
