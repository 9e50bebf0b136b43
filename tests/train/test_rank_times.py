"""The per-rank times' definitions (``poplar.train.rank_times``) on numbers worked by hand."""

from __future__ import annotations

import pytest

from poplar.train.rank_times import RankTimes, collective_waits, idle_from_compute, split


def test_the_rank_that_blocked_least_sets_each_collectives_own_time() -> None:
    # collective 1: rank 1 arrived last (blocked 0.1 s), ranks 0 and 2 waited 0.4 and 0.2 s for it;
    # collective 2: rank 0 arrived last
    assert collective_waits([(0.5, 0.1), (0.1, 0.3), (0.3, 0.2)]) == [
        pytest.approx([0.4, 0.0]), pytest.approx([0.0, 0.2]), pytest.approx([0.2, 0.1])]
    assert collective_waits([(0.5,), (0.1, 0.3)]) is None  # not matched: different counts
    times = split([1.0, 1.0, 1.0], [0.3, 0.5, 0.4], [0.6, 0.4, 0.5], [(0.5, 0.1), (0.1, 0.3), (0.3, 0.2)])
    assert times[0] == pytest.approx(RankTimes(0.3, 0.2, 0.4, 0.1))
    assert [t.comm_s for t in times] == pytest.approx([0.2] * 3)  # the collectives' own time, the same for all
    assert all(sum(t) == pytest.approx(1.0) for t in times)


def test_idle_from_compute_is_the_slowest_ranks_compute_beyond_this_ones() -> None:
    assert idle_from_compute([1.0, 0.25, 0.5]) == [0.0, 0.75, 0.5]
    assert idle_from_compute([]) == []
