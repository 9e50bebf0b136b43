"""Which ranks keep their optimizer in host memory, priced with the batches (docs/design.md §11).

What a rank gains. An offloading rank (``Offload.OPTIMIZER``) keeps its shard of the optimizer
state, and under mixed precision its fp32 master shard, in host memory: per element of its
shard, ``OffloadCost.state_bytes_per_element + master_bytes_per_element`` bytes leave the device
(the profiler counted them for the user's optimizer). Its shard has ``param_count`` times its
share of elements. Those bytes go to activations, at the profile's bytes per sample
(``shards.activation_bytes``), rounded towards fewer samples; so, as for shard weights
(``planner.shards``), the capacity of every (shard weights, placement) pair follows from the
profile without a trial per pair. The profile may have been measured with some ranks offloaded
(``Profile.offloads``): keeping those on the device takes the bytes back.

What it costs. Every iteration the rank copies its reduced gradient shard to the host (fp32, at
the measured device-to-host bandwidth), steps the optimizer there (elements times the measured
host step per element) and copies the updated shard back (fp32, host-to-device):

    offload_s(r) = 4 e_r / d2h_r + e_r * host_step_r + 4 e_r / h2d_r,   e_r = param_count * share_r

The ranks step together at the iteration's end, so the iteration gains the largest offload_s
of the offloading ranks. The device step the rank no longer runs is not subtracted: the profile
measures the iteration's fixed overhead, not the device step apart, so the price is an upper
bound (as ``shards.step_scale`` is).

Candidates, per set of shard weights: no offload; the ranks that fit no sample without it; each
device type (with those); every rank. The fastest prediction wins; a plan without offload is
kept when it is predicted within the plan's tie, so offload is chosen only where it lets the
model fit or makes the iteration faster (larger micro-batches on a short card).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from poplar.planner import shards as shard_choice
from poplar.types.plans import Offload, PlanError, shares_of
from poplar.types.profiles import Profile

TRANSFER_BYTES_PER_ELEMENT = 4  # the host copies are fp32: the gradient out, the stepped values back


@dataclass(frozen=True)
class OffloadCandidate:
    """One placement of every rank's optimizer that the planner prices (``name``: how it was made)."""

    name: str
    offloads: tuple[Offload, ...]


def knows_offload_cost(profile: Profile) -> bool:
    """Whether the profile says what offload costs and frees on every rank (measured at ZeRO-1/2/3,
    where the optimizer state is sharded, with bytes per sample to turn freed bytes into samples)."""
    return profile.zero_stage >= 1 and all(r.offload_cost is not None and r.bytes_per_sample
                                           for r in profile.ranks)


def measured_offloads(profile: Profile) -> tuple[Offload, ...]:
    """Where each rank's optimizer was while the profile was measured."""
    if profile.offloads is None:
        return (Offload.NONE,) * profile.world_size
    return tuple(Offload(o) for o in profile.offloads)


def shard_elements(profile: Profile, weights: Sequence[float]) -> list[float]:
    """Parameter elements in each rank's shard at these weights."""
    return [profile.param_count * s for s in shares_of(tuple(weights))]


def freed_bytes(profile: Profile, weights: Sequence[float]) -> list[float]:
    """Device bytes each rank frees by offloading at these weights (optimizer state + fp32 master)."""
    out = []
    for r, e in zip(_by_rank(profile), shard_elements(profile, weights)):
        cost = r.offload_cost
        out.append(e * (cost.state_bytes_per_element + cost.master_bytes_per_element) if cost else 0.0)
    return out


def offload_seconds(profile: Profile, weights: Sequence[float], offloads: Sequence[Offload]) -> list[float]:
    """Each rank's seconds per iteration of copies and host step (0 where it does not offload)."""
    out = []
    for r, e, o in zip(_by_rank(profile), shard_elements(profile, weights), offloads):
        cost = r.offload_cost
        if o is Offload.NONE:
            out.append(0.0)
            continue
        if cost is None:
            raise PlanError(f"rank {r.rank}: the profile does not say what offload costs (no offload_cost); "
                            "profile again to price it")
        moved = TRANSFER_BYTES_PER_ELEMENT * e
        out.append(moved / cost.d2h_bytes_per_s + e * cost.host_step_s_per_element + moved / cost.h2d_bytes_per_s)
    return out


def mbs_with(profile: Profile, weights: Sequence[float], offloads: Sequence[Offload]) -> list[int]:
    """Every rank's largest micro-batch with these shard weights and optimizer placements."""
    if len(offloads) != profile.world_size:
        raise PlanError(f"{len(offloads)} offload placements for a profile of {profile.world_size} ranks; "
                        "give one per rank")
    shard_choice.mbs_at(profile, weights)  # refuses weights the profile cannot price
    measured, freed = measured_offloads(profile), freed_bytes(profile, weights)
    per_sample = shard_choice.activation_bytes(profile)
    shares, measured_shares = shares_of(tuple(weights)), shard_choice.measured_shares(profile)
    total = shard_choice.sharded_bytes(profile) if shard_choice.knows_shard_memory(profile) else 0.0
    out = []
    for r, f, o, m in zip(_by_rank(profile), freed, offloads, measured):
        extra = total * (shares[r.rank] - measured_shares[r.rank])  # more sharded state than measured
        extra -= f * ((o is not Offload.NONE) - (m is not Offload.NONE))  # less where it now offloads
        out.append(max(0, r.mbs + math.floor(-extra / per_sample + 1e-9)))
    return out


def reshaped(profile: Profile, weights: Sequence[float], offloads: Sequence[Offload]) -> Profile | None:
    """The profile as these shard weights and placements would have measured it (every rank's
    ``mbs``, the optimizer step on the largest shard); None if a rank would fit no sample."""
    out = shard_choice.with_mbs(profile, weights, mbs_with(profile, weights, offloads))
    if out is not None:
        out.offloads = [o.value for o in offloads]
    return out


def candidates(profile: Profile, weights: Sequence[float]) -> list[OffloadCandidate]:
    """No offload first, then the ranks that fit no sample without it, each device type with
    those, and every rank (duplicates dropped)."""
    n = profile.world_size
    none = (Offload.NONE,) * n
    out, seen = [OffloadCandidate("none", none)], {none}
    if not knows_offload_cost(profile):
        return out
    short = {r for r, b in enumerate(mbs_with(profile, weights, none)) if b < 1}

    def add(name: str, ranks: set[int]) -> None:
        placement = tuple(Offload.OPTIMIZER if r in ranks else Offload.NONE for r in range(n))
        if ranks and placement not in seen:
            seen.add(placement)
            out.append(OffloadCandidate(name, placement))

    add("to fit", short)
    for dtype in profile.device_types():
        add(f"{dtype} + to fit" if short else dtype, short | {r.rank for r in profile.ranks if r.device_type == dtype})
    add("every rank", set(range(n)))
    return out


def _by_rank(profile: Profile) -> list:
    return sorted(profile.ranks, key=lambda r: r.rank)
