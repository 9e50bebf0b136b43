"""Links per tier, and a planner that prices each collective on the links it crosses: flat rings at
the slowest link's pace, hierarchical collectives as a step inside each node and one across
nodes that moves each element once, secondary shards' backward re-gather inside the node and
their memory; the fastest way is chosen, flat first within the tie; a job on one node is
planned as before."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from poplar.planner import plan as plan_any, simulate
from poplar.planner.collective_choice import held_shares, profile_as
from poplar.planner.cost_model import CommModel, evaluate_rows
from poplar.planner.planning import make_problem
from poplar.planner.link_pricing import LinkPricing, ring_s
from poplar.types.route import Collectives
from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import (CommProfile, Exposure, LinkSpeed, Links, Profile, ProfileError, ProfilePoint,
                                   RankProfile)
from poplar.types.topology import Topology

GB = 1e9
FAST, SLOW = LinkSpeed(100 * GB, 10e-6), LinkSpeed(1 * GB, 50e-6)


def two_nodes(sizes=(4, 4), intra=(FAST, FAST), cross=SLOW) -> Links:
    return Links.tiered(Topology.of_sizes(sizes), intra, cross, "nccl")


def test_tiered_links_take_the_slowest_tier_as_the_flat_link_and_one_node_is_its_link() -> None:
    links = two_nodes(intra=(FAST, LinkSpeed(20 * GB, 20e-6)))
    assert links.spans_nodes and links.flat == LinkSpeed(1 * GB, 50e-6)
    one = Links.tiered(Topology.single(4), (FAST,), None, "nccl")
    assert one == Links(100 * GB, 10e-6, "nccl") and not one.spans_nodes
    with pytest.raises(ProfileError, match="one per node"):
        Links.tiered(Topology.of_sizes([2, 2]), (FAST,), SLOW)
    with pytest.raises(ProfileError, match="cross-node link"):
        Links.tiered(Topology.of_sizes([2, 2]), (FAST, FAST), None)


def profile(links: Links, stage: int = 3, param_count: int = 10_000_000, ranks: int = 8,
            bytes_per_sample: float | None = 40e6, exposure: Exposure | None = None, **comm) -> Profile:
    """Two device types (fast ranks first), 10 M parameters, 40 MB of activations a sample."""
    def rank(i: int) -> RankProfile:
        per_sample = 0.001 if i < ranks // 2 else 0.002
        return RankProfile(i, "fast" if i < ranks // 2 else "slow", 32,
                           [ProfilePoint(b, 0.002 + per_sample * b) for b in (1, 2, 4, 8, 16, 32)],
                           bytes_per_sample=bytes_per_sample, capacity_bytes=4 * 10**9)
    return Profile(stage, ranks, param_count, 4 * param_count, [rank(i) for i in range(ranks)],
                   CommProfile(links, exposure=exposure or Exposure(), **comm))


def test_a_tiered_profile_reads_back_and_a_flat_one_of_schema_2_is_one_node(tmp_path) -> None:
    prof = profile(two_nodes((4, 4), (FAST, LinkSpeed(20 * GB, 20e-6))))
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof
    d = json.loads(path.read_text())
    d["schema_version"] = 2
    d["comm"]["links"] = {"bandwidth_bytes_per_s": 5e9, "latency_s": 1e-5, "backend": "gloo"}
    old = Profile.from_dict(d)
    assert old.comm.links == Links(5e9, 1e-5, "gloo") and not old.comm.links.spans_nodes
    d["comm"]["links"] = {**prof.to_dict()["comm"]["links"], "intra": [{"bandwidth_bytes_per_s": 1e9}]}
    with pytest.raises(ProfileError, match="one intra-node link per node"):
        Profile.from_dict(d)


def test_the_cross_step_moves_each_element_once_and_a_flat_ring_crosses_at_the_slowest_pace() -> None:
    nbytes = 8e9
    even = LinkPricing.of(two_nodes(), 8)
    # flat ring: 7/8 of the buffer on the slowest link (the cross one)
    assert even.flat_s("reduce_scatter", nbytes) == pytest.approx(0.875 * nbytes / SLOW.bandwidth_bytes_per_s
                                                                  + SLOW.latency_s)
    # hierarchical: 3/4 inside each node at once, then half of the buffer across
    assert even.call_s("reduce_scatter", nbytes, Collectives.HIERARCHICAL) == pytest.approx(
        0.75 * nbytes / FAST.bandwidth_bytes_per_s + FAST.latency_s + 0.5 * nbytes / SLOW.bandwidth_bytes_per_s
        + SLOW.latency_s)
    # secondary shards: the backward re-gather stays inside the node; forward's crosses
    assert even.call_s("all_gather", nbytes, Collectives.SECONDARY_SHARDS, backward_gather=True) == pytest.approx(
        0.75 * nbytes / FAST.bandwidth_bytes_per_s + FAST.latency_s)
    assert even.call_s("all_gather", nbytes, Collectives.SECONDARY_SHARDS) == \
        even.call_s("all_gather", nbytes, Collectives.HIERARCHICAL)
    assert even.call_s("all_reduce", nbytes, Collectives.HIERARCHICAL) == even.flat_s("all_reduce", nbytes)
    # uneven: node 0 holds 0.6 (weights 2:1:1:2 | 1:1:1:1 give 6/10), so it receives 0.6 and sends 0.4
    uneven = LinkPricing.of(two_nodes(), 8, [2, 1, 1, 2, 1, 1, 1, 1])
    assert uneven.shares == pytest.approx((0.6, 0.4))
    assert uneven.cross_s(nbytes) == pytest.approx(0.6 * nbytes / SLOW.bandwidth_bytes_per_s + SLOW.latency_s)
    # three nodes of 3 + 2 + 1: the busiest node receives 2/3 of the buffer... or sends the most
    three = LinkPricing.of(Links.tiered(Topology.of_sizes([3, 2, 1]), (FAST, FAST, FAST), SLOW), 6)
    assert three.shares == pytest.approx((0.5, 1 / 3, 1 / 6))
    assert three.cross_s(nbytes) == pytest.approx(1.0 * nbytes / SLOW.bandwidth_bytes_per_s + SLOW.latency_s)
    assert three.intra_s("all_gather", nbytes) == pytest.approx(ring_s(FAST, "all_gather", nbytes, 3))


def test_a_subset_of_nodes_is_priced_on_its_own_links() -> None:
    pricing = LinkPricing.of(Links.tiered(Topology.of_sizes([4, 4, 2]), (FAST, LinkSpeed(20 * GB, 0.0), FAST), SLOW),
                             10)
    two = pricing.with_nodes([0, 2])
    assert two.sizes == (4, 2) and two.shares == pytest.approx((4 / 6, 2 / 6)) and two.flat == LinkSpeed(1 * GB, 50e-6)
    alone = pricing.with_nodes([1])
    assert alone.flat == LinkSpeed(20 * GB, 0.0) and not alone.spans_nodes
    assert alone.call_s("reduce_scatter", 1e9, Collectives.HIERARCHICAL) == pytest.approx(0.75 * 1e9 / (20 * GB))


def test_the_cost_model_prices_each_stage_on_its_links() -> None:
    prof = profile(two_nodes())
    v = 4 * 10_000_000
    pricing = LinkPricing.of(prof.comm.links, 8)
    flat, hier = CommModel.from_profile(prof), CommModel.from_profile(prof, Collectives.HIERARCHICAL)
    sec = CommModel.from_profile(prof, Collectives.SECONDARY_SHARDS)
    assert flat.per_micro_step_s(3) == pytest.approx(3 * pricing.flat_s("all_gather", v))
    both = pricing.intra_s("all_gather", v) + pricing.cross_s(v)
    assert hier.per_micro_step_s(3) == pytest.approx(3 * both)
    assert sec.per_micro_step_s(3) == pytest.approx(2 * both + pricing.intra_s("all_gather", v))
    assert hier.per_micro_step_s(2) == pytest.approx(both) and hier.per_iteration_s(2) == pytest.approx(both + 50e-6)
    assert hier.per_iteration_s(1) == pytest.approx(2 * both + 50e-6)
    assert hier.per_iteration_s(0) == flat.per_iteration_s(0)  # ZeRO-0's all-reduce: flat but once per iteration


def test_a_measured_exposure_is_carried_to_the_serial_seconds_of_the_way_priced() -> None:
    x = Exposure(micro_step_s=0.2, iteration_s=0.05, overhead_s=0.01)
    prof = profile(two_nodes(), stage=2, exposure=x, collectives_stage=2,
                   micro_step=[["reduce_scatter", 4e7]], iteration=[["all_gather", 4e7]])
    flat, hier = CommModel.from_profile(prof), CommModel.from_profile(prof, Collectives.HIERARCHICAL)
    pricing = LinkPricing.of(prof.comm.links, 8)
    flat_s, hier_s = pricing.flat_s("all_gather", 4e7), pricing.intra_s("all_gather", 4e7) + pricing.cross_s(4e7)

    def carried(v: float, new: float, old: float) -> float:  # the smaller of scaled and moved, none below zero
        return max(0.0, min(v * new / old, v - (old - new)))
    assert flat.per_micro_step_s(2) == 0.2 and flat.per_iteration_s(2) == pytest.approx(0.06)
    assert hier.per_micro_step_s(2) == pytest.approx(carried(0.2, hier_s, flat_s))
    assert hier.led_micro_step_s(2, 0.3, 0.1, "fast") == pytest.approx(carried(0.2, hier_s, flat_s))
    # the overhead is no collective
    assert hier.per_iteration_s(2) == pytest.approx(0.01 + carried(0.05, hier_s, flat_s))
    # measured hierarchical: priced flat, carried the other way
    measured_hier = profile(two_nodes(), stage=2, exposure=x, collectives_stage=2,
                            collectives=Collectives.HIERARCHICAL,
                            micro_step=[["reduce_scatter", 4e7]], iteration=[["all_gather", 4e7]])
    assert CommModel.from_profile(measured_hier, Collectives.HIERARCHICAL).per_micro_step_s(2) == 0.2
    assert CommModel.from_profile(measured_hier).per_micro_step_s(2) == pytest.approx(carried(0.2, flat_s, hier_s))


def test_secondary_shards_take_their_memory_from_the_micro_batch() -> None:
    # 10 M parameters x 4 B / 4 ranks a node = 10 MB a rank: one sample of 40 MB... of 8 MB: two
    secondary = Collectives.SECONDARY_SHARDS
    prof = profile(two_nodes(), bytes_per_sample=8e6)
    assert [r.mbs for r in profile_as(prof, secondary, 3).ranks] == [30] * 8
    bf16 = replace(profile(two_nodes((6, 2)), bytes_per_sample=8e6), precision="bf16")  # 2 B: 20 MB / 6, 20 MB / 2
    assert [r.mbs for r in profile_as(bf16, secondary, 3).ranks] == [31] * 6 + [30] * 2
    with pytest.raises(PlanError, match="bytes_per_sample"):
        profile_as(profile(two_nodes(), bytes_per_sample=None), secondary, 3)
    with pytest.raises(PlanError, match="no room for a sample"):
        profile_as(profile(two_nodes(), bytes_per_sample=1e5), secondary, 3)  # 100 samples' worth
    assert profile_as(prof, Collectives.HIERARCHICAL, 3) is prof


def test_once_per_iteration_takes_its_secondary_shards_and_node_accumulator_from_the_micro_batch() -> None:
    # 10 M parameters, 4 ranks a node, samples of 8 MB: the secondary shard is 10 MB a rank at
    # ZeRO-3, the node accumulator 10 M x 4 B / 4 = 10 MB a rank at ZeRO-2/3 (fp32 whatever the precision)
    once = Collectives.ONCE_PER_ITERATION
    prof = profile(two_nodes(), bytes_per_sample=8e6)
    assert [r.mbs for r in profile_as(prof, once, 3).ranks] == [29] * 8  # 20 MB: 3 samples
    assert [r.mbs for r in profile_as(prof, once, 2).ranks] == [30] * 8  # 10 MB: 2 samples
    assert profile_as(prof, once, 1) is prof and profile_as(prof, once, 0) is prof
    bf16 = replace(profile(two_nodes((6, 2)), bytes_per_sample=8e6), precision="bf16")
    # 6-rank node: 20/6 + 40/6 = 10 MB, 2 samples; 2-rank node: 10 + 20 = 30 MB, 4 samples
    assert [r.mbs for r in profile_as(bf16, once, 3).ranks] == [30] * 6 + [28] * 2


def plan(*args, participation: str = "all", **kwargs) -> Plan:
    """The planner's choice of collectives on every GPU (which GPUs take part: test_participation.py)."""
    return plan_any(*args, participation=participation, **kwargs)


