"""Poplar's tie rule: a conventional plan (``flops``, ``even``) predicted within the cost model's
resolution of the allocator's own is kept, and the plan's meta says so; a clear gain is not."""

import math

import numpy as np
import pytest

from poplar.planner.cost_model import CommModel
from poplar.planner.curves import SpeedCurve
from poplar.planner.groups import DeviceGroup
from poplar.planner.planning import Problem, plan, plan_problem
from poplar.types.profiles import CommProfile, Exposure, Links, Profile, ProfileError, ProfilePoint, RankProfile


def two_types(y_per_sample: float) -> list[DeviceGroup]:
    """X at 1 ms a sample, rated twice Y's TFLOP/s; Y at ``y_per_sample``."""
    return [DeviceGroup("X", [0], SpeedCurve("X", 0.001 * np.arange(1, 301)), nominal_tflops=2.0),
            DeviceGroup("Y", [1], SpeedCurve("Y", y_per_sample * np.arange(1, 301)), nominal_tflops=1.0)]


def shares(plan) -> list[int]:
    return [r.num_samples for r in plan.ranks]


@pytest.mark.parametrize("stage", [0, 2])
def test_a_near_tie_keeps_the_flops_plan(stage: int) -> None:
    # flops: 200 + 100 samples, Y last at 0.202 s; the allocator's 201 + 99 ends at 0.201 s, 0.5 % sooner
    problem = Problem(two_types(0.00202), CommModel(2, 0.0, 1e9), stage, 300)
    own = plan_problem(Problem(two_types(0.00202), CommModel(2, 0.0, 1e9), stage, 300, plan_tie=0.0), "poplar")
    assert shares(own) == [201, 99]
    got = plan_problem(problem, "poplar")
    assert shares(got) == shares(plan_problem(problem, "flops")) == [200, 100]
    kept = got.choice.search.kept
    assert kept.strategy == "flops"
    assert kept.own_predicted_s == pytest.approx(own.predicted_iteration_s)
    assert got.predicted_iteration_s == pytest.approx(kept.predicted_s) == pytest.approx(0.202)


def test_a_clear_gain_keeps_the_allocators_plan() -> None:
    # Y at 2.2 ms: flops' 200 + 100 ends at 0.22 s, the allocator's plan about 7 % sooner
    problem = Problem(two_types(0.0022), CommModel(2, 0.0, 1e9), 0, 300)
    got = plan_problem(problem, "poplar")
    assert got.choice.search.kept is None
    assert got.predicted_iteration_s < plan_problem(problem, "flops").predicted_iteration_s * 0.95


def test_without_spec_ratings_the_tie_falls_back_to_even() -> None:
    groups = [DeviceGroup("X", [0], SpeedCurve("X", 0.001 * np.arange(1, 301))),
              DeviceGroup("Y", [1], SpeedCurve("Y", 0.001005 * np.arange(1, 301)))]
    got = plan_problem(Problem(groups, CommModel(2, 0.0, 1e9), 0, 300), "poplar")
    assert shares(got) == [150, 150] and got.choice.search.kept.strategy == "even"


@pytest.mark.parametrize("exposed_error, kept", [(None, False), (0.004, False), (0.006, True), (0.01, True)])
def test_a_profile_that_knew_its_exposure_less_well_widens_the_tie(exposed_error, kept) -> None:
    # Y at 2.05 ms: the allocator's 202 + 98 ends at 0.202 s, 1.5 % before flops' 200 + 100 (0.205 s):
    # past the 1 % tie and 2 sqrt(2) errors of 0.4 % (1.13 %), within those of 0.6 % (1.7 %)
    def rank(i: int, dtype: str, per_sample: float, tflops: float) -> RankProfile:
        points = [ProfilePoint(b, per_sample * b) for b in (1, 50, 100, 200, 300)]
        return RankProfile(i, dtype, 300, points, nominal_tflops=tflops)

    prof = Profile(0, 2, 10, 40, [rank(0, "X", 0.001, 2.0), rank(1, "Y", 0.00205, 1.0)],
                   CommProfile(Links(1e12), exposure=Exposure(error=exposed_error)))
    got = plan(prof, 300, 0)
    assert shares(got) == ([200, 100] if kept else [202, 98])
    assert (got.choice.search.kept is not None) == kept
    if kept:
        assert got.choice.search.kept.tie == pytest.approx(math.sqrt(8) * exposed_error)
        assert got.choice.search.kept.own_predicted_s == pytest.approx(0.202, rel=1e-3)


def test_a_profile_with_an_exposure_error_outside_a_fraction_is_refused() -> None:
    points = [ProfilePoint(b, 0.001 * b) for b in (1, 2)]
    with pytest.raises(ProfileError, match="comm.exposure.error"):
        Profile(0, 1, 10, 40, [RankProfile(0, "X", 2, points)],
                CommProfile(Links(1e12), exposure=Exposure(error=1.5)))


def test_within_the_tie_flops_comes_before_even_even_when_even_is_the_allocators_plan() -> None:
    # equally fast types behind a link that takes 10 s: even's 150 + 150 is the allocator's plan,
    # flops' 200 + 100 is predicted 0.5 % slower
    groups = [DeviceGroup("X", [0], SpeedCurve("X", 0.001 * np.arange(1, 301)), nominal_tflops=2.0),
              DeviceGroup("Y", [1], SpeedCurve("Y", 0.001 * np.arange(1, 301)), nominal_tflops=1.0)]
    link = CommModel(2, 1e9, 1e8)  # an all-reduce of 1 GB: 2 x 1/2 x 1e9 / 1e8 = 10 s
    own = plan_problem(Problem(groups, link, 0, 300, plan_tie=0.0), "poplar")
    assert shares(own) == [150, 150] == shares(plan_problem(Problem(groups, link, 0, 300), "even"))
    got = plan_problem(Problem(groups, link, 0, 300), "poplar")
    assert shares(got) == [200, 100] and got.choice.search.kept.strategy == "flops"
    assert got.predicted_iteration_s == pytest.approx(own.predicted_iteration_s + 0.05)
