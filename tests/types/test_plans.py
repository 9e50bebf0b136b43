"""Plan rows, validation and the JSON round trip."""

from __future__ import annotations

import json

import pytest

from poplar.types.plans import Plan, PlanError, RankPlan


def test_rank_plan_counts() -> None:
    r = RankPlan(micro_batch_size=3, accum_steps=2, last_batch_size=1)
    assert r.num_samples == 7 and r.num_micro_steps == 3 and r.micro_batch_sizes() == [3, 3, 1]
    assert RankPlan(0, 0, 0).num_micro_steps == 0
    assert RankPlan(0, 0, 4).micro_batch_sizes() == [4]


def test_plan_offsets_and_total() -> None:
    p = Plan([RankPlan(3, 2, 1), RankPlan(2, 1, 0), RankPlan(2, 2, 1)])
    assert p.global_batch_size == 14 and p.sample_offsets() == [0, 7, 9] and p.max_micro_steps == 3


def test_even() -> None:
    p = Plan.even(4, 32, 3)
    assert [r.num_samples for r in p.ranks] == [8] * 4 and p.ranks[0].micro_batch_sizes() == [3, 3, 2]
    with pytest.raises(PlanError, match="does not divide"):
        Plan.even(3, 32, 4)


def test_json_round_trip(tmp_path) -> None:
    p = Plan([RankPlan(3, 2, 1, predicted_compute_s=0.25, device_type="T4-16G"), RankPlan(5, 1, 0)],
             zero_stage=2, strategy="poplar", predicted_iteration_s=0.5)
    path = tmp_path / "plan.json"
    p.save(path)
    assert json.loads(path.read_text())["global_batch_size"] == 12
    assert Plan.load(path) == p


@pytest.mark.parametrize("rows, match", [
    ([], "no ranks"),
    ([RankPlan(-1, 1, 0)], "micro_batch_size must be >= 0"),
    ([RankPlan(0, 2, 0)], "empty micro-steps"),
    ([RankPlan(2, 1.5, 0)], "accum_steps must be an int"),
    ([RankPlan(0, 0, 0)], "0 samples"),
])
def test_bad_plans(rows, match) -> None:
    with pytest.raises(PlanError, match=match):
        Plan(rows)


def test_bad_json(tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"ranks": [{"micro_batch_size": 2, "accum_steps": 1}], "global_batch_size": 5}')
    with pytest.raises(PlanError, match="sum to 2"):
        Plan.load(path)
    path.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(path)


def test_every_table_has_the_offload_column_as_plan_json_records_it() -> None:
    from poplar.types.plans import Offload

    plans = [Plan.even(2, 16, 2),  # nothing offloads: the column still says where each optimizer lives
             Plan([RankPlan(3, 2, 1, offload=Offload.OPTIMIZER), RankPlan(5, 1, 0, offload=Offload.OPTIMIZER)]),
             Plan([RankPlan(3, 2, 1, shard_weight=2.0), RankPlan(5, 1, 0, offload=Offload.OPTIMIZER)])]
    for plan in plans:
        lines = plan.table().splitlines()
        assert lines[0].split()[-1] == "offload", lines
        recorded = [row["offload"] for row in plan.to_dict()["ranks"]]
        assert [line.split()[-1] for line in lines[2:2 + len(plan.ranks)]] == recorded, (lines, recorded)
    assert "shard" in plans[2].table().splitlines()[0]
