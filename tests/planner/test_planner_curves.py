"""Speed curves and the cost model's communication terms."""

import math

import numpy as np
import pytest

from poplar.planner.cost_model import CommModel
from poplar.planner.curves import SpeedCurve
from poplar.emulation.synthetic import profile_points
from poplar.emulation.presets import PRESETS
from poplar.types.profiles import ProfileError


def preset_curve(name, mbs):
    p = PRESETS[name]
    return SpeedCurve.from_points(name, mbs, [(b, p.time_s(b)) for b in profile_points(mbs)]), p


@pytest.mark.parametrize("name,mbs", [("A100-80G", 77), ("T4-16G", 13), ("RTX3060-12G", 9), ("V100S-32G", 300)])
def test_spline_reproduces_preset_curve(name, mbs):
    curve, p = preset_curve(name, mbs)
    truth = np.array([p.speed(b) for b in range(1, mbs + 1)])
    assert np.max(np.abs(curve.speeds - truth) / truth) < 0.005
    assert curve.peak_batch == mbs  # preset speed rises all the way to mbs
    assert curve.mbs == mbs


def test_measured_points_are_kept_and_times_non_decreasing():
    pts = [(1, 0.10), (2, 0.11), (4, 0.30), (8, 0.25), (16, 0.60)]  # a dip at 8: noise
    curve = SpeedCurve.from_points("X", 16, pts)
    assert np.all(np.diff(curve.times) >= 0)
    assert curve.time(1) == pytest.approx(0.10) and curve.time(2) == pytest.approx(0.11)
    assert curve.time(16) == pytest.approx(0.60)
    assert curve.time(8) >= curve.time(4)  # the dip is flattened into the envelope
    assert curve.time(0) == 0.0


def test_an_mbs_cut_between_measured_batches_is_interpolated_toward_the_point_past_it():
    # (Note: an mbs between measured batches) a profile timed at 1, 2, 4, 6, 8 whose mbs falls to 7
    p = PRESETS["A100-80G"]
    pts = [(b, p.time_s(b)) for b in (1, 2, 4, 6, 8)]
    whole = SpeedCurve.from_points("A100-80G", 8, pts)
    cut = SpeedCurve.from_points("A100-80G", 7, [x for x in pts if x[0] <= 7], above=[x for x in pts if x[0] > 7])
    assert cut.mbs == 7 and np.array_equal(cut.times, whole.times[:7])  # the whole profile's curve, cut
    assert cut.time(7) == pytest.approx(p.time_s(7), rel=0.005)
    # without the point past it, 7 samples are priced at the speed measured at 6: slow
    held = SpeedCurve.from_points("A100-80G", 7, [x for x in pts if x[0] <= 7])
    assert held.time(7) == pytest.approx(pts[3][1] * 7 / 6) and held.time(7) > 1.02 * p.time_s(7)
    # an mbs that was measured takes nothing from past it
    below = [x for x in pts if x[0] <= 6]
    assert np.array_equal(SpeedCurve.from_points("A100-80G", 6, below, above=[(8, 1e3)]).times,
                          SpeedCurve.from_points("A100-80G", 6, below).times)


def test_peak_in_the_middle():
    # speed rises to batch 8 then falls (memory pressure)
    pts = [(b, b / (10 * b / (b + 2) * (1 if b <= 8 else 8 / b) ** 0.5)) for b in (1, 2, 4, 8, 16, 32)]
    curve = SpeedCurve.from_points("X", 32, pts)
    assert 6 <= curve.peak_batch <= 12
    assert curve.peak_speed == pytest.approx(max(curve.speeds))


def test_one_and_two_points():
    one = SpeedCurve.from_points("X", 8, [(4, 0.4)])
    assert np.allclose(one.speeds, 10.0)  # constant speed
    two = SpeedCurve.from_points("X", 8, [(2, 0.2), (8, 0.4)])
    assert two.time(2) == pytest.approx(0.2) and two.time(8) == pytest.approx(0.4)
    assert np.all(np.diff(two.times) >= 0) and np.all(two.times > 0)


def test_ranks_of_a_type_merge_by_median():
    pts = [(4, 1.0), (4, 1.2), (4, 5.0), (8, 2.0)]
    curve = SpeedCurve.from_points("X", 8, pts)
    assert curve.time(4) == pytest.approx(1.2)


def test_points_beyond_mbs_are_ignored_and_extrapolation_is_sane():
    curve = SpeedCurve.from_points("X", 6, [(2, 0.2), (4, 0.3), (16, 0.5)])
    assert curve.mbs == 6
    assert curve.time(6) >= curve.time(4) and curve.time(1) <= curve.time(2)
    assert curve.time(1) >= 0.1 - 1e-12  # never faster per sample than the first point


