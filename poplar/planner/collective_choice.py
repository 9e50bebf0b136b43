"""Choosing how a plan's collectives cross nodes: flat, hierarchical, or hierarchical with
node-local secondary shards at ZeRO-3, by predicted iteration time (docs/design.md §5.2).

A job on one node has one way, flat, and its plans are those of a planner without this choice.
On a job that spans nodes every way that applies to the stage is planned in full (batches,
shards, placements), each priced by the cost model on the links its collectives cross
(``link_pricing``), and the fastest is kept; secondary shards are planned on the micro-batches
their memory leaves (``with_secondary_shards``).

[Note: flat first within the tie]
The profile's exposure was measured with the collectives as they ran then (flat, today); another
way is priced by scaling it (``CommModel.priced_as``), which is an estimate the measurement did
not see. Within the plan's tie (``Plan.choice.plan_tie``) the order flat, hierarchical, secondary
shards wins: the better-known prediction, then the way that holds less memory.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

from poplar.planner.fastest import Candidate
from poplar.planner.fastest import fastest as choose
from poplar.planner.link_pricing import secondary_shard_bytes
from poplar.planner.shard_memory import activation_bytes
from poplar.planner.shards import with_mbs
from poplar.types.plan_choice import CollectivesRow
from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import Profile
from poplar.types.route import Collectives

# the enum's order: simpler ways first within the tie; a way the planner does not choose yet
# (``Collectives.chosen_by_planner``) is planned only when asked for by name
ORDER = tuple(c for c in Collectives if c.chosen_by_planner)


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


def with_secondary_shards(profile: Profile) -> Profile | None:
    """The profile as secondary shards would leave it: every rank's largest micro-batch less the
    samples its part of the node's secondary shard displaces (``secondary_shard_bytes``, over the
    bytes of a sample). None where the profile cannot say (no bytes per sample, or no topology)
    or a rank would fit no sample. A profile measured with secondary shards already holds them."""
    topology = profile.comm.links.topology
    if topology is None or profile.comm.collectives.secondary_shards:
        return profile if profile.comm.collectives.secondary_shards else None
    if not all(r.bytes_per_sample for r in profile.ranks):
        return None
    per_sample = activation_bytes(profile)
    itemsize = compute_itemsize(profile)
    mbs = []
    for r in sorted(profile.ranks, key=lambda r: r.rank):
        extra = secondary_shard_bytes(profile.param_count, itemsize, len(topology.nodes[topology.node_of(r.rank)]))
        mbs.append(r.mbs - math.ceil(extra / per_sample - 1e-9))
    weights = profile.shard_weights or [1.0] * profile.world_size
    return with_mbs(profile, weights, mbs)


def profile_as(profile: Profile, way: Collectives) -> Profile:
    """The profile a plan with its collectives run ``way`` is planned on: with secondary shards,
    on the micro-batches their memory leaves (a ``PlanError`` where none is left)."""
    if not way.secondary_shards:
        return profile
    found = with_secondary_shards(profile)
    if found is None:
        raise PlanError("secondary shards leave some rank no room for a sample, or the profile does not say what a "
                        "sample's activations cost (bytes_per_sample); plan with flat or hierarchical collectives")
    return found


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
        found.append(Candidate(CollectivesRow(way.value, plan.predicted_iteration_s), plan, preference))
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
