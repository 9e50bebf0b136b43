"""The exact ideal (``poplar.emulation.ideal``): equal to brute force over every runnable plan on
small instances, never beaten by any strategy's plan under the same curves, and its own plan
reaches it."""

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest

from poplar.types.plans import PlanError
from poplar.planner.cost_model import CommModel, evaluate_rows
from poplar.planner.curves import SpeedCurve
from poplar.planner.groups import DeviceGroup
from poplar.emulation.ideal import _lockstep, fastest_splits, ideal
from poplar.planner.planning import Problem, plan_problem
from poplar.planner.zero01 import canonical


def random_groups(rng: random.Random, max_types: int, max_count: int, max_mbs: int, max_world: int):
    while True:
        groups, rank = [], 0
        for t in range(rng.randint(1, max_types)):
            count, mbs = rng.randint(1, max_count), rng.randint(1, max_mbs)
            if rng.random() < 0.6:  # GPU-like: overhead + per-sample cost
                peak, half, over = rng.uniform(1, 10), rng.uniform(0, 4), rng.uniform(0, 0.5)
                times = [over + (b + half) / peak for b in range(1, mbs + 1)]
            else:  # arbitrary, made non-decreasing by the curve
                times = [rng.uniform(0.1, 3.0) for _ in range(mbs)]
            groups.append(DeviceGroup(f"T{t}", list(range(rank, rank + count)), SpeedCurve(f"T{t}", np.array(times)),
                                      nominal_tflops=rng.uniform(10, 300)))
            rank += count
        if rank <= max_world:
            return groups


def random_instance(rng: random.Random, max_gbs: int, **limits: int) -> tuple:
    """(groups, global batch, comm model) of a random problem."""
    groups = random_groups(rng, **limits)
    return groups, rng.randint(1, max_gbs), random_comm(rng, sum(g.count for g in groups))


def random_comm(rng: random.Random, world: int) -> CommModel:
    return CommModel(world, rng.choice([0.0, 1e8, 1e9]), 1e9, rng.choice([0.0, 1e-3]))


def all_rows(mbs: int, gbs: int) -> dict[int, list[tuple[int, int, int]]]:
    """Every canonical row (b, gas, lbs) with b, lbs <= mbs and at most gbs samples, by samples."""
    rows = {(0, 0, 0)}
    for b in range(1, mbs + 1):
        for gas in range(gbs + 1):
            for lbs in range(mbs + 1):
                if b * gas + lbs <= gbs:
                    rows.add(canonical(b, gas, lbs))
    by_n: dict[int, list] = {}
    for r in sorted(rows):
        by_n.setdefault(r[0] * r[1] + r[2], []).append(r)
    return by_n


def brute_force(groups, gbs: int, stage: int, comm: CommModel) -> float:
    """Min of the cost model over every assignment of rows to ranks with gbs samples in all
    (ranks of one type as multisets: their order does not change the cost)."""
    curves = {g.device_type: g.curve for g in groups}
    per_type = []
    for g in groups:
        rows = [r for rs in all_rows(g.mbs, gbs).values() for r in rs]
        by_total: dict[int, list] = {}
        for combo in itertools.combinations_with_replacement(rows, g.count):
            n = sum(b * gas + lbs for b, gas, lbs in combo)
            if n <= gbs:
                by_total.setdefault(n, []).append(combo)
        per_type.append(by_total)
    best = math.inf

    def walk(t: int, left: int, chosen: list) -> None:
        nonlocal best
        if t == len(groups) - 1:
            for combo in per_type[t].get(left, []):
                rows = [(groups[i].device_type, *r) for i, c in enumerate(chosen + [combo]) for r in c]
                best = min(best, evaluate_rows(rows, curves, stage, comm).iteration_s)
            return
        for n, combos in per_type[t].items():
            if n <= left:
                for combo in combos:
                    walk(t + 1, left - n, chosen + [combo])

    walk(0, gbs, [])
    return best


def check_plan(result, groups, gbs, stage, comm) -> None:
    """The ideal's own plan is runnable (within mbs, gbs samples) and costs exactly its value."""
    curves = {g.device_type: g.curve for g in groups}
    assert result.global_batch_size == gbs
    for rank, (dtype, b, gas, lbs) in enumerate(result.rows):
        assert dtype == next(g.device_type for g in groups if rank in g.ranks)
        assert max(b, lbs) <= curves[dtype].mbs
    assert evaluate_rows(result.rows, curves, stage, comm).iteration_s == pytest.approx(result.iteration_s, rel=1e-12)
    assert result.plan().global_batch_size == gbs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ideal_equals_brute_force(stage):
    rng = random.Random(10 + stage)
    for _ in range(30):
        groups, gbs, comm = random_instance(rng, 8, max_types=3, max_count=2, max_mbs=3, max_world=3)
        got = ideal(groups, gbs, stage, comm)
        want = brute_force(groups, gbs, stage, comm)
        assert got.iteration_s == pytest.approx(want, rel=1e-12, abs=1e-12), (groups, gbs)
        check_plan(got, groups, gbs, stage, comm)


@pytest.mark.parametrize("stage", [2, 3])
def test_ideal_equals_brute_force_when_a_leading_step_exposes_less(stage):
    rng = random.Random(40 + stage)
    for i in range(25):
        groups, gbs, comm = random_instance(rng, 8, max_types=3, max_count=2, max_mbs=3, max_world=3)
        comm = dataclasses.replace(comm, measured_stage=stage, exposed_micro_step_s=0.5, exposed_iteration_s=0.1,
                                   exposed_lead_s=(("T0", [0.1, 0.3, 0.8][i % 3]), ("T1", 0.2)),  # 0.8: more
                                   exposed_steps=((0.3, 0.8, 2.0), (1.2, 0.9, 0.5)) if i % 2 else None)
        got = ideal(groups, gbs, stage, comm)
        assert got.iteration_s == pytest.approx(brute_force(groups, gbs, stage, comm), rel=1e-12, abs=1e-12)
        check_plan(got, groups, gbs, stage, comm)


