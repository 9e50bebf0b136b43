"""Simulator: predicted throughput of each strategy on a cluster, for what-if questions.

Input is a cluster (built-in name, cluster file or ``ClusterSpec``; curves then come from the
device presets through a synthetic profile) or a measured ``Profile``. Every strategy is
planned and priced by the same cost model; the result lists, per strategy, predicted
samples/s, iteration and communication seconds, and per rank its share and idle %.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from poplar.types.cluster import ClusterSpec
from poplar.types.plans import Plan, PlanError, write_text_atomic
from poplar.planner.planning import STRATEGIES, make_problem, plan_problem
from poplar.planner.synthetic import REFERENCE_MODEL, ModelSpec, synthetic_profile
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
            lines.append(f"{r.strategy:<8} {r.samples_per_s:>10.2f} {r.iteration_s:>12.4f} "
                         f"{r.plan.predicted_comm_s:>8.4f} {r.plan.max_micro_steps:>11} {vs:>8}")
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


def simulate(cluster_or_profile: ClusterSpec | Profile | str | os.PathLike | Mapping[str, Any],
             global_batch_size: int, zero_stage: int | None = None,
             strategies: Iterable[str] = STRATEGIES, model: ModelSpec = REFERENCE_MODEL,
             memory_scale: float = 1.0, require_all_ranks: bool = False,
             max_micro_steps: int | None = None) -> Simulation:
    """Plan every strategy on a cluster (preset curves) or a measured profile and compare them.

    A string is a built-in cluster name, or a path to a cluster file or a profile file (a JSON
    object with ``devices`` is a cluster, one with ``ranks`` a profile). ``zero_stage`` is
    required for a cluster and defaults to the profile's stage for a profile.
    """
    source, profile = _resolve(cluster_or_profile, zero_stage, model, memory_scale)
    problem = make_problem(profile, global_batch_size, zero_stage, require_all_ranks=require_all_ranks,
                           max_micro_steps=max_micro_steps)
    sim = Simulation(source, problem.stage, global_batch_size)
    for name in strategies:
        try:
            sim.results.append(StrategyResult(name, plan_problem(problem, name)))
        except PlanError as e:  # a baseline that cannot apply is reported, not fatal
            if name not in STRATEGIES:
                raise
            sim.results.append(StrategyResult(name, error=str(e)))
    return sim


def _resolve(obj: Any, zero_stage: int | None, model: ModelSpec, memory_scale: float) -> tuple[str, Profile]:
    if isinstance(obj, Profile):
        return f"profile ({obj.model_name or 'model'}, {obj.world_size} ranks)", obj
    if isinstance(obj, Mapping) and "ranks" in obj:
        return _resolve(Profile.from_dict(dict(obj)), zero_stage, model, memory_scale)
    if isinstance(obj, Mapping):
        obj = ClusterSpec.from_dict(dict(obj))
    if isinstance(obj, (str, os.PathLike)) and not isinstance(obj, ClusterSpec):
        path = Path(obj)
        if path.suffix == ".json" and path.exists():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:
                data = None  # ClusterSpec.load below reports it
            if isinstance(data, dict) and "ranks" in data:
                return _resolve(Profile.load(path), zero_stage, model, memory_scale)
        obj = ClusterSpec.resolve(obj)
    if zero_stage is None:
        raise PlanError("simulating a cluster needs a ZeRO stage (0-3)")
    spec: ClusterSpec = obj
    return (f"cluster {spec.describe()} [{model.name}]",
            synthetic_profile(spec, zero_stage, model, memory_scale))
