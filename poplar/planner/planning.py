"""``plan()``: profile + global batch + ZeRO stage -> a Plan with predicted times.

Every strategy produces rows (b, gas, lbs) per rank; one function turns rows into a ``Plan``,
pricing them with the cost model, so strategies differ only in how they pick rows.

Input rules (decided here, where the issue left them open):
- gbs must be an int >= 1. A rank may get 0 samples at any stage (at stages 2/3 it still joins
  every collective with zeros); ``require_all_ranks=True`` forbids that, and then gbs smaller
  than the number of ranks is an error.
- Accumulation is unbounded by default, so any gbs fits in memory. ``max_micro_steps`` bounds
  the micro-steps per rank per iteration; then gbs > max_micro_steps * sum_i mbs_i cannot be met
  within memory and is an error.
- A profile measured at ZeRO stage s may be planned at any stage >= s (its mbs are safe there,
  only conservative); planning below s could run out of memory and is an error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from poplar.types.plan_choice import AllocatorSearch, DeviceTypeRow, KeptPlan, PlanChoice, ShardRow
from poplar.types.plans import Offload, OffloadPricing, Plan, PlanError, RankPlan
from poplar.planner.baselines import even_rows, flops_rows
from poplar.planner.cost_model import CommModel, Evaluation, evaluate_rows
from poplar.planner.fastest import Candidate, fastest
from poplar.planner import collective_choice, compression_choice, offload_pricing
from poplar.planner import participation as participation_choice
from poplar.types.route import Collectives
from poplar.planner.quantized_pricing import Compression
from poplar.planner.placement_choice import fastest_placement, offload_setting
from poplar.planner import shards as shard_choice
from poplar.planner.groups import DeviceGroup, group_profile
from poplar.planner.zero01 import allocate_zero01
from poplar.planner.zero23 import allocate_zero23
from poplar.types.compression import EXACT, CommPolicy
from poplar.types.profiles import Profile, ProfileError

STRATEGIES = ("poplar", "even", "flops")
# The tie: ``poplar`` keeps a conventional plan predicted within this fraction of its own, since a
# predicted gain below the cost model's resolution is not one a run shows, and a run then gets the
# plan a user would set by hand. PLAN_TIE is the floor, the cost model's resolution: tuned on the
# CPU emulator (its median error there; docs/experiments.md), not measured by the profiler.
PLAN_TIE = 0.01
# Where the profile measured its exposure less well, the tie is this many of its standard errors
# (``Exposure.error``, measured by the profiler's steady rounds, in round times): a gain
# sets one plan's exposure against another's, and two standard errors of a difference of two such
# exposures are 2 sqrt(2) of one. The factor follows from that; it replaced a factor of 2 after a
# run on the CPU emulator showed 2 too narrow (docs/experiments.md).
TIE_ERRORS = 2 * math.sqrt(2)


@dataclass
class Problem:
    """What a strategy needs: device groups, world size, communication model, stage, limits."""

    groups: list[DeviceGroup]
    comm: CommModel
    stage: int
    gbs: int
    require_all_ranks: bool = False
    max_micro_steps: int | None = None
    plan_tie: float = PLAN_TIE  # poplar keeps a conventional plan predicted this close (0: never)
    compression: CommPolicy = EXACT  # the quantized collectives the comm model prices

    @property
    def world_size(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def curves(self) -> dict:
        return {g.device_type: g.curve for g in self.groups}

    def flatten(self, rows: list[list[tuple[int, int, int]]]) -> list[tuple[str, int, int, int]]:
        """Per-group rows -> one (device_type, b, gas, lbs) per global rank."""
        out: list[Any] = [None] * self.world_size
        for g, grp in zip(self.groups, rows):
            for rank, (b, gas, lbs) in zip(g.ranks, grp):
                out[rank] = (g.device_type, b, gas, lbs)
        return out

    def evaluate(self, rows: list[list[tuple[int, int, int]]]) -> Evaluation:
        return evaluate_rows(self.flatten(rows), self.curves, self.stage, self.comm)


def _poplar(p: Problem) -> tuple[list, AllocatorSearch | None]:
    """The allocator's plan, unless a conventional one is predicted within ``plan_tie`` of it: a
    gain below the cost model's resolution is not one a run shows, and a run then gets the plan a
    user would set by hand. ``flops`` (where the profile has spec ratings) comes before ``even``,
    even when ``even`` is the allocator's own plan: within the tie the model cannot tell them
    apart, and on the CPU emulator it was ``even`` that ran slower than predicted there (the runs:
    docs/experiments.md)."""
    if p.stage in (0, 1):
        rows, info = allocate_zero01(p.groups, p.gbs, p.require_all_ranks, p.max_micro_steps,
                                     evaluate=lambda rows: p.evaluate(rows).iteration_s)
    else:
        rows, info = allocate_zero23(p.groups, p.gbs, p.stage, p.comm, p.require_all_ranks, p.max_micro_steps,
                                     evaluate=lambda rows: p.evaluate(rows).iteration_s)
    own = p.evaluate(rows).iteration_s
    for name in ("flops", "even"):
        try:
            other, _ = STRATEGY_ROWS[name](p)
        except PlanError:  # no spec ratings, or no such plan within the constraints
            continue
        seconds = p.evaluate(other).iteration_s
        if seconds <= own * (1 + p.plan_tie):
            if p.flatten(other) == p.flatten(rows):
                break
            return other, replace(info, kept=KeptPlan(name, seconds, own, p.plan_tie))
    return rows, info


STRATEGY_ROWS: dict[str, Callable[[Problem], tuple[list, AllocatorSearch | None]]] = {
    "poplar": _poplar,
    "even": lambda p: (even_rows(p.groups, p.gbs, p.stage, p.max_micro_steps), None),
    "flops": lambda p: (flops_rows(p.groups, p.gbs, p.stage, p.require_all_ranks, p.max_micro_steps), None),
}


def load_profile(profile: Profile | Mapping[str, Any] | str | os.PathLike) -> Profile:
    if isinstance(profile, Profile):
        profile.validate()
        return profile
    if isinstance(profile, Mapping):
        return Profile.from_dict(dict(profile))
    if isinstance(profile, (str, os.PathLike)):
        return Profile.load(Path(profile))
    raise ProfileError(f"expected a Profile, a dict or a path, got {type(profile).__name__}")


def make_problem(profile: Profile | Mapping[str, Any] | str | os.PathLike, global_batch_size: int,
                 zero_stage: int | None = None, *, require_all_ranks: bool = False,
                 max_micro_steps: int | None = None, collectives: Collectives = Collectives.FLAT,
                 compression: CommPolicy = EXACT, held_share: float = 1.0) -> Problem:
    """Validate the inputs and build the per-type view the strategies work on, its collectives
    priced as ``collectives`` (on a job that spans nodes: ``planner.link_pricing``; once per
    iteration for ``held_share`` of the parameters), quantized as ``compression``
    (``planner.quantized_pricing``)."""
    prof = load_profile(profile)
    stage = prof.zero_stage if zero_stage is None else zero_stage
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise PlanError(f"zero_stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage < prof.zero_stage:
        raise PlanError(
            f"the profile was measured at ZeRO-{prof.zero_stage}; its mbs may not fit at ZeRO-{stage}. "
            f"Plan at stage >= {prof.zero_stage} or profile again at stage {stage}")
    gbs = global_batch_size
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise PlanError(f"global_batch_size must be an int >= 1, got {gbs!r}")
    if max_micro_steps is not None and (isinstance(max_micro_steps, bool) or not isinstance(max_micro_steps, int)
                                        or max_micro_steps < 1):
        raise PlanError(f"max_micro_steps must be an int >= 1 or None, got {max_micro_steps!r}")
    if not (prof.param_bytes >= 0):
        raise ProfileError(f"param_bytes must be >= 0, got {prof.param_bytes}")
    groups = group_profile(prof)
    world = sum(g.count for g in groups)
    if require_all_ranks and gbs < world:
        raise PlanError(
            f"global batch {gbs} is smaller than the {world} ranks that must each take a sample; "
            f"use a global batch >= {world}, or allow idle ranks (require_all_ranks=False)")
    if max_micro_steps is not None:
        most = max_micro_steps * sum(g.count * g.mbs for g in groups)
        if gbs > most:
            raise PlanError(
                f"global batch {gbs} cannot be met within memory: at most {max_micro_steps} micro-steps "
                f"x sum of mbs = {most} samples per iteration. Lower the global batch, raise "
                "max_micro_steps, or use a higher ZeRO stage (larger micro-batches)")
    if (problem := compression.problem(stage)) is not None:
        raise PlanError(problem)
    comm = CommModel.from_profile(prof, collectives, Compression.of(prof, compression), held_share)
    return Problem(groups, comm, stage, gbs, require_all_ranks, max_micro_steps,
                   plan_tie=max(PLAN_TIE, TIE_ERRORS * (prof.comm.exposure.error or 0.0)), compression=compression)


def plan_problem(problem: Problem, strategy: str = "poplar", shard_weights: Sequence[float] | None = None) -> Plan:
    """Run one strategy on a prepared problem and price the result with the cost model (the one
    place a strategy name is checked: ``plan`` and ``simulate`` both come through here).
    ``shard_weights``: each rank's weight in the plan's rows (None: even shards); the problem was
    made from a profile reshaped to them."""
    if strategy not in STRATEGY_ROWS:
        raise PlanError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    rows, info = STRATEGY_ROWS[strategy](problem)
    flat = problem.flatten(rows)
    ev = evaluate_rows(flat, problem.curves, problem.stage, problem.comm)
    weights = [1.0] * len(flat) if shard_weights is None else [float(w) for w in shard_weights]
    ranks = [RankPlan(b, gas, lbs, c, dtype, w) for (dtype, b, gas, lbs), c, w in zip(flat, ev.compute_s, weights)]
    total = sum(r.num_samples for r in ranks)
    if total != problem.gbs:
        raise PlanError(f"strategy {strategy!r} produced {total} samples, not {problem.gbs}; this is a bug")
    choice = PlanChoice(search=info, device_types=tuple(
        DeviceTypeRow(g.device_type, g.count, g.mbs, g.curve.peak_batch, g.curve.peak_speed) for g in problem.groups),
        comm_per_micro_step_s=problem.comm.per_micro_step_s(problem.stage),
        comm_per_iteration_s=problem.comm.per_iteration_s(problem.stage))
    return Plan(ranks, zero_stage=problem.stage, strategy=strategy, predicted_iteration_s=ev.iteration_s,
                predicted_comm_s=ev.comm_s, choice=choice, collectives=problem.comm.collectives,
                compression=problem.compression, held_share=problem.comm.held_share)


def plan(profile: Profile | Mapping[str, Any] | str | os.PathLike, global_batch_size: int,
         zero_stage: int | None = None, strategy: str = "poplar", *, require_all_ranks: bool = False,
         max_micro_steps: int | None = None, shards: str | Sequence[float] = "even",
         offload: str | Sequence[Offload] = "none", collectives: "str | Collectives | CollectivesRequest" = "auto",
         participation: str = "auto") -> Plan:
    """Plan one iteration: per-rank micro-batch, accumulation steps and last batch.

    ``profile`` is a ``Profile``, its dict, or a path to its JSON; ``zero_stage`` defaults to
    the profile's; ``strategy`` is ``poplar`` (default), ``even`` or ``flops``. ``shards``:
    ``"even"`` (default), ``"auto"`` (shard weights chosen with the batches, ``planner.shards``)
    or one weight per rank. ``offload``: ``"none"`` (default), ``"auto"`` (ranks offload their
    optimizer where that lets the model fit or is predicted faster, ``planner.offload_pricing``)
    or one ``Offload`` per rank. ``collectives``: on a job whose links span nodes, ``"auto"``
    (default: flat, hierarchical or, at ZeRO-3, hierarchical with secondary shards, whichever is
    predicted fastest, ``planner.collective_choice``) or one of them; on one node they are flat.
    ``participation``: on a job that spans nodes, ``"auto"`` (default) may leave a node or a
    device type out of the step where that is predicted faster (``planner.participation``; not
    with ``require_all_ranks``, ZeRO-0, or shards, placements or collectives given); ``"all"``
    keeps every GPU. ``collectives`` may also be a ``CollectivesRequest``: the way as above, and
    what the collectives send: exact (default), a ``CommPolicy`` of quantized collectives used as
    given, or with ``allow_lossy`` quantization where it is predicted faster than exact by more
    than the tie, on a job that spans nodes (``planner.compression_choice``).
    The plan carries per-rank predicted compute seconds and the predicted iteration (compute +
    communication + offload copies and host step), and the collectives it chose.
    """
    prof = load_profile(profile)
    stage = prof.zero_stage if zero_stage is None else zero_stage
    asked = collectives if isinstance(collectives, CollectivesRequest) else CollectivesRequest(collectives)
    setting = collective_choice.collectives_setting(asked.way)
    if participation not in ("auto", "all"):
        raise PlanError(f"participation must be 'auto' (a node or device type may be left out where that is "
                        f"predicted faster) or 'all' (every GPU), got {participation!r}")
    request = PlanRequest(global_batch_size, zero_stage, strategy, require_all_ranks, max_micro_steps, shards, offload,
                          asked)
    every_rank = (participation == "all" or setting is not None or stage == 0 or require_all_ranks
                  or not isinstance(shards, str) or not isinstance(offload, str))

    def planned(policy: CommPolicy) -> Plan:
        one = replace(request, collectives=replace(asked, compression=policy))
        everyone = _fastest_way(prof, one, collective_choice.ways(prof, stage, setting))
        if every_rank:
            return everyone  # every rank: collectives or rows asked for, given per rank, or ZeRO-0 (§3.12)
        subset = replace(one, zero_stage=stage)
        return participation_choice.fastest(
            prof, everyone, lambda sub: _fastest_way(sub, subset, collective_choice.ways(sub, stage, None)))

    exact = planned(asked.compression if asked.compression is not None else EXACT)
    if asked.compression is not None or not asked.allow_lossy:
        return exact
    return compression_choice.fastest(exact, compression_choice.lossy_options(stage, prof.comm.links.spans_nodes),
                                      planned)


def _fastest_way(prof: Profile, request: "PlanRequest", ways: list[Collectives]) -> Plan:
    """The plan with the fastest of ``ways`` of running its collectives (flat alone: as planned)."""
    if ways == [Collectives.FLAT]:
        return _plan_as(prof, request, Collectives.FLAT)
    stage = prof.zero_stage if request.zero_stage is None else request.zero_stage
    return collective_choice.fastest(ways, lambda way: collective_choice.fastest_share(
        collective_choice.held_shares(prof, way, stage), lambda share: _plan_as(prof, request, way, share)))


@dataclass(frozen=True)
class CollectivesRequest:
    """How a plan's collectives may run: ``way`` ("auto" or a ``Collectives``, as ``plan``'s
    ``collectives``) and what they send, lossy only on request (``planner.compression_choice``):
    ``compression`` a ``CommPolicy`` used as given (None: none given); ``allow_lossy``: with none
    given, quantize where that is predicted faster than exact by more than the plan's tie.
    Neither: every plan is exact."""

    way: str | Collectives = "auto"
    compression: CommPolicy | None = None
    allow_lossy: bool = False

    def __post_init__(self) -> None:
        if self.compression is not None and not isinstance(self.compression, CommPolicy):
            raise PlanError(f"compression must be a poplar CommPolicy or None, got {self.compression!r}")
        if not isinstance(self.allow_lossy, bool):
            raise PlanError(f"allow_lossy must be True or False, got {self.allow_lossy!r}")


@dataclass(frozen=True)
class PlanRequest:
    """What ``plan`` was asked, but for the profile and the way of running the collectives that
    ``_plan_as`` is given (``collectives``: what they send, and the way asked)."""

    global_batch_size: int
    zero_stage: int | None
    strategy: str
    require_all_ranks: bool
    max_micro_steps: int | None
    shards: str | Sequence[float]
    offload: str | Sequence[Offload]
    collectives: CollectivesRequest = CollectivesRequest()


def _plan_as(prof: Profile, request: PlanRequest, collectives: Collectives, held_share: float = 1.0) -> Plan:
    """``plan`` with the collectives run as ``collectives`` (secondary shards: on the micro-batches
    their memory leaves; once per iteration: for ``held_share`` of the parameters)."""
    global_batch_size, zero_stage, strategy = request.global_batch_size, request.zero_stage, request.strategy
    require_all_ranks, max_micro_steps = request.require_all_ranks, request.max_micro_steps
    shards, offload = request.shards, request.offload
    stage = prof.zero_stage if zero_stage is None else zero_stage
    placement = offload_setting(offload, prof.world_size)
    if not isinstance(placement, str) and stage == 0:
        raise PlanError("ZeRO-0 replicates the optimizer state on every rank and has no shard to offload; plan at "
                        "ZeRO-1, 2 or 3, or with offload='none'")
    if placement == "none" and Offload.OPTIMIZER in offload_pricing.measured_offloads(prof):
        placement = (Offload.NONE,) * prof.world_size  # measured offloaded: keeping it on the device costs room
        if not offload_pricing.knows_offload_cost(prof) or stage != prof.zero_stage:
            raise PlanError(f"the profile was measured with ranks offloaded ({prof.offloads}) and cannot say what "
                            f"keeping their optimizer on the device costs at ZeRO-{stage}; plan with offload='auto' "
                            "or those placements at the profile's stage")

    def planned(weights: Sequence[float], source: Profile | None) -> Plan | None:
        if source is not None:
            source = collective_choice.profile_as(source, collectives, stage, held_share)
        if source is None:
            return None
        problem = make_problem(source, global_batch_size, zero_stage, require_all_ranks=require_all_ranks,
                               max_micro_steps=max_micro_steps, collectives=collectives,
                               compression=request.collectives.compression or EXACT, held_share=held_share)
        out = plan_problem(problem, strategy, weights)
        out.choice = replace(out.choice, plan_tie=problem.plan_tie)
        return out

    if isinstance(shards, str) and shards not in ("even", "auto"):
        raise PlanError(f"shards must be 'even', 'auto' or one weight per rank, got {shards!r}")
    if placement != "none" and stage == prof.zero_stage and offload_pricing.knows_offload_cost(prof):
        return fastest_placement(prof, _shard_candidates(prof, shards), placement, planned)
    found = _planned_shards(prof, stage, shards, planned)
    if placement == "auto":  # the profile cannot price it: every optimizer stays on its device
        found.choice = replace(found.choice, offload_pricing=OffloadPricing.NO_OFFLOAD_COST
                               if stage == prof.zero_stage else OffloadPricing.OTHER_STAGE)
    elif placement != "none":  # as given, unpriced: offloading only frees memory, so the mbs hold
        found = found.with_offloads(placement)
        found.choice = replace(found.choice, offload_pricing=OffloadPricing.AS_GIVEN)
    return found


def _shard_candidates(prof: Profile, shards: str | Sequence[float]) -> list[shard_choice.ShardCandidate]:
    if shards == "auto":
        return shard_choice.candidates(prof)
    if shards == "even":
        return [shard_choice.ShardCandidate("even", (1.0,) * prof.world_size)]
    return [shard_choice.ShardCandidate("given", tuple(float(w) for w in shards))]


def _planned_shards(prof: Profile, stage: int, shards: str | Sequence[float],
                    planned: Callable[[Sequence[float], Profile | None], Plan | None]) -> Plan:
    """The plan with every optimizer on its device, at ``shards``."""
    # the profile's shard bytes are its own stage's: another stage shards other state
    even = [1.0] * prof.world_size
    if shards == "even" and prof.shard_weights is not None and stage == prof.zero_stage:
        found = planned(even, shard_choice.reshaped(prof, even))  # measured at uneven weights
        if found is None:
            raise PlanError(f"the profile was measured at shard weights {prof.shard_weights} because the model does "
                            "not fit every rank at even shards; plan with shards='auto' or those weights")
        return found
    if shards == "even" or stage == 0 or (shards == "auto" and stage != prof.zero_stage):
        return planned(even, prof)  # type: ignore[return-value]
    if not isinstance(shards, str):
        if stage != prof.zero_stage and len(set(shards)) > 1:
            raise PlanError(f"shard weights are planned at the profile's stage (ZeRO-{prof.zero_stage}); "
                            f"profile at ZeRO-{stage} to plan weights there")
        weights = [float(w) for w in shards]
        found = planned(weights, shard_choice.reshaped(prof, weights))
        if found is None:
            raise PlanError(f"with shard weights {weights} some rank fits no sample; give it a smaller weight")
        return found
    return _fastest_shards(prof, planned)


def _fastest_shards(prof: Profile, planned: Callable[[Sequence[float], Profile | None], Plan | None]) -> Plan:
    """Every shard candidate's plan; the fastest predicted, unless even shards are within the tie
    (even's own): within the cost model's resolution the plan a user would set by hand wins."""
    found: list[Candidate[ShardRow]] = []
    for cand in shard_choice.candidates(prof):
        weights = tuple(cand.weights)
        try:
            plan_ = planned(cand.weights, shard_choice.reshaped(prof, cand.weights))
        except PlanError as e:  # e.g. a global batch these mbs cannot meet within max_micro_steps
            found.append(Candidate(ShardRow(cand.name, weights, reason=str(e))))
            continue
        if plan_ is None:
            found.append(Candidate(ShardRow(cand.name, weights, reason="a rank fits no sample")))
            continue
        row = ShardRow(cand.name, weights, plan_.predicted_iteration_s, mbs=tuple(shard_choice.mbs_at(prof, weights)))
        found.append(Candidate(row, plan_, preference=0 if cand.name == "even" else 1))
    if not any(c.plan is not None for c in found):
        raise PlanError("no shard weights fit every rank a sample: " + "; ".join(
            f"{c.row.name}: {c.row.reason}" for c in found))
    even = next((c.plan for c in found if c.row.name == "even" and c.plan is not None), None)
    best = fastest(found, (even.choice.plan_tie or 0.0) if even is not None else 0.0).plan
    assert best is not None
    best.choice = replace(best.choice, shard_candidates=tuple(c.row for c in found))
    return best


def batch_using_every_rank(profile: Profile | Mapping[str, Any] | str | os.PathLike, global_batch_size: int,
                           zero_stage: int | None = None, strategy: str = "poplar", *,
                           max_micro_steps: int | None = None, tries: int = 12) -> int | None:
    """The smallest global batch above ``global_batch_size`` whose plan (even shards, no
    ``require_all_ranks``) gives every rank a sample: doubling, then bisection, at most ``tries``
    plans (None if none found: every rank is then left out by choice, not by the batch)."""
    prof = load_profile(profile)

    def uses_all(gbs: int) -> bool:
        try:
            found = plan(prof, gbs, zero_stage, strategy, max_micro_steps=max_micro_steps)
        except PlanError:
            return False
        return all(r.num_samples > 0 for r in found.ranks)

    low, high = global_batch_size, max(global_batch_size + 1, prof.world_size)
    while not uses_all(high):
        tries -= 1
        if tries <= 0:
            return None
        low, high = high, 2 * high
    while high - low > 1 and tries > 0:  # low never uses every rank, high does
        tries -= 1
        mid = (low + high) // 2
        low, high = (low, mid) if uses_all(mid) else (mid, high)
    return high