def test_the_planner_chooses_by_predicted_time_and_keeps_flat_where_the_link_does_not_bind() -> None:
    once = Collectives.ONCE_PER_ITERATION
    slow = plan(profile(two_nodes()), 1000, 3)
    assert slow.collectives is once and slow.hierarchical and not slow.secondary_shards
    rows = {r.collectives: r.predicted_s for r in slow.choice.collective_candidates}
    assert rows["once_per_iteration"] < rows["secondary_shards"] < rows["hierarchical"] < rows["flat"] == \
        plan(profile(two_nodes()), 1000, 3, collectives="flat").predicted_iteration_s
    assert slow.predicted_iteration_s == rows["once_per_iteration"]
    # at 256 samples every rank runs one step of 32; secondary shards leave room for 30: two steps,
    # slower than hierarchical's one; once per iteration's second step stays inside the nodes
    one_step = plan(profile(two_nodes()), 256, 3)
    rows = {r.collectives: r.predicted_s for r in one_step.choice.collective_candidates}
    assert rows["once_per_iteration"] < rows["hierarchical"] < rows["secondary_shards"]
    assert plan(profile(two_nodes()), 256, 3, collectives="hierarchical").max_micro_steps == 1
    at2 = plan(profile(two_nodes(), stage=2), 256, 2)
    assert at2.collectives is once and [r.collectives for r in at2.choice.collective_candidates] == \
        ["flat", "hierarchical", "once_per_iteration"]
    # a cross link as fast as the node's: the hierarchical steps add up to more than one ring
    free = plan(profile(two_nodes(cross=FAST)), 256, 3)
    assert not free.hierarchical and not free.secondary_shards
    # ways whose memory leaves no room are no candidate (once per iteration: only for a small
    # share of the parameters, slower here); hierarchical is chosen
    tight = plan(profile(two_nodes(), bytes_per_sample=1e5), 1000, 3)
    assert tight.collectives is Collectives.HIERARCHICAL
    assert [r.predicted_s is None for r in tight.choice.collective_candidates] == [False, False, True, False]
    assert "no room for a sample" in tight.choice.collective_candidates[2].reason
    assert tight.choice.collective_candidates[3].held_share < 0.1
    again = Plan.from_dict(json.loads(json.dumps(slow.to_dict())))
    assert again.collectives is once


