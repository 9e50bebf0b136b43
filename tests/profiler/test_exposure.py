"""The exposed-communication model from timing-round facts: the first pass left out, rounds whose
slowest rank led apart from the others, the balanced rounds' median, balanced batch choices, and
how the cost model prices a step by its slowest rank's lead."""

import pytest

from poplar.planner.cost_model import CommModel, evaluate_rows
from poplar.planner.curves import SpeedCurve
from poplar.profiler.exposure import (MAX_STEADY_ROUNDS, STEADY_CHUNK, STEADY_ROUNDS, SteadyConfig, SteadyRounds,
                                     continued, exposed_costs, exposure_batches, exposure_error,
                                     more_steady_rounds)
from poplar.profiler.timing import RoundFacts

BALANCED, SHORT, SHORTEST = (SteadyConfig(k) for k in (SteadyRounds.BALANCED, SteadyRounds.SHORT, SteadyRounds.SHORTEST))
LED_S, LED_F = SteadyConfig(SteadyRounds.LED, "S"), SteadyConfig(SteadyRounds.LED, "F")
LONG_S = SteadyConfig(SteadyRounds.LONG, "S")
SMALL_S, SMALL_F = SteadyConfig(SteadyRounds.LED_SMALL, "S"), SteadyConfig(SteadyRounds.LED_SMALL, "F")

import numpy as np


def facts(rounds, end=0.01, overhead=0.002):
    """Three ranks' facts from (slowest's compute, the next rank's compute, micro comm, pass) per
    round; the second rank ties with the slowest (same type), the third is ``other``."""
    slow = [RoundFacts(c, m, end, overhead, p) for c, _, m, p in rounds]
    twin = [RoundFacts(c * 0.999, 0.0, end, overhead, p) for c, _, m, p in rounds]
    other = [RoundFacts(o, 0.05, end, overhead, p) for _, o, _, p in rounds]
    return [slow, twin, other]


def test_grid_rounds_that_did_not_lead_give_the_exposure_without_the_first_pass():
    led = [(0.2, 0.1, 0.02, p) for p in (1, 1, 2, 2)]  # leads by 50 %
    tied = [(0.2, 0.199, 0.04, p) for p in (1, 1, 2, 2)]  # the other type finishes together
    first = [(0.2, 0.1, 0.09, 0)] * 4
    costs = exposed_costs(facts(first + led + tied))
    assert costs.per_leader("micro_step_s") is None  # which type led, the grid does not say
    assert costs.micro_step_s == pytest.approx(0.04)  # the rounds that did not lead
    assert costs.iteration_s == pytest.approx(0.01)
    assert costs.overhead_s == pytest.approx(0.002)


def test_steady_rounds_go_on_until_the_median_exposure_is_known_to_a_percent_of_a_round():
    # a round of 0.2 s compute + about 0.05 s exposed: 1 % of it is about 2.5 ms of standard error

    def rounds(n, spread):  # micro-step exposures spread evenly over 0.04 +- spread
        return facts([(0.2, 0.199, 0.04 + spread * ((7 * p) % 11 - 5) / 5, p) for p in range(n)])

    assert more_steady_rounds(rounds(STEADY_ROUNDS, 0.0)) == 0  # the same every round: known at once
    noisy = rounds(STEADY_ROUNDS, 0.02)
    assert more_steady_rounds(noisy) == STEADY_CHUNK  # MAD about 0.01: 1.86 x 0.01 / sqrt(8) = 6.6 ms
    assert more_steady_rounds(noisy, precision=0.06) == 0 and more_steady_rounds(noisy, precision=0) == 0
    still = [continued(a, b) for a, b in zip(noisy, rounds(STEADY_CHUNK, 0.02))]
    assert [f[4] for f in still[0]] == list(range(STEADY_ROUNDS + STEADY_CHUNK))  # the passes go on
    assert more_steady_rounds(still) == STEADY_CHUNK  # 16 settled: 5.6 ms
    calmer = [continued(a, b) for a, b in zip(noisy, rounds(STEADY_CHUNK, 0.0))]
    assert more_steady_rounds(calmer) == 0  # half of the 16 the same: the median is known
    assert more_steady_rounds(rounds(MAX_STEADY_ROUNDS - 3, 0.02)) == 3  # up to the cap, never past it
    assert more_steady_rounds(rounds(MAX_STEADY_ROUNDS, 0.02)) == 0


