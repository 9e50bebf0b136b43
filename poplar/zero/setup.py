"""The runtime's set-up: its arguments checked, as verdicts every rank agrees on, and its
ZeRO stage built; and the check of a plan it is given later (``ZeroRuntime.set_plan``).

Each rank checks its arguments without raising (a message naming the fix, or None), so a bad
value on one rank becomes the same ``DistributedError`` on every rank at the set-up agreement
(docs/design.md §3.4), which also compares the stage, plan, parameter shapes and policies. Only
then is the stage built (``build_stage``), its collectives recorded in the set-up phase.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from poplar.comm import Communicator, DistributedError, Phase
from poplar.types.plans import Plan
from poplar.types.precision import MixedPrecision, resolve_precision
from poplar.zero.base import StageHooks, ZeroStage
from poplar.zero.flat import gradient_buckets
from poplar.zero.nonfinite import NonFinitePolicy
from poplar.zero.offload import offload_problem
from poplar.zero.optim import named_param_groups
from poplar.zero.precision import StagePrecision
from poplar.zero.shard_layout import Shards


def check_arguments(world_size: int, model: nn.Module, optimizer: torch.optim.Optimizer, zero_stage: Any, plan: Any,
                    max_grad_norm: Any, bucket_size_mb: float) -> tuple[str | None, list]:
    """This rank's verdict on its arguments (a message naming the fix), without raising: every
    rank must reach the agreement point. Returns (error, the optimizer's groups of parameters)."""
    if zero_stage not in (0, 1, 2, 3):
        return f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}", []
    if not isinstance(plan, Plan):
        return (f"plan must be a poplar.Plan with one RankPlan per rank, got {type(plan).__name__}; "
                f"e.g. Plan.even(world_size={world_size}, global_batch_size=..., micro_batch_size=...) "
                "or poplar.plan(profile, ...); or give global_batch_size= and loss_fn= for auto mode"), []
    if plan.world_size != world_size:
        return (f"plan has {plan.world_size} rows but the world has {world_size} ranks; "
                "give one RankPlan per rank"), []
    if (problem := offload_problem(plan, zero_stage) or secondary_problem(plan, zero_stage)
            or left_out_problem(plan, zero_stage) or compression_problem(plan, zero_stage)) is not None:
        return problem, []
    if max_grad_norm is not None and not max_grad_norm > 0:
        return f"max_grad_norm must be > 0 or None, got {max_grad_norm}", []
    if not bucket_size_mb > 0:
        return f"bucket_size_mb must be > 0, got {bucket_size_mb}", []
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"model parameters are on several devices {sorted(map(str, devices))}; put the model on one", []
    groups, error = named_param_groups(model, optimizer)
    return error, groups


def agree_setup(comm: Communicator, error: str | None, model: nn.Module, zero_stage: Any, plan: Any,
                policies: str) -> None:
    """All ranks must have valid arguments, the same plan, stage, policies and parameter shapes;
    a difference names the first rank that differs from rank 0 and what differs (the parameter,
    for shapes), on every rank."""
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    plan_json = plan.to_json() if isinstance(plan, Plan) else repr(plan)
    digest = lambda value: hashlib.sha256(repr(value).encode()).hexdigest()  # noqa: E731
    mine = {"zero_stage": repr(zero_stage), "plan": digest(plan_json), "mixed_precision, nonfinite": policies,
            "model parameters": digest(shapes)}
    values = comm.agree(error, "PoplarEngine setup", mine)
    for rank, theirs in enumerate(values):
        differing = [key for key in mine if theirs[key] != values[0][key]]
        if not differing:
            continue
        if differing == ["model parameters"]:  # every rank sees it: name the parameter
            everyone = comm.all_gather_object(shapes, tag="PoplarEngine setup")
            where = _first_difference(everyone[0], everyone[rank], rank)
            raise DistributedError(f"PoplarEngine setup failed: {where}; build the same model on every rank")
        raise DistributedError(f"PoplarEngine setup failed: rank {rank} was given a different "
                               f"{' and '.join(differing)} than rank 0; pass the same to every rank")


def _first_difference(ours: list[tuple], theirs: list[tuple], rank: int) -> str:
    """Where rank ``rank``'s (name, shape, dtype) list first differs from rank 0's."""
    for (n0, s0, d0), (n1, s1, d1) in zip(ours, theirs):
        if n0 != n1:
            return f"rank {rank}'s parameter '{n1}' is where rank 0 has '{n0}' (the models differ in structure)"
        if (s0, d0) != (s1, d1):
            return (f"rank {rank}'s parameter '{n1}' has shape {list(s1)} ({d1}) but rank 0's has {list(s0)} ({d0})")
    longer, rank_of = (ours, 0) if len(ours) > len(theirs) else (theirs, rank)
    extra = longer[min(len(ours), len(theirs))][0]
    return (f"rank {rank_of} has parameter '{extra}' that rank {rank if rank_of == 0 else 0} lacks "
            f"({len(ours)} parameters on rank 0, {len(theirs)} on rank {rank})")