def test_one_node_has_one_way_and_a_way_that_does_not_apply_is_an_error() -> None:
    one = profile(Links(100 * GB, 10e-6), stage=3)
    got = plan(one, 256, 3)
    assert not got.hierarchical and got.choice.collective_candidates is None
    assert plan(one, 256, 3, collectives="hierarchical").to_dict() == got.to_dict()
    with pytest.raises(PlanError, match="hierarchical collectives run from ZeRO-1"):
        plan(profile(two_nodes(), stage=0), 256, 0, collectives="hierarchical")
    with pytest.raises(PlanError, match="secondary shards at ZeRO-3 only"):
        plan(profile(two_nodes(), stage=2), 256, 2, collectives="secondary_shards")
    with pytest.raises(PlanError, match="collectives must be 'auto' or one of flat, hierarchical"):
        plan(one, 256, 3, collectives="tree")


def test_the_simulator_plans_each_strategy_with_its_fastest_way() -> None:
    sim = simulate(profile(two_nodes()), 1000, 3)
    for name in ("poplar", "even"):
        got = sim.result(name).plan
        assert got.collectives is Collectives.ONCE_PER_ITERATION and got.predicted_iteration_s == min(
            r.predicted_s for r in got.choice.collective_candidates if r.predicted_s is not None)
    assert "once per iteration" in sim.table().splitlines()[2]
    one = simulate(profile(Links(100 * GB, 10e-6)), 1000, 3)
    assert not one.result("poplar").plan.hierarchical and one.result("poplar").plan.choice.collective_candidates is None