def test_the_profile_keeps_the_least_well_known_configurations_standard_error():
    def rounds(n, spread):
        return facts([(0.2, 0.199, 0.04 + spread * ((7 * p) % 11 - 5) / 5, p) for p in range(n)])

    assert exposure_error(rounds(STEADY_ROUNDS, 0.0)) == 0.0
    assert exposure_error(rounds(2, 0.02)) == 0.0  # nothing settled yet
    noisy = exposure_error(rounds(STEADY_ROUNDS, 0.02))
    assert noisy == pytest.approx(0.0078 / 0.25, rel=0.02)  # 7.8 ms of a 0.25 s round
    assert exposure_error(rounds(STEADY_ROUNDS, 0.01)) == pytest.approx(noisy / 2, rel=0.05)
    grid = facts([(0.2, 0.1, 0.02, 1)] * 6)
    costs = exposed_costs(grid, {BALANCED: rounds(STEADY_ROUNDS, 0.01), LED_S: rounds(STEADY_ROUNDS, 0.02)})
    assert costs.error == pytest.approx(noisy)
    assert exposed_costs(grid).error is None  # a probe has no steady rounds


def test_steady_rounds_give_both_exposures_after_settling():
    grid = facts([(0.2, 0.1, 0.02, 1)] * 6)
    balanced = facts([(0.15, 0.149, 0.06, p) for p in (0, 1)] + [(0.15, 0.149, 0.035, p) for p in (2, 3, 4)]
                     + [(0.15, 0.149, 0.5, 5)], end=0.03)
    led = facts([(0.15, 0.07, 0.09, p) for p in (0, 1)] + [(0.15, 0.07, 0.025, p) for p in (2, 3, 4, 5)], end=0.015)
    other = facts([(0.15, 0.07, 0.012, p) for p in range(6)], end=0.005)
    costs = exposed_costs(grid, {BALANCED: balanced, LED_S: led, LED_F: other})
    assert costs.micro_step_s == pytest.approx(0.035)  # median of the settled rounds
    assert costs.per_leader("micro_step_s") == pytest.approx({"S": 0.025, "F": 0.012})
    assert costs.iteration_s == pytest.approx(0.03)  # the balanced rounds' end
    assert costs.per_leader("iteration_s") == pytest.approx({"S": 0.015, "F": 0.005})
    # the grid's led rounds (0.02) less the steady led ones pooled (median 0.0185)
    assert costs.switch_s == pytest.approx(0.0015)
    switching = facts([(0.2, 0.1, 0.04, 1)] * 6)
    assert exposed_costs(switching, {BALANCED: balanced, LED_S: led}).switch_s == pytest.approx(0.015)
    one_type = exposed_costs(grid, {BALANCED: balanced})
    assert one_type.per_leader("micro_step_s") is None and one_type.step_s is None
    short = facts([(0.05, 0.049, 0.06, p) for p in range(6)])
    shortest = facts([(0.02, 0.0199, 0.09, p) for p in range(6)])
    costs = exposed_costs(grid, {BALANCED: balanced, SHORT: short, SHORTEST: shortest})
    assert costs.step_compute_s == pytest.approx([0.02, 0.05, 0.15])
    assert costs.step_s == pytest.approx([0.09, 0.06, 0.035])


def test_without_lead_rounds_there_is_no_lead_exposure():
    costs = exposed_costs(facts([(0.2, 0.199, 0.04, 1)] * 5))
    assert costs.per_leader("micro_step_s") is None
    assert costs.micro_step_s == pytest.approx(0.04)


def test_exposure_batches_balance_the_ranks_or_let_each_type_lead():
    fast = {b: 0.01 + 0.002 * b for b in (1, 2, 4, 8, 16, 20)}
    slow = {b: 0.02 + 0.006 * b for b in (1, 2, 4, 8)}
    chosen = exposure_batches([fast, fast, slow], [20, 20, 8], ["F", "F", "S"])
    # balanced: the largest compute every rank reaches (the fast ranks' at their mbs, 0.05 s)
    assert chosen[BALANCED] == [20, 20, 5]
    # a third of it is below the slow type's least (0.026 s): one shorter level only, at that least
    assert SHORT not in chosen and chosen[SHORTEST] == [8, 8, 1]
    # led by the slow type: it there, the fast ones at half of it; led by the fast type likewise
    led = chosen[LED_S]
    assert led[2] == 5 and led[0] == led[1] and abs(fast[4] + 0.002 * (led[0] - 4) - 0.025) <= 0.0011
    assert chosen[LED_F][:2] == [20, 20] and chosen[LED_F][2] == 1  # 0.025 s: the slow type's least is closest
    assert LED_F not in exposure_batches([fast, fast], [20, 20], ["F", "F"])