def test_fastest_splits_match_enumeration():
    rng = random.Random(3)
    for _ in range(20):
        g = random_groups(rng, 1, 1, 6, 1)[0]
        f, bb, bl = fastest_splits(g.curve, 25)
        for n in range(26):
            best = min(gas * g.curve.time(b) + g.curve.time(lbs) for b in range(1, g.mbs + 1)
                       for gas in range(n + 1) for lbs in range(g.mbs + 1) if gas * b + lbs == n)
            assert f[n] == pytest.approx(best, rel=1e-12)
            assert (n - bl[n]) // max(bb[n], 1) * g.curve.time(bb[n]) + g.curve.time(bl[n]) == pytest.approx(f[n])
        assert np.all(np.diff(f) >= -1e-12)  # non-decreasing: what the stage 0/1 search relies on


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_strategy_beats_the_ideal(stage):
    rng = random.Random(100 + stage)
    for _ in range(25):
        groups, gbs, comm = random_instance(rng, 60, max_types=3, max_count=3, max_mbs=10, max_world=6)
        best = ideal(groups, gbs, stage, comm)
        check_plan(best, groups, gbs, stage, comm)
        problem = Problem(groups, comm, stage, gbs)
        for strategy in ("poplar", "even", "flops"):
            got = plan_problem(problem, strategy).predicted_iteration_s
            assert got >= best.iteration_s * (1 - 1e-12), (strategy, got, best.iteration_s)
        # within its tie poplar may keep a conventional plan; without one, the allocator's own
        assert plan_problem(problem, "poplar").predicted_iteration_s <= best.iteration_s * (1 + problem.plan_tie)
        if stage in (0, 1):  # the threshold allocator is exact over the same family
            own = plan_problem(Problem(groups, comm, stage, gbs, plan_tie=0.0), "poplar")
            assert own.predicted_iteration_s == pytest.approx(best.iteration_s, rel=1e-9)
        curves = {g.device_type: g.curve for g in groups}
        for _ in range(20):  # random runnable plans never beat it either
            shares = np.bincount(rng.choices(range(comm.world_size), k=gbs), minlength=comm.world_size)
            rows = []
            for g in groups:
                for r in g.ranks:
                    b = rng.randint(1, g.mbs)
                    lbs = rng.randint(0, min(int(shares[r]), g.mbs))
                    gas, rest = divmod(int(shares[r]) - lbs, b)
                    rows.append((g.device_type, *canonical(b, gas, lbs + rest)) if lbs + rest <= g.mbs
                                else (g.device_type, *canonical(1, int(shares[r]), 0)))
            assert evaluate_rows(rows, curves, stage, comm).iteration_s >= best.iteration_s * (1 - 1e-12)


def test_lockstep_ideal_can_beat_the_planners_shape():
    # One rank, t(1..3) = 1.0, 1.05, 2.0 s, 7 samples: 2 + 2 + 3 (a last micro-step larger than
    # the full ones) takes 4.1 s; the planner's shape (last <= full) gets 2 + 2 + 2 + 1 = 4.15 s.
    g = [DeviceGroup("X", [0], SpeedCurve("X", np.array([1.0, 1.05, 2.0])))]
    comm = CommModel(1, 0, 1e9)
    best = ideal(g, 7, 2, comm)
    assert best.iteration_s == pytest.approx(4.1)
    assert best.rows == [("X", 2, 2, 3)]
    assert plan_problem(Problem(g, comm, 2, 7), "poplar").predicted_iteration_s == pytest.approx(4.15)


@pytest.mark.parametrize("stage", [2, 3])
def test_lockstep_pruning_keeps_the_optimum(stage):
    # the bound-ordered search stops early; the exhaustive one tries every vector of full-step sizes
    rng = random.Random(200 + stage)
    for _ in range(12):
        groups, gbs, comm = random_instance(rng, 50, max_types=2, max_count=3, max_mbs=9, max_world=5)
        c_m, c_s = comm.per_micro_step_s(stage), comm.per_iteration_s(stage)

        def price(times):
            return comm.lockstep_s(stage, times, [g.device_type for g in groups])

        _, pruned, tried = _lockstep(groups, gbs, price, c_m, c_s)
        _, full, every = _lockstep(groups, gbs, price, c_m, c_s, prune=False)
        assert pruned == pytest.approx(full, rel=1e-12)
        assert tried <= every


def test_bad_input_is_a_clear_error():
    g = [DeviceGroup("X", [0, 1], SpeedCurve("X", np.array([1.0, 1.5])))]
    comm = CommModel(2, 0, 1e9)
    with pytest.raises(PlanError, match="global_batch_size must be an int >= 1"):
        ideal(g, 0, 0, comm)
    with pytest.raises(PlanError, match="zero_stage must be 0, 1, 2 or 3"):
        ideal(g, 4, 5, comm)
    with pytest.raises(PlanError, match="comm model is for 3 ranks"):
        ideal(g, 4, 0, CommModel(3, 0, 1e9))
    with pytest.raises(PlanError, match="cover ranks 0..1"):
        ideal([DeviceGroup("X", [0, 2], g[0].curve)], 4, 0, comm)