def test_once_per_iteration_prices_micro_steps_inside_the_nodes_and_one_crossing_per_iteration() -> None:
    pricing = LinkPricing.of(two_nodes(), 8, [2, 1, 1, 2, 1, 1, 1, 1])
    once = Collectives.ONCE_PER_ITERATION
    for op in ("reduce_scatter", "all_gather"):
        assert pricing.call_s(op, 8e9, once, in_micro_step=True) == pricing.intra_s(op, 8e9)
        assert pricing.crossing_s(op, 8e9, once) == pricing.cross_s(8e9) > 0
        # at the iteration's end (ZeRO-1's collectives, ZeRO-2's parameter gather) it crosses as hierarchical
        assert pricing.call_s(op, 8e9, once) == pricing.call_s(op, 8e9, Collectives.HIERARCHICAL)
        for way in (Collectives.FLAT, Collectives.HIERARCHICAL, Collectives.SECONDARY_SHARDS):
            assert pricing.crossing_s(op, 8e9, way) == 0.0
    assert pricing.crossing_s("all_reduce", 8e9, once) == 0.0
    # the model without a measurement: K micro-steps of intra-node steps, one crossing of the
    # parameters (ZeRO-3) and of the gradients at the iteration's end
    prof = profile(two_nodes(), stage=3)
    hier = CommModel.from_profile(prof, Collectives.HIERARCHICAL)
    model = CommModel.from_profile(prof, once)
    even = LinkPricing.of(two_nodes(), 8)
    v = prof.param_bytes
    assert model.per_micro_step_s(3) == pytest.approx(2 * even.intra_s("all_gather", v) +
                                                      even.intra_s("reduce_scatter", v))
    assert model.per_iteration_s(3) == pytest.approx(hier.per_iteration_s(3) + 2 * even.cross_s(v))
    # the gradients' exchange runs beside the last micro-step's backward (2/3 of its compute): a
    # long enough last micro-step hides it, a short one part of it; the parameters' crossing stays
    cross = even.cross_s(v)
    assert model.crossing_s(3, last_step_s=3 * cross) == pytest.approx(cross)
    assert model.crossing_s(3, last_step_s=0.75 * cross) == pytest.approx(cross + 0.5 * cross)
    assert model.led_iteration_s(3, 0.0, None, 3 * cross) == pytest.approx(hier.per_iteration_s(3) + cross)
    at2 = CommModel.from_profile(profile(two_nodes(), stage=2), once)
    assert at2.per_iteration_s(2) == pytest.approx(
        CommModel.from_profile(profile(two_nodes(), stage=2), Collectives.HIERARCHICAL).per_iteration_s(2)
        + even.cross_s(v))
    asked = plan(profile(two_nodes()), 1000, 3, collectives="once_per_iteration")
    assert asked.collectives is once and Plan.from_dict(json.loads(json.dumps(asked.to_dict()))).collectives is once
    # recorded collectives: each block's gather is recorded before forward and before backward and crosses once
    measured = profile(two_nodes(), stage=3, collectives_stage=3,
                       micro_step=[["all_gather", 2e7], ["all_gather", 2e7], ["reduce_scatter", 2e7]])
    ops = CommModel.from_profile(measured, once)
    assert ops.crossing_s(3) == pytest.approx(even.cross_s(2e7) * 2)
    assert ops.per_micro_step_s(3) == pytest.approx(2 * even.intra_s("all_gather", 2e7) +
                                                    even.intra_s("reduce_scatter", 2e7))


