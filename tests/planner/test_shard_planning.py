"""The planner's shard weights (``planner.shards``): the memory each weight leaves for batches,
the candidates, and the choice: even shards where memory does not bind, weights that move state
to the roomier cards where they let the short ones run larger micro-batches, explicit weights."""

from __future__ import annotations

import pytest

from poplar.emulation.synthetic import GIB, ModelSpec, synthetic_profile
from poplar.planner import shards
from poplar.planner.groups import group_profile
from poplar.planner.planning import plan
from poplar.types.profiles import Profile, ProfileError
from poplar.types.plans import Plan, PlanError


def _profile(cluster: str, stage: int, params: float):
    return synthetic_profile(cluster, stage, ModelSpec(f"m{params:g}", int(params), 1.0 * GIB))


def test_largest_micro_batch_follows_the_share() -> None:
    prof = _profile("C", 2, 3e9)  # 2 x A800-80G + 2 x V100S-32G
    small = next(r for r in prof.ranks if r.device_type.startswith("V100"))
    assert shards.mbs_at(prof, [1.0] * 4) == [r.mbs for r in prof.ranks]
    weights = [1.5 if r.device_type.startswith("A800") else 0.5 for r in prof.ranks]
    moved = shards.mbs_at(prof, weights)
    # the short card holds half its even share: shard_bytes / 2 freed, whole samples of it
    freed = small.shard_bytes * 0.5
    assert moved[small.rank] == small.mbs + int(freed // small.bytes_per_sample)
    big = next(r for r in prof.ranks if r.device_type.startswith("A800"))
    assert moved[big.rank] == big.mbs - -(-int(freed) // int(big.bytes_per_sample))
    assert shards.step_scale(prof, weights) == pytest.approx(4 * 1.5 / 4)


def test_a_short_card_s_coarse_slope_does_not_price_its_freed_state() -> None:
    """A card that fitted two samples measured its bytes per sample between two peaks of
    different phases (six times the true slope here); its capacity at a smaller share is priced
    with the slope of the card whose fits span the most samples."""
    prof = _profile("C", 2, 3e9)
    small = next(r for r in prof.ranks if r.device_type.startswith("V100"))
    big = max(prof.ranks, key=lambda r: r.mbs)
    true_slope = big.bytes_per_sample
    for r in prof.ranks:
        if r.device_type == small.device_type:
            r.bytes_per_sample = 6 * true_slope
    assert shards.activation_bytes(prof) == true_slope
    weights = [1.5 if r.device_type.startswith("A800") else 0.5 for r in prof.ranks]
    freed = small.shard_bytes * 0.5
    assert shards.mbs_at(prof, weights)[small.rank] == small.mbs + int(freed // true_slope)


def test_candidates_start_even_and_lean_towards_memory() -> None:
    prof = _profile("A", 2, 2e9)
    cands = shards.candidates(prof)
    assert cands[0].weights == (1.0,) * 4 and len(cands) == 1 + len(shards.BLENDS) + len(shards.BEYOND)
    big = [r.rank for r in prof.ranks if r.device_type.startswith("A100-80")]
    for c in cands[1:]:
        assert all(c.weights[r] > 1.0 for r in big) and sum(c.weights) == pytest.approx(4.0)
    # each step leans further: the short cards' weights fall to none, their memory all activations
    small = [r for r in range(4) if r not in big]
    assert [c.weights[small[0]] for c in cands] == sorted((c.weights[small[0]] for c in cands), reverse=True)
    assert all(cands[-1].weights[r] == 0.0 for r in small)
    assert shards.mbs_at(prof, cands[-1].weights)[small[0]] > shards.mbs_at(prof, cands[4].weights)[small[0]]
    # ZeRO-0 shards nothing, and a profile that does not know its shard bytes cannot move them
    assert len(shards.candidates(_profile("A", 0, 2e9))) == 1
    legacy = _profile("A", 2, 2e9)
    for r in legacy.ranks:
        r.shard_bytes = None
    assert len(shards.candidates(legacy)) == 1
    with pytest.raises(PlanError, match="shard_bytes"):
        shards.mbs_at(legacy, [2, 2, 1, 1])


def test_even_shards_where_memory_does_not_bind() -> None:
    for cluster, stage in [("A", 2), ("C", 3), ("B", 2)]:
        prof = _profile(cluster, stage, 125e6)
        auto = plan(prof, 256, stage, shards="auto")
        assert auto.even_shards, (cluster, stage, auto.shard_weights)
        assert auto.choice.shard_candidates[0].name == "even"


def test_memory_bound_rows_move_state_to_the_roomy_cards() -> None:
    prof = _profile("C", 2, 3e9)
    even, auto = plan(prof, 256, 2), plan(prof, 256, 2, shards="auto")
    assert not auto.even_shards
    roomy = {r.rank for r in prof.ranks if r.device_type.startswith("A800")}
    assert min(auto.shard_weights[r] for r in roomy) > max(w for r, w in enumerate(auto.shard_weights)
                                                           if r not in roomy)
    assert auto.predicted_iteration_s < even.predicted_iteration_s * (1 - auto.choice.plan_tie)
    short = min(r.rank for r in prof.ranks if r.rank not in roomy)
    assert auto.ranks[short].micro_batch_size > even.ranks[short].micro_batch_size
    again = Plan.from_dict(auto.to_dict())
    assert again.shard_weights == auto.shard_weights and "shard" in auto.table()


def test_explicit_weights_and_bad_choices() -> None:
    prof = _profile("C", 2, 3e9)
    weights = [1.2 if r.device_type.startswith("A800") else 0.8 for r in prof.ranks]
    p = plan(prof, 256, 2, shards=weights)
    assert p.shard_weights == tuple(weights)
    assert [r.micro_batch_size <= m for r, m in zip(p.ranks, shards.mbs_at(prof, weights))] == [True] * 4
    first_small = min(r.rank for r in prof.ranks if r.device_type.startswith("V100"))
    starved = [1.0 if r.rank == first_small else 0.0 for r in prof.ranks]  # all the state on a 32 GB card
    with pytest.raises(PlanError, match="fits no sample"):
        plan(prof, 256, 2, shards=starved)
    with pytest.raises(PlanError, match="'even', 'auto'"):
        plan(prof, 256, 2, shards="proportional")
    with pytest.raises(PlanError, match="profile's stage"):
        plan(prof, 256, 3, shards=weights)
    assert plan(prof, 256, 3, shards="auto").even_shards  # another stage: its shard bytes are unknown


def test_a_profile_measured_at_uneven_weights_plans_from_them() -> None:
    """A profile measured at other weights than even (the model fitted no even shards) moves
    state from there: its own weights give its own mbs, and other weights move from it exactly as
    an even-shard profile's would."""
    prof = _profile("C", 2, 3e9)
    weights = [1.5 if r.device_type.startswith("A800") else 0.5 for r in prof.ranks]
    measured = shards.reshaped(prof, weights)
    assert measured.shard_weights == weights
    for r in measured.ranks:  # as if measured there: the shard follows the weights
        r.shard_bytes = int(prof.ranks[r.rank].shard_bytes * weights[r.rank])
    measured = Profile.from_dict(measured.to_dict())  # the field survives JSON
    assert measured.shard_weights == weights
    assert shards.mbs_at(measured, weights) == [r.mbs for r in measured.ranks]
    back = shards.mbs_at(measured, [1.0] * 4)
    assert all(abs(b - r.mbs) <= 1 for b, r in zip(back, prof.ranks)), (back, [r.mbs for r in prof.ranks])
    assert shards.step_scale(measured, [1.0] * 4) == pytest.approx(1.0 / 1.5)
    assert "measured" in [c.name for c in shards.candidates(measured)]
    assert plan(measured, 256, 2, shards=weights).shard_weights == tuple(weights)
    with pytest.raises(ProfileError, match="shard_weights"):
        Profile.from_dict({**measured.to_dict(), "shard_weights": [1.0, 2.0]})


def test_weights_to_fit_give_the_short_cards_what_their_room_holds() -> None:
    # two ranks fitted batch 1 (fixed 30 of their 100), two did not (capacity 40): rooms 70, 70, 10, 10
    weights = shards.weights_to_fit([100, 100, 40, 40], [30, 30, None, None], [20, 20, None, None])
    assert weights == pytest.approx((1.75, 1.75, 0.25, 0.25))
    assert shards.weights_to_fit([100, 40], [None, None], [None, None]) is None  # nobody fitted
    assert shards.weights_to_fit([40, 40], [30, None], [25, None]) is None  # 50 of state, 20 of room


def test_a_larger_shard_cuts_the_mbs_and_the_points_past_it_still_shape_the_curve() -> None:
    # a shard weight that cuts a rank's mbs below batches it was timed at moves those points past
    # its mbs, and its curve up to the new mbs is the measured one (Note: an mbs between measured
    # batches), not the speed of the last batch that still fits held
    prof = _profile("C", 2, 0.35e9)
    r0 = prof.ranks[0]
    measured = sorted(p.batch for p in r0.points)
    cut = next(b for b in range(r0.mbs - 1, 0, -1) if b not in measured and any(m > b for m in measured))
    mbs = [cut if r.device_type == r0.device_type else r.mbs for r in prof.ranks]
    out = shards.with_mbs(prof, [1.0] * prof.world_size, mbs)
    assert out is not None and out.ranks[0].mbs == cut
    assert [p.batch for p in out.ranks[0].points_past_mbs if p.batch > cut][:1] == [min(m for m in measured if m > cut)]
    whole = {g.device_type: g.curve for g in group_profile(prof)}[r0.device_type]
    cut_curve = {g.device_type: g.curve for g in group_profile(out)}[r0.device_type]
    assert cut_curve.times.tolist() == whole.times[:cut].tolist()
