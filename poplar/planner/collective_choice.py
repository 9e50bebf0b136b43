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
way is priced by scaling it (``CommModel.priced_as``), which is an estimate the measurement did
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


def profile_as(profile: Profile, way: Collectives, stage: int) -> Profile:
    """The profile a plan at ``stage`` with its collectives run ``way`` is planned on: every
    rank's largest micro-batch less the samples what the way holds displaces (``held_bytes``,
    over the bytes of a sample). A profile measured with that way already holds it. A
    ``PlanError`` where the profile cannot say (no bytes per sample) or a rank would fit no sample."""
    topology = profile.comm.links.topology
    itemsize = compute_itemsize(profile)
    if topology is None or profile.comm.collectives is way:
        return profile
    ranks = sorted(profile.ranks, key=lambda r: r.rank)
    held = [held_bytes(way, stage, profile.param_count, itemsize, len(topology.nodes[topology.node_of(r.rank)]))
            for r in ranks]
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
