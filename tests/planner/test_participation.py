"""Which GPUs take part (``planner.participation``): on two nodes across a very slow link the plan
leaves the slower node out of the step, across a fast one it keeps every GPU; each subset is
planned on the profile of the ranks that stay, on their links, its measured exposure scaled to
them; a job on one node is planned as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poplar.planner import plan
from poplar.planner.cost_model import CommModel
from poplar.planner.groups import group_profile
from poplar.planner.participation import on_ranks, subsets
from poplar.types.plans import PlanError
from poplar.types.profiles import Carry, Exposure, LedExposure, LinkSpeed, Links
from poplar.types.topology import Topology
from tests.planner.test_link_pricing import FAST, GB, profile, two_nodes

CRAWL = LinkSpeed(0.05 * GB, 1e-3)  # 400 Mbit/s: every byte across costs more than the slow node brings


def test_a_very_slow_link_leaves_the_slower_node_out_and_a_fast_one_keeps_every_gpu() -> None:
    slow = plan(profile(two_nodes(cross=CRAWL)), 512, 3)
    assert slow.left_out == (4, 5, 6, 7) and slow.step_ranks == (0, 1, 2, 3)
    assert all(r.num_samples == 0 and r.shard_weight == 0 and r.device_type == "slow" for r in slow.ranks[4:])
    assert slow.global_batch_size == 512 and slow.problem(8) is None and not slow.hierarchical
    rows = {r.subset: r for r in slow.choice.participation_candidates}
    assert set(rows) == {"all", "without node 0", "without node 1"}  # the types are the nodes: planned once
    assert rows["without node 1"].chosen and rows["without node 1"].left_out == (4, 5, 6, 7)
    assert slow.predicted_iteration_s == rows["without node 1"].predicted_s < rows["all"].predicted_s
    assert rows["all"].predicted_s == plan(profile(two_nodes(cross=CRAWL)), 512, 3,
                                              participation="all").predicted_iteration_s
    fast = plan(profile(two_nodes(cross=FAST)), 512, 3)
    assert fast.left_out == () and fast.choice.participation_candidates[0].chosen


def test_each_subset_is_planned_on_its_own_ranks_and_links() -> None:
    prof = profile(two_nodes(sizes=(3, 5), intra=(FAST, LinkSpeed(20 * GB, 20e-6)), cross=CRAWL), ranks=8)
    names = [s.name for s in subsets(prof)]
    assert names == ["all", "without node 0", "without node 1", "without fast", "without slow"]
    node1 = on_ranks(prof, range(3, 8))  # one node: its own link is the flat one
    assert node1.world_size == 5 and [r.rank for r in node1.ranks] == list(range(5))
    assert not node1.comm.links.spans_nodes and node1.comm.links.bandwidth_bytes_per_s == 20 * GB
    no_fast = on_ranks(prof, range(4, 8))  # ranks of node 1 only, but named by type: still one node
    assert no_fast.comm.links.topology is None or not no_fast.comm.links.spans_nodes
    spread = on_ranks(prof, (0, 1, 4, 5, 6))
    assert spread.comm.links.topology == Topology.of_sizes([2, 3]) and spread.comm.links.cross == CRAWL
    assert [r.device_type for r in spread.ranks] == ["fast", "fast", "slow", "slow", "slow"]


def test_one_node_and_every_gpu_asked_for_are_planned_as_before() -> None:
    one = profile(Links(100 * GB, 10e-6))
    assert subsets(one)[0].name == "all" and len(subsets(one)) == 1
    got = plan(one, 256, 3)
    assert got.to_dict() == plan(one, 256, 3, participation="all").to_dict()
    assert got.choice.participation_candidates is None and got.left_out == ()
    kept = plan(profile(two_nodes(cross=CRAWL)), 512, 3, require_all_ranks=True)
    assert kept.left_out == () and kept.choice.participation_candidates is None
    fp16 = replace(profile(two_nodes(cross=CRAWL)), precision="fp16")  # a loss scale a rank left out would miss
    assert plan(fp16, 512, 3).left_out == ()
    with pytest.raises(PlanError, match="participation must be 'auto'"):
        plan(one, 256, 3, participation="some")


def _with_shards(prof, shard_bytes: int):
    """``prof`` with each rank's measured shard (even shares) and the bytes a sample takes."""
    return replace(prof, ranks=[replace(r, shard_bytes=shard_bytes) for r in prof.ranks])