def test_a_step_is_priced_by_its_slowest_rows_lead():
    curves = {"X": SpeedCurve("X", np.array([1.0, 2.0, 3.0, 4.0])),
              "Y": SpeedCurve("Y", np.array([1.9, 3.8]))}
    comm = CommModel(2, 0.0, 1e9, measured_stage=2, exposed_micro_step_s=0.4, exposed_iteration_s=0.1,
                     exposed_lead_s=(("X", 0.2), ("Y", 0.2)))

    def comm_s(rows):
        return evaluate_rows(rows, curves, 2, comm).comm_s

    # the lead's gain (0.2 of 0.4) in proportion to the lead, in full from the led rounds' 50 %
    assert comm_s([("X", 4, 1, 0), ("Y", 2, 1, 0)]) == pytest.approx(0.1 + 0.4 - 0.2 * 0.1)  # 5 % lead
    assert comm_s([("X", 3, 1, 0), ("Y", 2, 1, 0)]) == pytest.approx(0.1 + 0.4 - 0.2 * (0.8 / 3.8) / 0.5)  # 21 %
    assert comm_s([("X", 2, 1, 0), ("Y", 1, 1, 0)]) == pytest.approx(0.1 + 0.4 - 0.2 * 0.1)
    # two steps: together (lead 0 within a row), then X alone while Y waits
    assert comm_s([("X", 2, 2, 0), ("Y", 1, 1, 0)]) == pytest.approx(0.1 + 0.38 + 0.2)
    short = CommModel(2, 0.0, 1e9, measured_stage=2, exposed_micro_step_s=0.4, exposed_iteration_s=0.1,
                      exposed_lead_s=(("X", 0.2), ("Y", 0.2)), exposed_steps=((1.0, 3.0), (0.6, 0.4)))
    # Y at 1.9 s leads X's 1.0 s by 47 %: the level interpolated at 1.9 s, then that much of the lead's -0.2
    assert evaluate_rows([("X", 1, 1, 0), ("Y", 1, 1, 0)], curves, 2, short).comm_s == pytest.approx(
        0.1 + 0.6 + (0.4 - 0.6) * (1.9 - 1.0) / 2.0 - 0.2 * (0.9 / 1.9) / 0.5)
    ends = CommModel(2, 0.0, 1e9, measured_stage=0, exposed_iteration_s=0.1, exposed_end_lead_s=(("X", 0.04), ("Y", 0.04)))
    assert evaluate_rows([("X", 4, 1, 0), ("Y", 2, 1, 0)], curves, 0, ends).comm_s == pytest.approx(0.094)  # 5 %
    assert evaluate_rows([("X", 2, 1, 0), ("Y", 2, 1, 0)], curves, 0, ends).comm_s == pytest.approx(
        0.1 - 0.06 * (1.8 / 3.8) / 0.5)  # Y leads by 47 %
    switch = CommModel(2, 0.0, 1e9, measured_stage=2, exposed_micro_step_s=0.4, exposed_iteration_s=0.1,
                       exposed_switch_s=0.05)
    assert evaluate_rows([("X", 2, 2, 0), ("Y", 1, 2, 0)], curves, 2, switch).switch_s == 0.0  # one shape
    assert evaluate_rows([("X", 2, 1, 1), ("Y", 1, 1, 1)], curves, 2, switch).switch_s == pytest.approx(0.1)
    assert evaluate_rows([("X", 2, 2, 1), ("Y", 1, 2, 0)], curves, 2, switch).switch_s == pytest.approx(0.1)
    no_lead = CommModel(2, 0.0, 1e9, measured_stage=2, exposed_micro_step_s=0.4, exposed_iteration_s=0.1)
    assert evaluate_rows([("X", 3, 1, 0), ("Y", 2, 1, 0)], curves, 2, no_lead).comm_s == pytest.approx(0.5)


