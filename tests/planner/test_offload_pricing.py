"""The planner's offload pricing (``planner.offload_pricing``, ``planner.placement_choice``): what
offloading frees and costs each rank, from the profile; the choice: no offload where nothing
needs it, the short rank alone where only it cannot fit, offload where the model fits no other
way, and no offload within the plan's tie."""

from __future__ import annotations

import pytest

from poplar.emulation.synthetic import GIB, ModelSpec, synthetic_profile
from poplar.planner import offload_pricing
from poplar.planner.planning import plan
from poplar.types.plans import Offload, OffloadPricing, PlanError
from poplar.types.profiles import OffloadCost, Profile

N, O = Offload.NONE, Offload.OPTIMIZER


def _profile(cluster: str, stage: int, params: float, bandwidth: float = 12e9, step: float = 1e-9,
             master: float = 0.0) -> Profile:
    prof = synthetic_profile(cluster, stage, ModelSpec(f"m{params:g}", int(params), 1.0 * GIB))
    for r in prof.ranks:  # AdamW in fp32: 8 bytes of state per element leave the device
        r.offload_cost = OffloadCost(bandwidth, bandwidth, step, 8.0, master)
    return prof


def test_freed_bytes_and_seconds_by_hand() -> None:
    prof = _profile("C", 2, 3e9, master=4.0)  # 2 x A800-80G + 2 x V100S-32G
    even = [1.0] * 4
    e = 3e9 / 4  # elements in an even shard
    assert offload_pricing.freed_bytes(prof, even) == [pytest.approx(12 * e)] * 4  # 8 state + 4 master
    # fp32 gradient out and values back at 12 GB/s: 3e9 bytes each way, 0.25 s; host step 0.75 s
    seconds = offload_pricing.offload_seconds(prof, even, (N, N, O, N))
    assert seconds == [0.0, 0.0, pytest.approx(0.25 + 0.75 + 0.25), 0.0]
    # 9e9 freed bytes at 1 GiB per sample: 8 more samples, only on the offloading rank
    base = [r.mbs for r in prof.ranks]
    assert offload_pricing.mbs_with(prof, even, (N, N, O, N)) == [base[0], base[1], base[2] + 8, base[3]]
    # a larger share frees more (and the shard weights move the state as planner.shards says)
    weights = [1.5, 1.5, 0.5, 0.5]
    assert offload_pricing.freed_bytes(prof, weights)[0] == pytest.approx(12 * 3e9 * 1.5 / 4)


def test_nothing_needs_offload_so_nothing_offloads() -> None:
    for cluster, stage in [("B", 2), ("A", 2), ("C", 3)]:
        prof = _profile(cluster, stage, 125e6)
        auto = plan(prof, 256, stage, offload="auto", shards="auto")
        assert auto.offloads == (N,) * 4, (cluster, stage)
        assert auto.predicted_iteration_s == pytest.approx(plan(prof, 256, stage, shards="auto").predicted_iteration_s)
        assert len(auto.choice.placement_candidates) > 1  # offload was priced, and lost


def test_the_short_rank_alone_offloads_when_it_cannot_fit_without() -> None:
    """Measured with rank 3's optimizer on the host (3 samples fitted): on the device its 6 GB
    shard of AdamW state (5.6 samples of 1 GiB) leaves no sample, so only rank 3 offloads."""
    prof = _profile("C", 2, 3e9)
    prof.offloads = ["none", "none", "none", "optimizer"]
    prof.ranks[3].mbs = 3
    prof.ranks[3].points = [p for p in prof.ranks[3].points if p.batch <= 3]
    even = [1.0] * 4
    assert offload_pricing.mbs_with(prof, even, (N,) * 4)[3] == 0
    assert offload_pricing.candidates(prof, even)[1].offloads == (N, N, N, O)  # "to fit"
    auto = plan(prof, 64, 2, offload="auto")
    assert auto.offloads == (N, N, N, O)
    assert auto.choice.offload_s[3] == pytest.approx(1.25) and auto.choice.offload_s[:3] == [0.0] * 3
    # the price: the same rows without the offload's seconds, plus them
    rows_only = offload_pricing.reshaped(prof, even, auto.offloads)
    rows_only.offloads = None
    assert auto.predicted_iteration_s == pytest.approx(plan(rows_only, 64, 2).predicted_iteration_s + 1.25)
    with pytest.raises(PlanError, match="fit every rank a sample"):
        plan(prof, 64, 2, offload=(N,) * 4)