def test_once_per_iteration_keeps_each_node_in_step_with_itself_alone() -> None:
    # node 0 computes faster (ranks 0-3) on a slow link, node 1 slower on a fast one: no micro-step
    # crosses nodes, so each node waits on its own ranks and link alone until the iteration's end
    links = two_nodes(intra=(LinkSpeed(1 * GB, 50e-6), FAST))
    once = Collectives.ONCE_PER_ITERATION
    prof = profile(links, stage=2)
    model = CommModel.from_profile(prof, once)
    v = prof.param_bytes
    steps = [ring_s(link, "reduce_scatter", v, 4) for link in links.intra]
    assert [node.per_micro_step_s(2) for node in model.nodes] == pytest.approx(steps)
    assert model.per_micro_step_s(2) == pytest.approx(max(steps))
    curves = make_problem(prof, 64, 2, collectives=once).curves
    rows = [("fast", 8, 4, 0)] * 4 + [("slow", 8, 4, 0)] * 4
    got = evaluate_rows(rows, curves, 2, model)
    nodes = [4 * (curves[t].time(8) + c) for t, c in zip(("fast", "slow"), steps)]
    assert got.iteration_s == pytest.approx(max(nodes) + got.end_s)
    # priced in lock-step over every rank, the slower compute would meet the slower link
    every = evaluate_rows(rows, curves, 2, replace(model, nodes=()))
    assert every.iteration_s == pytest.approx(4 * (curves["slow"].time(8) + max(steps)) + every.end_s)
    assert got.iteration_s < every.iteration_s
    # at ZeRO-3 each block's first gather crosses nodes: the first micro-step is in step over every rank
    prof3 = profile(links, stage=3)
    model3 = CommModel.from_profile(prof3, once)
    curves3 = make_problem(prof3, 64, 3, collectives=once).curves
    steps3 = [node.per_micro_step_s(3) for node in model3.nodes]
    got3 = evaluate_rows(rows, curves3, 3, model3)
    first = curves3["slow"].time(8) + model3.per_micro_step_s(3)
    nodes3 = [3 * (curves3[t].time(8) + c) for t, c in zip(("fast", "slow"), steps3)]
    assert got3.iteration_s == pytest.approx(first + max(nodes3) + got3.end_s)
    # every other way, and once per iteration for part of the parameters (the rest crosses in
    # every micro-step), keeps every rank in step
    assert CommModel.from_profile(prof, Collectives.HIERARCHICAL).nodes == ()
    assert CommModel.from_profile(prof, once, held_share=0.5).nodes == ()