def test_max_batch_within():
    curve = SpeedCurve("X", np.array([1.0, 2.0, 2.0, 3.0]))
    assert curve.max_batch_within(0.5) == 0
    assert curve.max_batch_within(2.0) == 3
    assert curve.max_batch_within(10) == 4
    assert list(curve.max_batch_within(np.array([1.0, 2.5]))) == [1, 3]


@pytest.mark.parametrize("pts", [[], [(0, 1.0)], [(2, -1.0)], [(2, math.nan)], [(2, math.inf)], [(1.5, 1.0)],
                                 [(9, 1.0)], [("a", 1.0)]])
def test_bad_points(pts):
    with pytest.raises(ProfileError):
        SpeedCurve.from_points("X", 8, pts)


def test_comm_model_formulas():
    c = CommModel(world_size=4, param_bytes=1e9, bandwidth_bytes_per_s=1e9, latency_s=0.001)
    coll = 0.75 + 0.001
    assert c.collective_s() == pytest.approx(coll)
    assert c.all_reduce_s() == pytest.approx(1.5 + 0.001)
    assert [c.per_micro_step_s(s) for s in range(4)] == pytest.approx([0, 0, coll, 3 * coll])
    # plus the status all-reduce's latency (and at stage 3 the late-gradient flags')
    assert [c.per_iteration_s(s) for s in range(4)] == pytest.approx([1.502, 2 * coll + 0.001, coll + 0.001, 0.002])
    single = CommModel(1, 1e9, 1e9, 0.001)
    assert single.per_iteration_s(0) == 0 and single.per_micro_step_s(3) == 0


def test_comm_model_prices_the_measured_collectives_at_their_stage():
    measured = CommModel(4, 1e9, 1e9, 0.001, measured_stage=3,
                         micro_step_ops=(("all_gather", 4e8), ("all_gather", 4e8), ("reduce_scatter", 4e8)),
                         iteration_ops=(("all_reduce", 24.0), ("all_reduce", 8.0)))
    assert measured.per_micro_step_s(3) == pytest.approx(3 * (0.75 * 0.4 + 0.001))
    assert measured.per_iteration_s(3) == pytest.approx(2 * 0.001 + 1.5 * 32 / 1e9)
    formula = CommModel(4, 1e9, 1e9, 0.001)
    assert measured.per_micro_step_s(2) == formula.per_micro_step_s(2)  # another stage: the table
    assert measured.per_iteration_s(0) == formula.per_iteration_s(0)


def test_ranks_of_a_type_share_one_curve_with_the_smallest_mbs():
    from poplar.planner import group_profile, plan
    from poplar.types.profiles import CommProfile, Links, Profile, ProfilePoint, RankProfile

    def rank(i, dtype, mbs, scale):
        return RankProfile(i, dtype, mbs, [ProfilePoint(b, scale * (0.01 + 0.01 * b)) for b in (1, 2, 4, mbs)])

    prof = Profile(0, 3, 10, 40, [rank(0, "X", 8, 1.0), rank(1, "Y", 5, 2.0), rank(2, "X", 6, 1.2)],
                   CommProfile(Links(1e9)))
    groups = group_profile(prof)
    assert [(g.device_type, g.ranks, g.mbs) for g in groups] == [("X", [0, 2], 6), ("Y", [1], 5)]
    assert groups[0].curve.time(1) == pytest.approx(0.5 * (0.02 + 0.024))  # median of two ranks
    p = plan(prof, 100, 0)
    assert all(r.micro_batch_size <= 6 and r.last_batch_size <= 6 for r in p.ranks)


def test_splits_that_tie_within_a_tenth_of_a_percent_go_to_the_plainer_one():
    from poplar.planner.zero01 import best_split
    times = 0.1 + 0.01 * np.arange(1, 9)  # t(b) = 0.1 + 0.01 b, mbs 8: every 2-step split of 9 costs 0.29
    times[6] -= 1e-5  # 2 + 7 faster by 0.003 %: a tie
    # 2 steps, the longest last micro-step (the closing collectives overlap its backward)
    assert best_split(SpeedCurve("V", times), 9)[:3] == (1, 1, 8)
    times[6] -= 3e-3  # 1 % faster: a real difference
    assert best_split(SpeedCurve("V", times), 9)[:3] == (2, 1, 7)  # 7 + 2 as fast, but ends short
