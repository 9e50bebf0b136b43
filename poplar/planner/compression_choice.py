"""Choosing a plan's quantized collectives where the user allows lossy communication
(``plan(..., allow_lossy=True)``, ``AutoOptions(allow_lossy=True)``; docs/design.md §5.2).

Quantization changes the step: it is no longer exactly the step of the whole global batch. So:

- A policy given (``plan(..., compression=CommPolicy(...))``) is used as given, at a stage it
  admits (``CommPolicy.problem``), and priced as such (``quantized_pricing``).
- None given and ``allow_lossy`` off (the default): every plan is exact. Nothing else here runs.
- ``allow_lossy`` on: on a job that spans nodes, each option that applies to the stage is planned
  in full (batches, shards, placements, the way of running the collectives): int8 weights at
  ZeRO-3, int8 gradients at ZeRO-2/3, both at ZeRO-3, every one across nodes only
  (``QuantScope.CROSS_NODE``). A lossy plan is kept only where it is predicted faster than the
  fastest exact plan by more than the plan's tie (``Plan.choice.plan_tie``): a gain the cost
  model cannot resolve is not worth a step that is no longer exact. On one node (nothing crosses
  a node) and at ZeRO-0/1 (no collective a policy quantizes: weights are ZeRO-3's gathers,
  gradients ZeRO-2/3's reduce-scatters) there is no option, and the plan is exact.

The plan records the comparison in ``PlanChoice.compression_choice``: every option's predicted
iteration, which was kept, and the predicted saving over exact.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from poplar.planner.fastest import Candidate
from poplar.planner.fastest import fastest as choose
from poplar.types.compression import EXACT, CommPolicy, QuantBits
from poplar.types.plans import CompressionCandidate, CompressionChoice, Plan, PlanError

# The lossy options auto mode prices, in the order that wins a tie among them: the fewer
# quantized collectives first (each is a step further from the exact one).
OPTIONS = (CommPolicy(weights=QuantBits.INT8), CommPolicy(gradients=QuantBits.INT8),
           CommPolicy(weights=QuantBits.INT8, gradients=QuantBits.INT8))


def lossy_options(stage: int, spans_nodes: bool) -> list[CommPolicy]:
    """The lossy options that apply at ``stage`` on a job that spans nodes (none on one node)."""
    if not spans_nodes:
        return []
    return [option for option in OPTIONS if option.problem(stage) is None]


def fastest(exact: Plan, options: list[CommPolicy], planned: Callable[[CommPolicy], Plan]) -> Plan:
    """``exact`` (the fastest exact plan) or the plan of a lossy option (``planned``), whichever
    is predicted fastest, exact first within the tie (exact's own: a gain the cost model cannot
    resolve is not worth a step that is no longer exact), else the fastest option; the plan
    records every option planned."""
    if not options:
        return exact
    found = [Candidate(CompressionCandidate(EXACT, exact.predicted_iteration_s), exact, preference=0)]
    for option in options:
        try:
            plan = planned(option)
        except PlanError as e:
            found.append(Candidate(CompressionCandidate(option, None, str(e))))
            continue
        found.append(Candidate(CompressionCandidate(option, plan.predicted_iteration_s), plan, preference=1))
    tie = exact.choice.plan_tie or 0.0
    exact_s = exact.predicted_iteration_s
    chosen = exact if exact_s is None else choose(found, tie).plan
    assert chosen is not None
    record = CompressionChoice(chosen.compression, exact_s, chosen.predicted_iteration_s, tie,
                               tuple(c.row for c in found))
    return replace(chosen, meta=dict(chosen.meta), choice=replace(chosen.choice, compression_choice=record))