def test_once_per_iteration_is_held_for_part_of_the_parameters_where_the_whole_does_not_fit() -> None:
    # 20 MB held a rank at ZeRO-3 against samples of 0.6 MB: the whole way displaces 34 of 32 samples
    once = Collectives.ONCE_PER_ITERATION
    prof = profile(two_nodes(), bytes_per_sample=6e5)
    assert held_shares(prof, once, 3) == (1.0, 0.48, 0.24)  # at most 16, and at most 8, samples displaced
    with pytest.raises(PlanError, match="no room for a sample"):
        profile_as(prof, once, 3)
    assert [r.mbs for r in profile_as(prof, once, 3, 0.48).ranks] == [16] * 8
    got = plan(prof, 128, 3)
    rows = {r.collectives: r for r in got.choice.collective_candidates}
    assert got.collectives is once and got.held_share == rows["once_per_iteration"].held_share < 1
    assert got.route.held_share == got.held_share and got.predicted_iteration_s < rows["hierarchical"].predicted_s
    assert "of the parameters" in got.table() and Plan.from_dict(json.loads(json.dumps(got.to_dict()))) == got
    # the share's micro-step collectives stay inside the nodes, the rest cross; the share crosses once
    full, half = CommModel.from_profile(prof, once), CommModel.from_profile(prof, once, held_share=0.5)
    hier = CommModel.from_profile(prof, Collectives.HIERARCHICAL)
    assert half.per_micro_step_s(3) == pytest.approx((full.per_micro_step_s(3) + hier.per_micro_step_s(3)) / 2)
    assert half.crossing_s(3) == pytest.approx(full.crossing_s(3) / 2) and full.crossing_s(3) > 0
    # room for the whole way, or another way: the whole share alone
    assert held_shares(profile(two_nodes(), bytes_per_sample=8e6), once, 3) == (1.0,)
    assert held_shares(prof, Collectives.SECONDARY_SHARDS, 3) == (1.0,)
    assert simulate(prof, 128, 3).result("poplar").plan.held_share == got.held_share
