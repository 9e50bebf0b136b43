"""The choice of where each rank's optimizer lives, with its shard weights (docs/design.md §11):
every (shard weights, offload placement) candidate is planned on the profile as that pair would
have measured it (``offload_pricing.reshaped``) and priced with its offload seconds; the fastest
wins, but a plan without offload is kept when it is predicted within the plan's tie (even shards
first), so a rank offloads only where that lets the model fit or makes the iteration faster."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from poplar.planner import offload_pricing
from poplar.planner.fastest import Candidate, fastest
from poplar.planner.shards import ShardCandidate
from poplar.types.plan_choice import PlacementRow
from poplar.types.plans import Offload, OffloadPricing, Plan, PlanError
from poplar.types.profiles import Profile

Planned = Callable[[Sequence[float], Profile | None], Plan | None]


def offload_setting(offload: str | Sequence[Offload], world_size: int) -> str | tuple[Offload, ...]:
    """``plan``'s offload argument checked: "none", "auto" or one placement per rank."""
    if isinstance(offload, str):
        if offload not in ("none", "auto"):
            raise PlanError(f"offload must be 'none', 'auto' or one Offload per rank, got {offload!r}")
        return offload
    try:
        placement = tuple(Offload(o) for o in offload)
    except (TypeError, ValueError):
        raise PlanError(f"offload must be 'none', 'auto' or one Offload per rank, got {offload!r}") from None
    if len(placement) != world_size:
        raise PlanError(f"{len(placement)} offload placements for a profile of {world_size} ranks; give one per rank")
    return "none" if all(o is Offload.NONE for o in placement) else placement


def fastest_placement(prof: Profile, shard_cands: list[ShardCandidate],
                       placement: str | tuple[Offload, ...],
                       planned: Planned) -> Plan:
    """Every (shard weights, offload placement) candidate's plan, priced with its offload
    seconds; the fastest, unless one without offload is within the tie (even shards first)."""
    found: list[Candidate[PlacementRow]] = []
    for sc in shard_cands:
        weights = tuple(sc.weights)
        try:
            places = offload_pricing.candidates(prof, sc.weights) if placement == "auto" else \
                [offload_pricing.OffloadCandidate("given", placement)]  # type: ignore[arg-type]
        except PlanError as e:
            found.append(Candidate(PlacementRow(sc.name, weights, reason=str(e))))
            continue
        for oc in places:
            found.append(_placed(prof, sc, oc, planned))
    if not any(c.plan is not None for c in found):
        raise PlanError("no shard weights and offload placement fit every rank a sample: " + "; ".join(
            f"{c.row.shards}/{c.row.offload or '-'}: {c.row.reason}" for c in found))
    # the tie of the fastest plan: every candidate is planned on the profile's exposure (reshaping
    # moves memory, not the exposure's error), so every plan has the same tie
    tie = min((c.plan for c in found if c.plan is not None), key=lambda p: p.predicted_iteration_s).choice.plan_tie
    best = fastest(found, tie or 0.0).plan
    assert best is not None
    best.choice = replace(best.choice, placement_candidates=tuple(c.row for c in found))
    return best


def _placed(prof: Profile, sc: ShardCandidate, oc: offload_pricing.OffloadCandidate,
            planned: Planned) -> Candidate[PlacementRow]:
    """The candidate of shard weights ``sc`` with placement ``oc``: its plan, priced with its
    offload seconds. Within the tie a plan without offload wins, even shards first: a rank
    offloads only where that lets the model fit or is predicted faster than the cost model's
    resolution, since the host step and the copies are priced from a measurement the plan's
    batches did not run."""
    row = PlacementRow(sc.name, tuple(sc.weights), oc.name, tuple(o.value for o in oc.offloads))
    try:
        found = planned(sc.weights, offload_pricing.reshaped(prof, sc.weights, oc.offloads))
    except PlanError as e:
        return Candidate(replace(row, reason=str(e)))
    if found is None:
        return Candidate(replace(row, reason="a rank fits no sample"))
    seconds = offload_pricing.offload_seconds(prof, sc.weights, oc.offloads)
    found = found.with_offloads(oc.offloads)
    found.predicted_iteration_s += max(seconds)
    found.choice = replace(found.choice, offload_s=list(seconds), offload_pricing=OffloadPricing.PRICED)
    row = replace(row, predicted_s=found.predicted_iteration_s, offload_s=max(seconds),
                  mbs=tuple(offload_pricing.mbs_with(prof, sc.weights, oc.offloads)))
    offloaded = any(o is not Offload.NONE for o in oc.offloads)
    return Candidate(row, found, preference=2 if offloaded else 0 if sc.name == "even" else 1)