def test_the_switch_compares_grid_and_steady_rounds_at_the_same_compute():
    """Where shorter steps expose more (the levels' slope), a grid round that computed less is
    not a switch: only what it exposes beyond the slope counts."""
    balanced = facts([(0.15, 0.149, 0.10, p) for p in range(6)])
    short = facts([(0.05, 0.049, 0.14, p) for p in range(6)])  # slope: -0.04 s of exposure per 0.1 s
    led = facts([(0.15, 0.07, 0.09, p) for p in range(6)])
    on_slope = facts([(0.05, 0.02, 0.13, 1)] * 6)  # 0.09 + 0.04: what its compute predicts
    costs = exposed_costs(on_slope, {BALANCED: balanced, SHORT: short, LED_S: led})
    assert costs.switch_s == pytest.approx(0.0)
    above = facts([(0.05, 0.02, 0.15, 1)] * 6)  # 0.02 more than the slope predicts
    assert exposed_costs(above, {BALANCED: balanced, SHORT: short, LED_S: led}).switch_s == \
        pytest.approx(0.02)


def test_a_long_level_where_a_rank_computes_far_past_the_balanced_one():
    """Same mbs, one type 3x slower (2 V100 + 2 T4): its largest batch computes 3x the balanced
    level, and the long rounds (every rank at its mbs) measure how much such a step exposes."""
    fast = {b: 0.01 * b for b in (1, 2, 4, 8, 11)}
    slow = {b: 0.03 * b for b in (1, 2, 4, 8, 11)}
    chosen = exposure_batches([fast, fast, slow], [11, 11, 11], ["F", "F", "S"])
    assert chosen[BALANCED] == [11, 11, 4] and chosen[LONG_S] == [11, 11, 11]
    assert not any(k.kind is SteadyRounds.LONG for k in exposure_batches([fast] * 3, [11] * 3, ["F"] * 3))

    grid = facts([(0.2, 0.1, 0.02, 1)] * 6)
    balanced = facts([(0.15, 0.149, 0.035, p) for p in range(6)])
    led = facts([(0.15, 0.07, 0.025, p) for p in range(6)])  # S leading by half exposes 0.01 less
    long = facts([(0.45, 0.15, 0.02, p) for p in range(6)])  # S at 0.45 s leads by 2/3
    costs = exposed_costs(grid, {BALANCED: balanced, LED_S: led, LONG_S: long})
    # as a balanced level: 0.02 less the lead's -0.01, which the cost model adds back
    assert costs.step_compute_s == pytest.approx([0.15, 0.45])
    assert costs.step_s == pytest.approx([0.035, 0.03])
    comm = CommModel(3, 0.0, 1e9, measured_stage=3, exposed_micro_step_s=costs.micro_step_s,
                     exposed_lead_s=tuple(sorted(costs.per_leader("micro_step_s").items())),
                     exposed_steps=(tuple(costs.step_compute_s), tuple(costs.step_s)))
    assert comm.led_micro_step_s(3, 2 / 3, 0.45, "S") == pytest.approx(0.02)  # what the long rounds measured
    assert comm.led_micro_step_s(3, 0.0, 0.3, "S") == pytest.approx(0.0325)  # balanced, halfway
    short = facts([(0.05, 0.049, 0.06, p) for p in range(6)])
    with_short = exposed_costs(grid, {BALANCED: balanced, SHORT: short, LED_S: led, LONG_S: long})
    assert with_short.step_compute_s == pytest.approx([0.05, 0.15, 0.45])
    assert with_short.step_s == pytest.approx([0.06, 0.035, 0.03])


def test_small_led_rounds_where_the_batches_give_a_small_lead():
    fast = {b: 0.01 + 0.002 * b for b in (1, 2, 4, 8, 16, 20)}
    slow = {b: 0.02 + 0.006 * b for b in (1, 2, 4, 8)}
    chosen = exposure_batches([fast, fast, slow], [20, 20, 8], ["F", "F", "S"])
    # S at the balanced 0.05 s, F near 85 % of it: 16 samples, 0.042 s, a lead of 0.16
    assert chosen[SMALL_S] == [16, 16, 5]
    assert chosen[SMALL_F] == [20, 20, 4]  # S at 4 samples, 0.044 s: led by 0.12
    # S's batches are 0.03 s apart: near 85 % of F's 0.05 s is one sample, led by 0.4, no small lead
    coarse = {1: 0.03, 2: 0.06}
    assert SMALL_F not in exposure_batches([fast, fast, coarse], [20, 20, 2], ["F", "F", "S"])