def test_a_model_that_fits_no_rank_without_offload_plans_with_it() -> None:
    prof = _profile("B", 2, 1e9)
    prof.offloads = ["optimizer"] * 4
    for r in prof.ranks:  # 2 GB of state per rank without offload: more than each rank's 1 sample
        r.mbs, r.points = 1, r.points[:1]
    auto = plan(prof, 32, 2, offload="auto")
    assert auto.offloads == (O,) * 4 and auto.global_batch_size == 32
    with pytest.raises(PlanError, match="fit every rank a sample"):
        plan(prof, 32, 2)  # none: the placement it was measured at is taken away


def test_offload_where_it_is_faster_and_not_where_the_copies_cost_more() -> None:
    """1B parameters on 16 GB cards: offloading lets each rank run one more sample per
    micro-step. Over a fast link and host that is a gain; over a slow one the copies cost more."""
    fast = plan(_profile("B", 2, 1e9, bandwidth=100e9, step=1e-11), 256, 2, offload="auto")
    assert O in fast.offloads
    none = plan(_profile("B", 2, 1e9), 256, 2)
    assert fast.predicted_iteration_s < none.predicted_iteration_s / (1 + fast.choice.plan_tie)
    slow = plan(_profile("B", 2, 1e9, bandwidth=1e9, step=1e-8), 256, 2, offload="auto")
    assert slow.offloads == (N,) * 4


def test_explicit_placements_are_priced_and_unpriced_profiles_keep_the_device() -> None:
    prof = _profile("B", 2, 1e9)
    given = plan(prof, 64, 2, offload=(N, O, O, N))
    assert given.offloads == (N, O, O, N) and max(given.choice.offload_s) > 0
    legacy = synthetic_profile("B", 2, ModelSpec("m", int(1e9), 1.0 * GIB))  # no offload_cost
    auto = plan(legacy, 64, 2, offload="auto")
    assert auto.offloads == (N,) * 4 and auto.choice.offload_pricing is OffloadPricing.NO_OFFLOAD_COST
    kept = plan(legacy, 64, 2, offload=(N, O, O, N))
    assert kept.offloads == (N, O, O, N) and kept.choice.offload_pricing is OffloadPricing.AS_GIVEN
    with pytest.raises(PlanError, match="ZeRO-0"):
        plan(_profile("B", 0, 125e6), 64, 0, offload=(O,) * 4)
    with pytest.raises(PlanError, match="one Offload per rank"):
        plan(prof, 64, 2, offload="some")
    with pytest.raises(PlanError, match="3 offload placements"):
        plan(prof, 64, 2, offload=(N, O, O))


def test_cli_plan_offload_auto_shows_the_offloading_rank(tmp_path, capsys) -> None:
    from poplar.cli import main

    prof = _profile("C", 2, 3e9)
    prof.offloads = ["none", "none", "none", "optimizer"]
    prof.ranks[3].mbs = 3
    prof.ranks[3].points = [p for p in prof.ranks[3].points if p.batch <= 3]
    prof.save(tmp_path / "profile.json")
    assert main(["plan", "--profile", str(tmp_path / "profile.json"), "--gbs", "64", "--offload", "auto"]) == 0
    table = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(table) if line.lstrip().startswith("rank"))
    assert table[head].split()[-1] == "offload"
    assert [line.split()[-1] for line in table[head + 2:head + 6]] == ["none", "none", "none", "optimizer"]
