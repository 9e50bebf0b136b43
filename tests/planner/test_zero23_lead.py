"""The ZeRO-2/3 allocator with a measured lead exposure: its shortlist, priced again with led
last steps by the full cost model, finds the led single step that the constant-exposure search
cannot see, and never does worse than that search's own plan."""

import itertools
import random

import numpy as np
import pytest

from poplar.planner.cost_model import CommModel
from poplar.planner.curves import SpeedCurve
from poplar.planner.groups import DeviceGroup
from poplar.planner.planning import Problem, plan_problem
from poplar.planner.zero23 import allocate_zero23


def four_and_four() -> list[DeviceGroup]:
    """4 X + 4 Y, X twice as fast (like 4 A800 + 4 V100S): t_X(b) = 0.01 b, t_Y(b) = 0.02 b."""
    return [DeviceGroup("X", [0, 1, 2, 3], SpeedCurve("X", 0.01 * np.arange(1, 13))),
            DeviceGroup("Y", [4, 5, 6, 7], SpeedCurve("Y", 0.02 * np.arange(1, 7)))]


def family_best(p: Problem) -> float:
    """Brute force over the allocator's family, one row per type: G full micro-steps of b, then
    a last one of l <= b (a type with b = 0 takes nothing), priced by the full cost model."""
    per_type = [[(b, l_) for b in range(g.curve.mbs + 1) for l_ in range(b + 1)] for g in p.groups]
    best = np.inf
    for full in range(1, p.gbs + 1):
        for pick in itertools.product(*per_type):
            if sum(g.count * (full * b + l_) for g, (b, l_) in zip(p.groups, pick)) != p.gbs:
                continue
            rows = [[(b, full, l_) if b else (0, 0, 0)] * g.count for g, (b, l_) in zip(p.groups, pick)]
            best = min(best, p.evaluate(rows).iteration_s)
    return best


def test_a_led_single_step_wins_where_leading_exposes_less() -> None:
    comm = CommModel(8, 0.0, 1e9, measured_stage=3, exposed_micro_step_s=0.15, exposed_iteration_s=0.03,
                     exposed_lead_s=(("X", 0.09), ("Y", 0.10)))
    p = Problem(four_and_four(), comm, 3, 48)
    constant, _ = allocate_zero23(p.groups, 48, 3, comm)
    assert constant == [[(8, 1, 0)] * 4, [(4, 1, 0)] * 4]  # balanced: 0.08 s each
    got = plan_problem(p, "poplar")
    # X at 10 samples (0.10 s) leads Y's 2 (0.04 s) by 60 %, past the led rounds' half: 0.10 + 0.09
    # exposed, not 0.08 + 0.15 (9 + 3 leads by a third and gets two thirds of the gain: 0.09 + 0.11)
    assert [(r.micro_batch_size, r.accum_steps) for r in got.ranks] == [(10, 1)] * 4 + [(2, 1)] * 4
    assert got.predicted_iteration_s < p.evaluate(constant).iteration_s - 0.02
    assert got.predicted_iteration_s == pytest.approx(family_best(p), rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_led_pricing_never_loses_to_the_constant_search(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        groups = four_and_four()
        lead = tuple((g.device_type, rng.uniform(0.0, 0.2)) for g in groups)
        comm = CommModel(8, 0.0, 1e9, measured_stage=2, exposed_micro_step_s=rng.uniform(0.0, 0.2),
                         exposed_iteration_s=rng.uniform(0.0, 0.05), exposed_lead_s=lead,
                         exposed_switch_s=rng.choice([0.0, 0.01]))
        gbs = rng.randint(1, 80)
        p = Problem(groups, comm, 2, gbs, require_all_ranks=gbs >= 8 and rng.random() < 0.3)
        constant, _ = allocate_zero23(groups, gbs, 2, comm, p.require_all_ranks)
        got = plan_problem(p, "poplar")
        assert sum(r.num_samples for r in got.ranks) == gbs
        if p.require_all_ranks:
            assert all(r.num_samples >= 1 for r in got.ranks)
        assert got.predicted_iteration_s <= p.evaluate(constant).iteration_s + 1e-12
