"""The exposed-communication model from timing-round facts: a slope robust to a disturbed round,
the first pass left out, the level taken from balanced rounds, and balanced batch choices."""

import pytest

from poplar.profiler.exposure import balanced_batches, exposed_costs


def facts(computes, micro, pass_of, end=0.01, overhead=0.002, others=0.001):
    """Two ranks' facts: rank 0 is each round's slowest, rank 1 computes ``others`` seconds."""
    slow = [(c, micro(c, p), end, overhead, p) for c, p in zip(computes, pass_of)]
    fast = [(others, 0.2, 0.0, 0.0, p) for p in pass_of]
    return [slow, fast]


def test_slope_and_level_come_from_later_passes_and_survive_a_disturbed_round():
    computes = [0.05, 0.1, 0.15, 0.2] * 3
    passes = [0] * 4 + [1] * 4 + [2] * 4

    def micro(c, p):
        return 0.04 - 0.1 * c + (0.03 if p == 0 else 0.0)

    grid = facts(computes, micro, passes)
    grid[0][6] = (0.15, 0.2, 0.01, 0.002, 1)  # one disturbed round
    costs = exposed_costs(grid)
    assert costs["exposed_micro_step_slope"] == pytest.approx(-0.1, abs=1e-9)
    at = costs["exposed_at_compute_s"]
    assert costs["exposed_micro_step_s"] == pytest.approx(0.04 - 0.1 * at, abs=1e-9)  # the first pass's +0.03 left out
    assert costs["exposed_compute_range_s"] == [0.05, 0.2]
    assert costs["exposed_iteration_s"] == pytest.approx(0.01)
    assert costs["iteration_overhead_s"] == pytest.approx(0.002)


def test_balanced_rounds_set_the_level_along_the_grid_slope():
    computes = [0.05, 0.1, 0.15, 0.2] * 2
    grid = facts(computes, lambda c, p: 0.04 - 0.1 * c, [1] * 8)
    balanced = facts([0.1, 0.2] * 3, lambda c, p: 0.05 - 0.1 * c, [0, 0, 1, 1, 2, 2])
    costs = exposed_costs(grid, balanced)
    assert costs["exposed_micro_step_slope"] == pytest.approx(-0.1, abs=1e-9)
    assert costs["exposed_micro_step_s"] == pytest.approx(0.05 - 0.1 * costs["exposed_at_compute_s"], abs=1e-9)


def test_exposure_never_rises_with_compute():
    computes = [0.05, 0.1, 0.15, 0.2] * 2
    costs = exposed_costs(facts(computes, lambda c, p: 0.01 + 2.0 * c, [1] * 8))
    assert costs["exposed_micro_step_slope"] == 0.0


def test_balanced_batches_give_every_rank_about_the_same_compute():
    fast = {b: 0.01 + 0.002 * b for b in (1, 2, 4, 8, 16, 20)}
    slow = {b: 0.02 + 0.006 * b for b in (1, 2, 4, 8)}
    chosen = balanced_batches([fast, slow], [20, 8])
    assert [len(c) for c in chosen] == [2, 2]
    for level in range(2):
        b_fast, b_slow = chosen[0][level], chosen[1][level]
        t_fast, t_slow = 0.01 + 0.002 * b_fast, 0.02 + 0.006 * b_slow
        assert abs(t_fast / t_slow - 1) < 0.1
    # the top level is the largest compute every rank reaches: the fast rank's at its mbs
    assert [c[-1] for c in chosen] == [20, 5]
