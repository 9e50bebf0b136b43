"""Choosing how a plan's collectives cross nodes: flat, hierarchical, hierarchical with
node-local secondary shards at ZeRO-3, or across nodes once per iteration, by predicted iteration
time (docs/design.md §3.10).

A job on one node has one way, flat, and its plans are those of a planner without this choice.
On a job that spans nodes every way that applies to the stage is planned in full (batches,
shards, placements), each priced by the cost model on the links its collectives cross
(``link_pricing``), and the fastest is kept; a way that holds memory (secondary shards, the node
accumulator) is planned on the micro-batches that memory leaves (``profile_as``).

[Note: flat first within the tie]
The profile's exposure was measured with the collectives as they ran then (flat, today); another
way is priced by carrying it (``CommModel.priced_as``), which is an estimate the measurement did
not see. Within the plan's tie (``Plan.choice.plan_tie``) the order flat, hierarchical, secondary
shards, once per iteration wins: the better-known prediction, then the way that holds less memory.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

from poplar.planner.fastest import Candidate
from poplar.planner.fastest import fastest as choose
from poplar.planner.link_pricing import held_bytes
from poplar.planner.shard_memory import activation_bytes
from poplar.planner.shards import with_mbs
from poplar.types.plan_choice import CollectivesRow
from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import Profile
from poplar.types.route import Collectives

# the enum's order: simpler ways first within the tie
ORDER = tuple(Collectives)
# where what crossing nodes once per iteration holds would take more than a quarter of some
# rank's micro-batch, the way is also planned holding it for part of the parameters (``Route``'s
# Note: a share held), at the largest shares that take at most each of these fractions of every
# rank's: a GPU left a small part of its measured batch runs more, shorter micro-steps, so the
# crossings saved may not pay for the batch lost; the predicted times decide among them
DISPLACED = (0.25, 0.5)


def collectives_setting(value: str | Collectives) -> Collectives | None:
    """``"auto"`` (None: choose) or one way, from its name."""
    if value == "auto":
        return None
    try:
        return Collectives(value)
    except ValueError:
        raise PlanError(f"collectives must be 'auto' or one of {', '.join(c.value for c in Collectives)}, "
                        f"got {value!r}") from None


def ways(profile: Profile, stage: int, setting: Collectives | None) -> list[Collectives]:
    """The ways to plan: the one asked for, or every way that applies (flat alone on one node)."""
    spans = profile.comm.links.spans_nodes
    if setting is not None:
        if not setting.applies(stage):
            raise PlanError(f"collectives={setting.value!r} does not apply at ZeRO-{stage}: hierarchical collectives "
                            "run from ZeRO-1 (ZeRO-0's all-reduce stays flat), secondary shards at ZeRO-3 only; "
                            "plan with collectives='auto' or 'flat'")
        return [setting if spans else Collectives.FLAT]
    return [c for c in ORDER if c.applies(stage)] if spans else [Collectives.FLAT]


def compute_itemsize(profile: Profile) -> int:
    """Bytes of one parameter element in the compute dtype the profile measured at."""
    return 2 if profile.precision in ("bf16", "fp16") else 4


def _held_per_rank(profile: Profile, way: Collectives, stage: int) -> list[float] | None:
    """What ``way`` holds on each rank (``held_bytes``), in rank order; None where the profile
    already holds it (measured with that way) or knows no topology."""
    topology = profile.comm.links.topology
    if topology is None or profile.comm.collectives is way:
        return None
    itemsize = compute_itemsize(profile)
    return [held_bytes(way, stage, profile.param_count, itemsize, len(topology.nodes[topology.node_of(r.rank)]))
            for r in sorted(profile.ranks, key=lambda r: r.rank)]


def held_shares(profile: Profile, way: Collectives, stage: int) -> tuple[float, ...]:
    """The shares of the parameters to plan ``way`` holding (``Route``'s Note: a share held):
    all of them, and where that would displace more than the least of ``DISPLACED`` of some
    rank's micro-batch (or all of it), also, for each fraction, the largest share in whole
    percents that displaces at most that fraction on every rank (none that is 0)."""
    held = _held_per_rank(profile, way, stage)
    if way is not Collectives.ONCE_PER_ITERATION or held is None or not any(held) \
            or not all(r.bytes_per_sample for r in profile.ranks):
        return (1.0,)
    per_sample = activation_bytes(profile)
    ranks = sorted(profile.ranks, key=lambda r: r.rank)
    shares = {1.0}
    for fraction in DISPLACED:
        room = [math.floor(fraction * r.mbs) * per_sample for r in ranks]
        share = math.floor(100 * min(min(space / h, 1.0) for h, space in zip(held, room) if h > 0)) / 100
        if share >= 1:
            break  # the whole way displaces at most this fraction: the larger ones add nothing
        if share > 0:
            shares.add(share)
    return tuple(sorted(shares, reverse=True))


def fastest_share(shares: Sequence[float], planned: Callable[[float], Plan]) -> Plan:
    """The plan (``planned``) at each held share, the fastest predicted kept; within the plan's
    tie the smaller share, which holds less memory (Note: flat first within the tie)."""
    if len(shares) == 1:
        return planned(shares[0])
    found: list[Candidate[CollectivesRow]] = []
    errors: list[PlanError] = []
    for share in sorted(shares):
        try:
            plan = planned(share)
        except PlanError as e:
            errors.append(e)
            continue
        found.append(Candidate(CollectivesRow(plan.collectives.value, plan.predicted_iteration_s), plan,
                               preference=len(found)))
    if not found:
        raise errors[-1]  # the whole share's: the way itself does not fit
    kept = choose(found, found[0].plan.choice.plan_tie or 0.0).plan  # type: ignore[union-attr]
    assert kept is not None
    return kept


def profile_as(profile: Profile, way: Collectives, stage: int, held_share: float = 1.0) -> Profile:
    """The profile a plan at ``stage`` with its collectives run ``way`` (once per iteration: for
    ``held_share`` of the parameters) is planned on: every rank's largest micro-batch less the
    samples what the way holds displaces (``held_bytes``, over the bytes of a sample). A profile
    measured with that way already holds it. A ``PlanError`` where the profile cannot say (no
    bytes per sample) or a rank would fit no sample."""
    found = _held_per_rank(profile, way, stage)
    if found is None:
        return profile
    held = [held_share * h for h in found]
    ranks = sorted(profile.ranks, key=lambda r: r.rank)
    if not any(held):
        return profile
    if not all(r.bytes_per_sample for r in profile.ranks):
        raise PlanError(f"collectives={way.value!r} hold memory on every rank and the profile does not say what a "
                        "sample's activations cost (bytes_per_sample); profile again, or plan with flat or "
                        "hierarchical collectives")
    per_sample = activation_bytes(profile)
    mbs = [r.mbs - math.ceil(extra / per_sample - 1e-9) for r, extra in zip(ranks, held)]
    if min(mbs) < 1:
        raise PlanError(f"collectives={way.value!r} leave some rank no room for a sample (they hold "
                        f"{max(held) / 2**20:.0f} MiB per rank); plan with flat or hierarchical collectives")
    weights = profile.shard_weights or [1.0] * profile.world_size
    return with_mbs(profile, weights, mbs)


def fastest(candidates: Sequence[Collectives], planned: Callable[[Collectives], Plan]) -> Plan:
    """Each way's plan (``planned``), the fastest predicted kept, earlier ways first within the
    tie (Note: flat first within the tie); the plan records its way and the table of ways."""
    found: list[Candidate[CollectivesRow]] = []
    errors: list[PlanError] = []
    for preference, way in enumerate(candidates):
        try:
            plan = planned(way)
        except PlanError as e:
            errors.append(e)
            found.append(Candidate(CollectivesRow(way.value, reason=str(e))))
            continue
        found.append(Candidate(CollectivesRow(way.value, plan.predicted_iteration_s, held_share=plan.held_share), plan,
                               preference))
    if all(c.plan is None for c in found):
        raise errors[0]
    # every way is planned on the profile's exposure (secondary shards move memory, not its error),
    # so every plan has the same tie
    tie = next(c.plan for c in found if c.plan is not None).choice.plan_tie
    kept = choose(found, tie or 0.0)
    chosen, way = kept.plan, Collectives(kept.row.collectives)
    assert chosen is not None
    rows = tuple(replace(c.row, chosen=c.row.collectives == way.value) for c in found)
    table = rows if len(candidates) > 1 else chosen.choice.collective_candidates
    return replace(chosen, collectives=way,
                   choice=replace(chosen.choice, collective_candidates=table))
