"""The planner: speed curves from a profile, per-rank batch allocation, baselines, simulator.

``plan(profile, global_batch_size, zero_stage, strategy)`` returns a ``Plan``;
``simulate(profile, global_batch_size, zero_stage)`` compares strategies.
"""

from poplar.planner.cost_model import CommModel, Evaluation, evaluate_rows
from poplar.planner.curves import SpeedCurve
from poplar.planner.groups import DeviceGroup, group_profile
from poplar.planner.planning import STRATEGIES, CollectivesRequest, Problem, make_problem, plan, plan_problem
from poplar.planner.simulator import Simulation, StrategyResult, simulate

__all__ = [
    "plan", "simulate", "STRATEGIES", "SpeedCurve", "DeviceGroup", "group_profile", "CommModel",
    "Evaluation", "evaluate_rows", "Problem", "make_problem", "plan_problem", "Simulation",
    "StrategyResult", "CollectivesRequest",
]
