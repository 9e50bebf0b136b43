"""A plan's route (``types/route.py``): one typed value on its whole road, and the files written
before it (two booleans, ``hierarchical`` and ``secondary_shards``) read into it in one place."""

from __future__ import annotations

import json

import pytest

from poplar.types.compression import CommPolicy
from poplar.types.plans import Plan, PlanError, RankPlan
from poplar.types.profiles import Profile, ProfileError
from poplar.types.route import Collectives, Route, RouteError, read_collectives
from tests.planner.test_link_pricing import profile, two_nodes

ROWS = [RankPlan(2, 1, 0), RankPlan(0, 0, 0, shard_weight=0), RankPlan(3, 1, 0)]
PAIRS = [((False, False), Collectives.FLAT), ((True, False), Collectives.HIERARCHICAL),
         ((True, True), Collectives.SECONDARY_SHARDS)]


@pytest.mark.parametrize("pair, way", PAIRS)
def test_a_plan_file_written_before_routes_loads_with_its_way(tmp_path, pair, way) -> None:
    d = Plan(ROWS, zero_stage=3).to_dict()
    del d["collectives"]
    d["hierarchical"], d["secondary_shards"] = pair
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    plan = Plan.load(path)
    assert plan.collectives is way and (plan.hierarchical, plan.secondary_shards) == pair
    assert plan.route == Route((0, 2), way, plan.compression)
    again = Plan.from_dict(json.loads(plan.to_json()))  # written back: the enum, not the booleans
    assert again == plan and "hierarchical" not in plan.to_dict() and plan.to_dict()["collectives"] == way.value


def test_the_invalid_pair_is_one_error_with_its_fix_wherever_it_is_read() -> None:
    pair = {"hierarchical": False, "secondary_shards": True}
    with pytest.raises(RouteError, match="set hierarchical=True too"):
        Collectives.of(False, True)
    with pytest.raises(RouteError, match="set hierarchical=True too"):
        read_collectives(pair)
    d = {k: v for k, v in Plan(ROWS).to_dict().items() if k != "collectives"}
    with pytest.raises(PlanError, match="set hierarchical=True too"):
        Plan.from_dict({**d, **pair})
    prof = profile(two_nodes(), stage=3).to_dict()
    del prof["comm"]["collectives"]
    with pytest.raises(ProfileError, match="set hierarchical=True too"):
        Profile.from_dict({**prof, "comm": {**prof["comm"], **pair}})
    with pytest.raises(PlanError, match="collectives alone"):  # both forms: which one is meant?
        Plan.from_dict({**d, **pair, "collectives": "flat"})
    with pytest.raises(PlanError, match="collectives must be one of 'flat', 'hierarchical'"):
        Plan(ROWS, collectives="ring")


@pytest.mark.parametrize("pair, way", PAIRS)
def test_a_profile_written_before_routes_loads_with_the_way_it_was_measured_under(tmp_path, pair, way) -> None:
    d = profile(two_nodes(), stage=3).to_dict()
    del d["comm"]["collectives"]
    d["comm"]["hierarchical"], d["comm"]["secondary_shards"] = pair
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    prof = Profile.load(path)
    assert prof.comm.collectives is way
    prof.save(path)
    assert json.loads(path.read_text())["comm"]["collectives"] == way.value and Profile.load(path) == prof


def test_a_route_is_one_frozen_value() -> None:
    route = Route([3, 0, 2], "secondary_shards", CommPolicy(gradients="int8"))
    assert route.step_ranks == (0, 2, 3) and route.collectives is Collectives.SECONDARY_SHARDS
    assert route == Route((0, 2, 3), Collectives.SECONDARY_SHARDS, CommPolicy(gradients="int8"))
    assert hash(route) == hash(Route((0, 2, 3), Collectives.SECONDARY_SHARDS, CommPolicy(gradients="int8")))
    assert Route().ranks_in_step(4) == (0, 1, 2, 3) and route.ranks_in_step(4) == (0, 2, 3)
    with pytest.raises(RouteError, match="ranks of the world of 3"):
        route.ranks_in_step(3)
    with pytest.raises(RouteError, match="distinct ranks"):
        Route((0, 0))
    with pytest.raises(RouteError, match="CommPolicy"):
        Route(compression="int8")
    with pytest.raises(AttributeError):
        route.collectives = Collectives.FLAT  # type: ignore[misc]
    assert [c for c in Collectives] == [Collectives.FLAT, Collectives.HIERARCHICAL, Collectives.SECONDARY_SHARDS,
                                        Collectives.ONCE_PER_ITERATION]
    once = Collectives.ONCE_PER_ITERATION
    assert once.hierarchical and not once.secondary_shards and all(once.applies(stage) for stage in range(4))


def test_a_share_held_is_a_prefix_of_the_pieces_and_only_once_per_iteration_takes_one() -> None:
    once = Collectives.ONCE_PER_ITERATION
    assert Route(None, once, held_share=0.5).held([10, 20, 30, 40]) == (True, True, False, False)
    assert Route(None, once, held_share=0.5).held([60, 10, 30]) == (False, False, False)  # a prefix, nothing after
    assert Route(None, once).held([5, 5]) == (True, True) and Route().held([1]) == (True,)
    with pytest.raises(RouteError, match="applies to collectives=\"once_per_iteration\" only"):
        Route(None, Collectives.HIERARCHICAL, held_share=0.5)
    for bad in (0, 1.5, float("nan"), True):
        with pytest.raises(RouteError, match=r"held_share must be a number in \(0, 1\]"):
            Route(None, once, held_share=bad)
    plan = Plan(ROWS, zero_stage=3, collectives=once, held_share=0.25)
    assert plan.route.held_share == 0.25 and "for 25% of the parameters" in plan.table()
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    with pytest.raises(PlanError, match="set it to 1.0"):
        Plan(ROWS, zero_stage=3, collectives=Collectives.FLAT, held_share=0.25)
    older = plan.to_dict()
    del older["held_share"]  # a plan written before shares: the whole way
    assert Plan.from_dict(older).held_share == 1.0
