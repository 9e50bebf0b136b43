"""Simulator: predicted throughput of each strategy on a measured profile, for what-if questions.

Input is a ``Profile`` (or its dict or JSON file). Every strategy is planned and priced by the
same cost model; the result lists, per strategy, predicted samples/s, iteration and
communication seconds, and per rank its share and idle %. (A cluster described by GPU presets
instead of measured is simulated through a synthetic profile: ``poplar.emulation.simulate``.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from poplar.types.plans import Plan, PlanError, write_text_atomic
from poplar.planner import collective_choice
from poplar.types.route import Collectives
from poplar.planner.planning import STRATEGIES, make_problem, plan_problem
from poplar.types.profiles import Profile


@dataclass
class StrategyResult:
    strategy: str
    plan: Plan | None = None
    error: str | None = None  # why this strategy has no plan (e.g. a baseline that cannot apply)

    @property
    def iteration_s(self) -> float:
        return float(self.plan.predicted_iteration_s) if self.plan else float("nan")

    @property
    def samples_per_s(self) -> float:
        return self.plan.global_batch_size / self.iteration_s if self.plan else float("nan")

    def idle_pct(self) -> list[float]:
        """Per rank: (iteration - own compute) / iteration, in %."""
        if not self.plan:
            return []
        t = self.iteration_s
        return [100.0 * (t - (r.predicted_compute_s or 0.0)) / t for r in self.plan.ranks]

    def to_dict(self) -> dict[str, Any]:
        if not self.plan:
            return {"strategy": self.strategy, "error": self.error}
        return {"strategy": self.strategy, "samples_per_s": self.samples_per_s, "iteration_s": self.iteration_s,
                "comm_s": self.plan.predicted_comm_s, "idle_pct": self.idle_pct(), "plan": self.plan.to_dict()}


@dataclass
class Simulation:
    source: str
    zero_stage: int
    global_batch_size: int
    results: list[StrategyResult] = field(default_factory=list)

    def result(self, strategy: str) -> StrategyResult:
        return next(r for r in self.results if r.strategy == strategy)

    def speedup(self, strategy: str, over: str = "even") -> float:
        return self.result(strategy).samples_per_s / self.result(over).samples_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "zero_stage": self.zero_stage, "global_batch_size": self.global_batch_size,
                "results": [r.to_dict() for r in self.results]}

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def table(self) -> str:
        """A summary line per strategy, then one line per rank with each strategy's share and idle %."""
        base = next((r for r in self.results if r.strategy == "even" and r.plan), None)
        lines = [f"{self.source}, ZeRO-{self.zero_stage}, global batch {self.global_batch_size}",
                 f"{'strategy':<8} {'samples/s':>10} {'iteration s':>12} {'comm s':>8} {'micro-steps':>11} {'vs even':>8}"]
        for r in self.results:
            if not r.plan:
                lines.append(f"{r.strategy:<8} {'-':>10}  ({r.error})")
                continue
            vs = f"{r.samples_per_s / base.samples_per_s:.3f}x" if base else "-"
            way = "" if r.plan.collectives is Collectives.FLAT else " " + r.plan.collectives.value.replace("_", " ")
            lines.append(f"{r.strategy:<8} {r.samples_per_s:>10.2f} {r.iteration_s:>12.4f} "
                         f"{r.plan.predicted_comm_s:>8.4f} {r.plan.max_micro_steps:>11} {vs:>8}{way}")
        planned = [r for r in self.results if r.plan]
        if planned:
            lines.append("")
            head = f"{'rank':>4} {'device':<12}" + "".join(f" {r.strategy + ': b x gas + lbs = n':>27} {'idle%':>6}"
                                                          for r in planned)
            lines.append(head)
            idle = {r.strategy: r.idle_pct() for r in planned}
            for i in range(planned[0].plan.world_size):
                dev = planned[0].plan.ranks[i].device_type or "-"
                cells = ""
                for r in planned:
                    rp = r.plan.ranks[i]
                    share = f"{rp.micro_batch_size}x{rp.accum_steps}+{rp.last_batch_size}={rp.num_samples}"
                    cells += f" {share:>27} {idle[r.strategy][i]:>6.1f}"
                lines.append(f"{i:>4} {dev:<12}{cells}")
        return "\n".join(lines)


def simulate(profile: Profile | str | os.PathLike | Mapping[str, Any], global_batch_size: int,
             zero_stage: int | None = None, strategies: Iterable[str] = STRATEGIES, require_all_ranks: bool = False,
             max_micro_steps: int | None = None, source: str | None = None) -> Simulation:
    """Plan every strategy on a measured profile (a ``Profile``, its dict, or a profile file) and
    compare them. ``zero_stage`` defaults to the profile's stage; ``source`` names the input in
    the table (default: the profile's model and rank count)."""
    profile = _resolve(profile)
    problem = make_problem(profile, global_batch_size, zero_stage, require_all_ranks=require_all_ranks,
                           max_micro_steps=max_micro_steps)
    label = source or f"profile ({profile.model_name or 'model'}, {profile.world_size} ranks)"
    sim = Simulation(label, problem.stage, global_batch_size)
    ways = collective_choice.ways(profile, problem.stage, None)

    def planned(way: Collectives, name: str, share: float) -> Plan:
        """``name``'s plan with the collectives run ``way`` (a job that spans nodes; once per
        iteration for ``share`` of the parameters)."""
        at = make_problem(collective_choice.profile_as(profile, way, problem.stage, share), global_batch_size,
                          zero_stage, require_all_ranks=require_all_ranks, max_micro_steps=max_micro_steps,
                          collectives=way, held_share=share)
        found = plan_problem(at, name)
        found.choice = replace(found.choice, plan_tie=at.plan_tie)
        return found

    def fastest_share(way: Collectives, name: str) -> Plan:
        shares = collective_choice.held_shares(profile, way, problem.stage)
        return collective_choice.fastest_share(shares, lambda share: planned(way, name, share))

    for name in strategies:
        try:
            if len(ways) > 1:  # each strategy with its fastest way (``planner.collective_choice``)
                sim.results.append(StrategyResult(name, collective_choice.fastest(ways, lambda w: fastest_share(w, name))))
                continue
            sim.results.append(StrategyResult(name, plan_problem(problem, name)))
        except PlanError as e:  # a baseline that cannot apply is reported, not fatal
            if name not in STRATEGIES:
                raise
            sim.results.append(StrategyResult(name, error=str(e)))
    return sim


def _resolve(obj: Any) -> Profile:
    if isinstance(obj, Profile):
        return obj
    if isinstance(obj, Mapping):
        return Profile.from_dict(dict(obj))
    if isinstance(obj, (str, os.PathLike)):
        return Profile.load(Path(obj))
    raise PlanError(f"simulate() takes a Profile, its dict or a profile file, got {type(obj).__name__}; "
                    "simulate a cluster of GPU presets with poplar.emulation.simulate")
