"""The choice of where each rank's optimizer lives, with its shard weights (docs/design.md §11):
every (shard weights, offload placement) candidate is planned on the profile as that pair would
have measured it (``offload_pricing.reshaped``) and priced with its offload seconds; the fastest
wins, but a plan without offload is kept when it is predicted within the plan's tie (even shards
first), so a rank offloads only where that lets the model fit or makes the iteration faster."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from poplar.planner import offload_pricing
from poplar.planner.shards import ShardCandidate
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
    rows: list[dict[str, Any]] = []
    found_all: list[tuple[str, Plan]] = []
    for sc in shard_cands:
        try:
            places = offload_pricing.candidates(prof, sc.weights) if placement == "auto" else \
                [offload_pricing.OffloadCandidate("given", placement)]  # type: ignore[arg-type]
        except PlanError as e:
            rows.append({"shards": sc.name, "weights": list(sc.weights), "predicted_s": None, "reason": str(e)})
            continue
        for oc in places:
            row: dict[str, Any] = {"shards": sc.name, "weights": list(sc.weights), "offload": oc.name,
                                   "offloads": [o.value for o in oc.offloads], "predicted_s": None}
            rows.append(row)
            try:
                found = planned(sc.weights, offload_pricing.reshaped(prof, sc.weights, oc.offloads))
            except PlanError as e:
                row["reason"] = str(e)
                continue
            if found is None:
                row["reason"] = "a rank fits no sample"
                continue
            seconds = offload_pricing.offload_seconds(prof, sc.weights, oc.offloads)
            found = found.with_offloads(oc.offloads)
            found.predicted_iteration_s += max(seconds)
            found.choice = replace(found.choice, offload_s=list(seconds), offload_pricing=OffloadPricing.PRICED)
            row.update(predicted_s=found.predicted_iteration_s, offload_s=max(seconds),
                       mbs=offload_pricing.mbs_with(prof, sc.weights, oc.offloads))
            found_all.append((sc.name, found))
    if not found_all:
        raise PlanError("no shard weights and offload placement fit every rank a sample: " + "; ".join(
            f"{r['shards']}/{r.get('offload', '-')}: {r['reason']}" for r in rows))
    best = min((p for _, p in found_all), key=lambda p: p.predicted_iteration_s)
    limit = best.predicted_iteration_s * (1 + (best.choice.plan_tie or 0.0))
    kept = [(name, p) for name, p in found_all if not any(o is not Offload.NONE for o in p.offloads)
            and p.predicted_iteration_s <= limit]
    if kept:  # no offload within the tie: even shards if they are, else the fastest without offload
        even = [p for name, p in kept if name == "even"]
        best = even[0] if even else min((p for _, p in kept), key=lambda p: p.predicted_iteration_s)
    best.choice = replace(best.choice, placement_candidates=rows)
    return best
