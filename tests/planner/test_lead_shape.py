"""The lead's shape: how much of a type's led exposure change a step pays at a lead g, piecewise
linear through the profiler's small led rounds (measured at their lead) and its led rounds (from
``LED_ROUNDS_LEAD`` on), and a straight line where a profile has no small led rounds."""

from dataclasses import replace

import numpy as np
import pytest

from poplar.planner.cost_model import CommModel, evaluate_rows
from poplar.planner.curves import SpeedCurve
from poplar.types.profiles import CommProfile, Exposure, LedExposure, Links, Profile, ProfileError, ProfilePoint, RankProfile
from poplar.planner.lead import LED_ROUNDS_LEAD, lead_change


def test_the_change_is_a_straight_line_without_a_small_lead():
    assert lead_change(0.0, -0.01) == pytest.approx(0.0)
    assert lead_change(0.25, -0.01) == pytest.approx(-0.005)
    assert lead_change(0.8, -0.01) == pytest.approx(-0.01)  # in full from LED_ROUNDS_LEAD on


def test_the_change_goes_through_the_small_lead_rounds():
    # a lone leader: most of the change by a lead of 0.15
    assert lead_change(0.15, -0.01, 0.15, -0.008) == pytest.approx(-0.008)
    assert lead_change(0.075, -0.01, 0.15, -0.008) == pytest.approx(-0.004)
    assert lead_change(0.325, -0.01, 0.15, -0.008) == pytest.approx(-0.009)
    assert lead_change(0.9, -0.01, 0.15, -0.008) == pytest.approx(-0.01)
    # a lead outside (0, LED_ROUNDS_LEAD), or none measured for this leader: the straight line
    for at in (np.nan, 0.0, LED_ROUNDS_LEAD, 0.7):
        assert lead_change(0.2, -0.01, at, -0.008) == pytest.approx(-0.004)
    # per step, arrays: each step its own leader's point
    got = lead_change(np.array([0.1, 0.1, 0.4]), np.array([-0.01, -0.02, -0.01]),
                      np.array([0.2, np.nan, 0.2]), np.array([-0.002, np.nan, -0.002]))
    assert got == pytest.approx([-0.001, -0.004, -0.002 - 0.008 * 2 / 3])


def profile(small: bool) -> Profile:
    """A at 1 ms a sample, B at 2 ms, measured at ZeRO-2: 0.05 s exposed balanced, 0.04 s led by A;
    A's small led rounds led by 0.15 and exposed 0.042 s (ends 0.02, 0.01, 0.012)."""
    def rank(i: int, dtype: str, per_sample: float) -> RankProfile:
        return RankProfile(i, dtype, 100, [ProfilePoint(b, per_sample * b) for b in (1, 25, 50, 100)])
    led = LedExposure("A", micro_step_s=0.04, iteration_s=0.01)
    if small:
        led = replace(led, small_lead=0.15, micro_step_small_lead_s=0.042, iteration_small_lead_s=0.012)
    comm = CommProfile(Links(1e9), collectives_stage=2, micro_step=[["reduce_scatter", 1000]],
                       exposure=Exposure(micro_step_s=0.05, iteration_s=0.02, leaders=(led,), overhead_s=0.003))
    return Profile(2, 2, 1000, 4000, [rank(0, "A", 0.001), rank(1, "B", 0.002)], comm)


def test_the_cost_model_prices_a_step_and_an_end_by_the_leaders_measured_shape():
    shaped, straight = CommModel.from_profile(profile(True)), CommModel.from_profile(profile(False))
    assert shaped.led_micro_step_s(2, 0.0, None, "A") == pytest.approx(0.05)
    assert shaped.led_micro_step_s(2, 0.15, None, "A") == pytest.approx(0.042)
    assert straight.led_micro_step_s(2, 0.15, None, "A") == pytest.approx(0.047)
    assert shaped.led_micro_step_s(2, 0.6, None, "A") == pytest.approx(0.04)
    assert shaped.led_micro_step_s(2, 0.15, None, "B") == pytest.approx(0.05)  # B never led: no change
    assert shaped.led_iteration_s(2, 0.15, "A") == pytest.approx(0.015)  # 0.012 + the overhead
    assert straight.led_iteration_s(2, 0.15, "A") == pytest.approx(0.023 - 0.01 * 0.3)
    # a step of A at 60 samples (0.06 s) and B at 26 (0.052 s): A leads by 0.133
    rows = [("A", 60, 1, 0), ("B", 26, 1, 0)]
    curves = {"A": SpeedCurve("A", 0.001 * np.arange(1, 101)), "B": SpeedCurve("B", 0.002 * np.arange(1, 101))}
    lead = 1 - 0.052 / 0.06
    got = evaluate_rows(rows, curves, 2, shaped)
    assert got.comm_s == pytest.approx(0.05 - 0.008 * lead / 0.15 + 0.023 - 0.008 * lead / 0.15)
    assert evaluate_rows(rows, curves, 2, straight).comm_s == pytest.approx(
        0.05 - 0.01 * lead / 0.5 + 0.023 - 0.01 * lead / 0.5)


def test_the_search_bound_is_the_full_lead_where_the_small_one_measured_past_it():
    p = profile(True)
    led = replace(p.comm.exposure.leaders[0], micro_step_small_lead_s=0.035)  # a change of -0.015 at 0.15, past -0.01
    p.comm = replace(p.comm, exposure=replace(p.comm.exposure, leaders=(led,)))
    comm = CommModel.from_profile(p)
    assert comm.led_micro_step_s(2, 0.15, None, "A") == pytest.approx(0.04)
    assert comm.cheapest_micro_step_s(2) == pytest.approx(0.04)


@pytest.mark.parametrize("field, value, message", [
    ("small_lead", 1.5, r"small_lead of 'A' must be a fraction in \[0, 1\)"),
    ("small_lead", [0.15], r"comm.exposure.leaders\[0\].small_lead must be a number or null"),
    ("micro_step_small_lead_s", "fast", r"comm.exposure.leaders\[0\].micro_step_small_lead_s must be a number"),
])
def test_a_bad_small_lead_field_is_refused_by_name(field, value, message):
    d = profile(True).to_dict()
    d["comm"]["exposure"]["leaders"][0][field] = value
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(d)


def test_a_small_change_past_the_full_one_is_held_to_it():
    # the change grows with the lead and saturates: -0.012 measured at 0.16 where 0.5 gave -0.009
    # is noise (4 + 4 ranks at ZeRO-2: a plan predicted 3.8 % faster than flops from it ran 1.5 % slower)
    assert lead_change(0.16, -0.009, 0.16, -0.012) == pytest.approx(-0.009)
    assert lead_change(0.08, -0.009, 0.16, -0.012) == pytest.approx(-0.0045)
    assert lead_change(0.16, -0.009, 0.16, 0.002) == pytest.approx(0.0)  # the other sign: none
    assert lead_change(0.16, 0.004, 0.16, 0.006) == pytest.approx(0.004)  # a growing exposure likewise
    assert lead_change(np.array([0.16, 0.16]), np.array([-0.009, -0.02]), 0.16, -0.012) == pytest.approx(
        [-0.009, -0.012])