def test_small_led_rounds_give_the_lead_and_exposure_where_the_change_starts():
    grid = facts([(0.2, 0.1, 0.02, 1)] * 6)
    balanced = facts([(0.15, 0.149, 0.035, p) for p in range(6)], end=0.03)
    led = facts([(0.15, 0.07, 0.025, p) for p in range(6)], end=0.015)  # S leading by half: 0.01 less
    # S leading by 0.16: most of that already; the first two rounds settle
    small = facts([(0.15, 0.126, 0.05, p) for p in (0, 1)] + [(0.15, 0.126, 0.027, p) for p in range(2, 7)],
                  end=0.02)
    costs = exposed_costs(grid, {BALANCED: balanced, LED_S: led, SMALL_S: small})
    assert costs.per_leader("small_lead") == pytest.approx({"S": 0.16})
    assert costs.per_leader("micro_step_small_lead_s") == pytest.approx({"S": 0.027})
    assert costs.per_leader("iteration_small_lead_s") == pytest.approx({"S": 0.02})
    assert costs.per_leader("micro_step_s") == pytest.approx({"S": 0.025})  # the led rounds alone
    assert exposed_costs(grid, {BALANCED: balanced, LED_S: led}).per_leader("small_lead") is None
    # long rounds led by 0.16 as a balanced level: 0.02 less the small rounds' -0.008, not a third of -0.01
    long = facts([(0.45, 0.378, 0.02, p) for p in range(6)])
    costs = exposed_costs(grid, {BALANCED: balanced, LED_S: led, SMALL_S: small, LONG_S: long})
    assert costs.step_s == pytest.approx([0.035, 0.028])
    straight = exposed_costs(grid, {BALANCED: balanced, LED_S: led, LONG_S: long})
    assert straight.step_s == pytest.approx([0.035, 0.02 + 0.01 * 0.16 / 0.5])


def test_stages_0_and_1_price_the_end_by_the_slowest_ranks_last_micro_step():
    """At stages 0/1 the closing collectives overlap the last micro-step's backward: the levels'
    end exposures (``Exposure.end_s``) price an iteration by its slowest rank's last micro-step,
    so a plan ending in a short one pays more than one ending in a long one of the same compute."""
    grid = facts([(0.2, 0.1, 0.0, 1)] * 6)
    balanced = facts([(0.15, 0.149, 0.0, p) for p in range(6)], end=0.03)
    short = facts([(0.05, 0.049, 0.0, p) for p in range(6)], end=0.05)
    costs = exposed_costs(grid, {BALANCED: balanced, SHORT: short})
    assert costs.step_compute_s == pytest.approx([0.05, 0.15])
    assert costs.end_s == pytest.approx([0.05, 0.03]) and costs.iteration_s == pytest.approx(0.03)
    comm = CommModel(3, 0.0, 1e9, measured_stage=0, exposed_micro_step_s=0.0, exposed_iteration_s=0.03,
                     exposed_end_steps=(tuple(costs.step_compute_s), tuple(costs.end_s)))
    curves = {"X": SpeedCurve("X", np.array([0.05, 0.1, 0.15, 0.2, 0.25, 0.3])),
              "Y": SpeedCurve("Y", np.array([0.05, 0.1, 0.15]))}
    ending_short = evaluate_rows([("X", 5, 1, 1), ("Y", 3, 1, 0)], curves, 0, comm)  # 0.25 + 0.05
    ending_long = evaluate_rows([("X", 3, 2, 0), ("Y", 3, 1, 0)], curves, 0, comm)  # 0.15 + 0.15
    assert ending_short.iteration_s == pytest.approx(0.3 + 0.05)
    assert ending_long.iteration_s == pytest.approx(0.3 + 0.03)
    assert evaluate_rows([("X", 2, 1, 0), ("Y", 2, 1, 0)], curves, 0, comm).comm_s == pytest.approx(0.04)  # between
    # measured at stage 2/3, or without levels, the end stays the balanced one
    flat = CommModel(3, 0.0, 1e9, measured_stage=0, exposed_micro_step_s=0.0, exposed_iteration_s=0.03)
    assert evaluate_rows([("X", 5, 1, 1), ("Y", 3, 1, 0)], curves, 0, flat).comm_s == pytest.approx(0.03)
    at_two = CommModel(3, 0.0, 1e9, measured_stage=2, exposed_micro_step_s=0.0, exposed_iteration_s=0.03,
                       exposed_end_steps=comm.exposed_end_steps)
    assert at_two.led_iteration_s(2, 0.0, None, 0.05) == pytest.approx(0.03)