def test_a_subset_holds_the_whole_sharded_state_so_its_ranks_fit_smaller_batches() -> None:
    # 8 ranks measured mbs 32 with 40 MB a sample, each holding 1/8 of 8 x 80 MB = 640 MB of state:
    # with node 1 left out each of the 4 others holds 160 MB, 80 MB more, 2 samples' worth
    prof = _with_shards(profile(two_nodes(cross=CRAWL)), 80 * 10**6)
    kept = on_ranks(prof, range(4))
    assert [r.mbs for r in kept.ranks] == [30] * 4 and [r.shard_bytes for r in kept.ranks] == [160 * 10**6] * 4
    assert all(max(p.batch for p in r.points) <= 30 for r in kept.ranks)
    assert [p.batch for p in kept.ranks[0].points_past_mbs] == [32]  # measured: the curve where room comes back
    # 30 lies between the measured 16 and 32: the subset's curve is the whole profile's, cut at 30
    # (Note: an mbs between measured batches), not 16's speed held up to 30
    whole = {g.device_type: g.curve for g in group_profile(prof)}
    assert {g.device_type: g.curve.times.tolist() for g in group_profile(kept)} == {"fast": whole["fast"].times[:30].tolist()}
    slow = plan(prof, 512, 3)
    assert slow.left_out == (4, 5, 6, 7) and max(r.micro_batch_size for r in slow.ranks) <= 30
    # 8 x 1.3 GB of state: without a node each rank holds 1.3 GB more, 33 samples' worth of its 32
    tight = _with_shards(profile(two_nodes(cross=CRAWL)), 1300 * 10**6)
    with pytest.raises(PlanError, match="batch 1 does not fit"):
        on_ranks(tight, range(4))
    rows = {r.subset: r for r in plan(tight, 512, 3).choice.participation_candidates or []}
    assert rows and rows["without node 1"].predicted_s is None and "batch 1" in rows["without node 1"].reason


def test_a_subset_is_priced_from_the_measured_exposure_carried_to_its_links() -> None:
    # measured at ZeRO-3 flat over every rank, whose ring runs at the 1 GB/s link between nodes (its
    # micro-step's 3 collectives of 40 MB take 0.105 s one by one; 0.09 s of them were exposed),
    # nodes of 2 GB/s; both types led rounds
    led = (LedExposure("fast", micro_step_s=0.1, iteration_s=0.06, micro_step_small_lead_s=0.05),
           LedExposure("slow", micro_step_s=0.095))
    x = Exposure(micro_step_s=0.09, iteration_s=0.05, step_compute_s=(0.01, 0.03), step_s=(0.1, 0.09),
                 switch_s=0.01, overhead_s=0.01, leaders=led, end_s=(0.06, 0.05))
    mid = LinkSpeed(2 * GB, 50e-6)
    prof = profile(two_nodes(intra=(mid, mid)), exposure=x, collectives_stage=3,
                   micro_step=[["all_gather", 4e7], ["all_gather", 4e7], ["reduce_scatter", 4e7]],
                   iteration=[["all_reduce", 8]])
    node0 = on_ranks(prof, range(4))
    bare = (lambda p: replace(p, comm=replace(p.comm, exposure=Exposure())))  # noqa: E731
    whole, part = CommModel.from_profile(bare(prof)), CommModel.from_profile(bare(node0))
    ratio = part.serial_micro_step_s(3) / whole.serial_micro_step_s(3)
    saved = whole.serial_micro_step_s(3) - part.serial_micro_step_s(3)
    # the node's ring, not the one at the slow link's pace
    assert ratio == pytest.approx((0.75 * 4e7 / 2e9 + 50e-6) / (0.875 * 4e7 / 1e9 + 50e-6))
    assert saved == pytest.approx(3 * (0.875 * 4e7 / 1e9 - 0.75 * 4e7 / 2e9))

    def carried(v: float) -> float:  # the smaller of scaled and moved, none below zero
        return max(0.0, min(v * ratio, v - saved))
    # here the seconds saved bind (0.09 moved by 0.06 is under 0.09 scaled by 0.43), and the small
    # led rounds' 0.05 carries to nothing
    assert carried(0.09) == pytest.approx(0.09 - saved) and 0.09 - saved < 0.09 * ratio and carried(0.05) == 0.0
    got = node0.comm.exposure
    assert got.micro_step_s == pytest.approx(carried(0.09)) and got.step_s == pytest.approx((carried(0.1), carried(0.09)))
    assert got.switch_s == pytest.approx(0.01 * ratio) and got.step_compute_s == (0.01, 0.03)  # a difference: scaled
    fast, = got.leaders  # the slow type is left out with its node
    assert fast.micro_step_s == pytest.approx(carried(0.1)) and fast.micro_step_small_lead_s == 0.0
    end = Carry.between(part.serial_iteration_s(3), whole.serial_iteration_s(3))
    assert got.iteration_s == pytest.approx(end.of(0.05)) and got.overhead_s == 0.01  # the overhead is no collective
    # priced: the subset's micro-step from the carried exposure, below the formulas' serial seconds
    # (compute hid some of them); its end with the measured overhead, which the formulas lack
    model = CommModel.from_profile(node0)
    assert model.per_micro_step_s(3) == pytest.approx(carried(0.09)) and carried(0.09) < part.per_micro_step_s(3)
    assert model.per_iteration_s(3) == pytest.approx(end.of(0.05) + 0.01)
    # nothing measured: nothing carried
    assert on_ranks(profile(two_nodes(cross=CRAWL)), range(4)).comm.exposure == Exposure()