@dataclass(frozen=True)
class CheckedPolicies:
    """The resolved arguments (defaults where a value was bad) and this rank's verdict."""

    precision: MixedPrecision | None
    nonfinite: NonFinitePolicy
    error: str | None
    signature: str


def check_policies(model: nn.Module, mixed_precision: Any, nonfinite: Any,
                   max_consecutive_skips: Any) -> CheckedPolicies:
    """Resolve ``mixed_precision`` and ``nonfinite``; the first problem found is the error, and
    ``signature`` what ranks must agree on."""
    errors: list[str] = []
    try:
        precision = resolve_precision(mixed_precision)
    except ValueError as e:
        precision = None
        errors.append(str(e))
    try:
        policy = NonFinitePolicy(nonfinite)
    except ValueError:
        policy = NonFinitePolicy.SKIP
        errors.append(f"nonfinite must be 'skip' or 'raise' (a poplar.NonFinitePolicy), got {nonfinite!r}")
    if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) \
            or max_consecutive_skips < 0:
        errors.append(f"max_consecutive_skips must be an int >= 0, got {max_consecutive_skips!r}")
    if precision is not None and precision.low_precision:
        others = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
        if others:
            errors.append(f"mixed_precision={precision.precision} needs an fp32 model (its fp32 values are the "
                          f"master weights) but trainable parameters are {others}; build the model in fp32")
    signature = repr((None if precision is None else precision.to_dict(), str(policy), max_consecutive_skips))
    return CheckedPolicies(precision, policy, errors[0] if errors else None, signature)


def plan_problem(plan: Any, world_size: int, zero_stage: int, in_iteration: bool) -> str | None:
    """Why ``plan`` cannot be taken now by a runtime of ``world_size`` ranks at ``zero_stage``
    (None: it can); every rank reports its verdict at one agreement."""
    if in_iteration:
        return "set_plan() inside an iteration; call it between iterations"
    if not isinstance(plan, Plan):
        return f"plan must be a Plan, got {plan!r}"
    return (plan.problem(world_size) or offload_problem(plan, zero_stage) or secondary_problem(plan, zero_stage)
            or left_out_problem(plan, zero_stage) or compression_problem(plan, zero_stage))


def left_out_problem(plan: Plan, zero_stage: int) -> str | None:
    """Why ``plan``'s ranks left out of the step cannot sit out at ``zero_stage``, or None.
    ZeRO-0 keeps the whole optimizer state on every rank: a rank that skipped steps would hold a
    stale one, so only the sharded stages (1-3) leave ranks out (docs/design.md §3.12)."""
    if plan.left_out and zero_stage == 0:
        return (f"the plan leaves ranks {list(plan.left_out)} out of the step (0 samples, shard_weight 0) at ZeRO-0, "
                "where every rank holds the whole optimizer state; ranks sit out at ZeRO-1, 2 and 3: use one of "
                "those, or give every rank samples")
    return None


def secondary_problem(plan: Plan, zero_stage: int) -> str | None:
    """Why ``plan``'s secondary shards cannot run at ``zero_stage`` (they are ZeRO-3's), or None."""
    if plan.collectives.secondary_shards and zero_stage != 3:
        return (f"the plan keeps secondary shards (collectives=\"secondary_shards\") but the stage is "
                f"ZeRO-{zero_stage}; secondary shards are of ZeRO-3's sharded parameters: use zero_stage=3, or "
                "collectives=\"hierarchical\"")
    return None


def compression_problem(plan: Plan, zero_stage: int) -> str | None:
    """Why ``plan``'s quantized collectives cannot run at ``zero_stage`` (a plan built without a
    stage is checked only here), or None."""
    problem = plan.compression.problem(zero_stage)
    return None if problem is None else f"plan: {problem}"


def build_stage(zero_stage: int, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                groups: list, bucket_size_mb: float, wrap_policy: Any, precision: StagePrecision,
                hooks: StageHooks, shards: Shards) -> ZeroStage:
    """The stage for ``zero_stage`` (0-3) over ``groups`` (the optimizer's (name, param) groups):
    stage 3 (blocks, ``zero.sharded``) or stages 0-2 (gradient buckets over replicated
    parameters, ``zero.replicated``), first parameter sync included; ``hooks`` are what the stage
    tells the runtime's observers as it happens; ``shards`` sets each rank's share of the
    sharded state."""
    with comm.ledger.scope(Phase.SETUP):
        if zero_stage == 3:
            from poplar.zero.sharded import Stage3
            return Stage3(model, optimizer, comm, groups, wrap_policy, hooks=hooks, precision=precision,
                          shards=shards)
        from poplar.zero.replicated import Stage0, Stage2
        from poplar.zero.stage1 import Stage1

        units = gradient_buckets(model, groups, shards, comm.rank, bucket_size_mb)
        stage_class = {0: Stage0, 1: Stage1, 2: Stage2}[zero_stage]
        stage = stage_class(model, optimizer, comm, units, precision=precision, hooks=hooks)
        stage.sync_params()
        return stage
