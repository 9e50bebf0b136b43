"""ZeRO-0's gradient all-reduce across nodes once per iteration: priced as what
``hierarchical.all_reduce`` sends (in-node reduce-scatters, the exchange, the exchange back,
in-node all-gathers, the buffer cut about equally per rank), every other way and every other
all-reduce flat; the planner then chooses the way where the cross link binds, and flat where it
does not or on one node."""

from __future__ import annotations

import pytest

from poplar.planner import plan as plan_any
from poplar.planner.cost_model import CommModel
from poplar.planner.link_pricing import LinkPricing
from poplar.types.plans import Plan
from poplar.types.profiles import Exposure, LinkSpeed, Links
from poplar.types.route import Collectives
from tests.planner.test_link_pricing import FAST, GB, SLOW, profile, two_nodes

ONCE = Collectives.ONCE_PER_ITERATION
B = 8e9


def pricing_of(sizes: tuple[int, ...], weights: list[float] | None = None) -> LinkPricing:
    return LinkPricing.of(two_nodes(sizes, (FAST,) * len(sizes)), sum(sizes), weights)


def step(link: LinkSpeed, fraction: float) -> float:
    return fraction * B / link.bandwidth_bytes_per_s + link.latency_s


@pytest.mark.parametrize("sizes, intra, across", [((2, 2), 1 / 2, 1 / 2), ((3, 1), 2 / 3, 3 / 4)])
def test_the_gradient_all_reduce_once_per_iteration_is_two_hierarchical_collectives_on_even_parts(
        sizes: tuple[int, ...], intra: float, across: float) -> None:
    """2 + 2: each node's rings move 1/2 of the buffer, and each node sends and receives 1/2
    across, twice. 3 + 1: the 3-rank node's rings 2/3; across, the 1-rank node sends 3/4 at the
    reduce-scatter and receives 3/4 at the all-gather: the busiest node moves 3/4 twice, as much
    as a flat ring's 2 (N-1)/N over its two hops through that node, so there it is no faster."""
    even = pricing_of(sizes)
    assert even.gradient_all_reduce_s(B, ONCE) == pytest.approx(2 * (step(FAST, intra) + step(SLOW, across)))
    # the parts are even per rank whatever the shard weights (the buffer is cut per rank, not per weight)
    weighted = pricing_of(sizes, [3, 1, 1, 1])
    assert weighted.shares != even.shares
    assert weighted.gradient_all_reduce_s(B, ONCE) == even.gradient_all_reduce_s(B, ONCE)
    # each node sends every byte of the buffer across once, over the two exchanges: (1 - s_k) B at
    # the reduce-scatter, (K-1) s_k B at the all-gather (what the ledger counts, test_hierarchical_zero.py)
    sent = [out + back for out, back in even.even().exchange_bytes(B)]
    assert sent == pytest.approx([B, B])
    # a flat ring moves 2 (N-1)/N of it over every hop, the cross link's included: 1.5 B
    assert even.flat_s("all_reduce", B) == pytest.approx(step(SLOW, 1.5))
    assert (even.gradient_all_reduce_s(B, ONCE) < even.flat_s("all_reduce", B)) == (across < 3 / 4)


def test_every_other_way_and_every_other_all_reduce_stays_flat() -> None:
    even = pricing_of((2, 2))
    for way in (Collectives.FLAT, Collectives.HIERARCHICAL, Collectives.SECONDARY_SHARDS):
        assert even.gradient_all_reduce_s(B, way) == even.flat_s("all_reduce", B)
    assert even.call_s("all_reduce", B, ONCE) == even.flat_s("all_reduce", B)  # the status reduction
    one = LinkPricing.of(Links(100 * GB, 10e-6), 4)
    assert one.gradient_all_reduce_s(B, ONCE) == one.flat_s("all_reduce", B) > 0
    assert LinkPricing.of(Links(100 * GB, 10e-6), 1).gradient_all_reduce_s(B, ONCE) == 0.0


def test_the_cost_model_prices_zero0s_end_with_the_gradients_hierarchical() -> None:
    prof = profile(two_nodes(), stage=0)
    flat, once = CommModel.from_profile(prof), CommModel.from_profile(prof, ONCE)
    v, pricing = prof.param_bytes, LinkPricing.of(prof.comm.links, 8)
    status = SLOW.latency_s  # the status reduction: the flat link's latency
    assert flat.per_iteration_s(0) == pytest.approx(status + pricing.flat_s("all_reduce", v))
    assert once.per_iteration_s(0) == pytest.approx(status + pricing.gradient_all_reduce_s(v, ONCE))
    assert once.per_iteration_s(0) < flat.per_iteration_s(0)
    ratio = once.per_iteration_s(0) / flat.per_iteration_s(0)
    # recorded at ZeRO-0 (two buckets' gradients and the status): the pairs do not say which is the
    # gradients', so the way scales them by the table's end
    ops = [["all_reduce", v / 2], ["all_reduce", v / 2], ["all_reduce", 28]]
    recorded = profile(two_nodes(), stage=0, collectives_stage=0, iteration=ops)
    assert CommModel.from_profile(recorded, ONCE).per_iteration_s(0) == pytest.approx(
        CommModel.from_profile(recorded).per_iteration_s(0) * ratio)
    # a measured exposure: the fixed overhead as it is, the collectives' part carried from the
    # table's end to the way's (Note: an exposure carried): here the seconds saved bind
    measured = profile(two_nodes(), stage=0, collectives_stage=0, iteration=ops,
                       exposure=Exposure(iteration_s=0.05, overhead_s=0.01))
    saved = flat.per_iteration_s(0) - once.per_iteration_s(0)
    assert CommModel.from_profile(measured).per_iteration_s(0) == pytest.approx(0.06)
    assert 0 < 0.05 - saved < 0.05 * ratio
    assert CommModel.from_profile(measured, ONCE).per_iteration_s(0) == pytest.approx(0.01 + 0.05 - saved)


def plan(*args, **kwargs) -> Plan:
    return plan_any(*args, participation="all", **kwargs)


def test_the_planner_chooses_once_per_iteration_at_zero0_where_the_cross_link_binds() -> None:
    slow = plan(profile(two_nodes(), stage=0), 1000, 0)
    rows = {r.collectives: r.predicted_s for r in slow.choice.collective_candidates}
    assert list(rows) == ["flat", "once_per_iteration"]
    assert slow.collectives is ONCE and rows["once_per_iteration"] < rows["flat"] == \
        plan(profile(two_nodes(), stage=0), 1000, 0, collectives="flat").predicted_iteration_s
    # a cross link as fast as the nodes': the hierarchical steps add up to more than one ring
    free = plan(profile(two_nodes(cross=FAST), stage=0), 1000, 0)
    rows = {r.collectives: r.predicted_s for r in free.choice.collective_candidates}
    assert free.collectives is Collectives.FLAT and rows["flat"] < rows["once_per_iteration"]
    one = plan(profile(Links(100 * GB, 10e-6), stage=0), 1000, 0)
    assert one.collectives is Collectives.FLAT and one.choice.collective_candidates is None
