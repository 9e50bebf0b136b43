"""What a runtime checks of a plan it is given to run (``ZeroRuntime.set_plan``), as a message
naming the problem and the fix, or None: every rank reports its verdict at one agreement."""

from __future__ import annotations

from typing import Any

from poplar.types.plans import Plan
from poplar.zero.offload import offload_problem


def plan_problem(plan: Any, world_size: int, zero_stage: int, in_iteration: bool) -> str | None:
    """Why ``plan`` cannot be taken now by a runtime of ``world_size`` ranks at ``zero_stage``."""
    if in_iteration:
        return "set_plan() inside an iteration; call it between iterations"
    if not isinstance(plan, Plan):
        return f"plan must be a Plan, got {plan!r}"
    return plan.problem(world_size) or offload_problem(plan, zero_stage)
