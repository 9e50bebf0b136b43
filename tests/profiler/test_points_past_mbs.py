"""Timing past a rank's mbs (``profiler.shard_room``): a short card that fits few samples at even
shards is timed, at the shard weights that give it room, at the batches planned shards let it
run, so the planner prices them at its measured speed instead of extending the curve at the
speed of its largest even-shard batch."""

from __future__ import annotations

import copy

import pytest
import torch

from poplar.process.launch import spawn
from poplar.emulation import VirtualDevice
from poplar.emulation.synthetic import GIB, ModelSpec, synthetic_profile
from poplar.planner import shards
from poplar.planner.planning import plan
from poplar.profiler.profile_run import ProfileOptions, profile_rank
from poplar.profiler.shard_room import sizes_past_mbs
from poplar.types.profiles import Profile, ProfileError, ProfilePoint
from poplar.planner.shard_memory import blended, emptied_blend, proportional_weights
from poplar.zero.observers import MicroStep
from tests.scripted_device import ScriptedClock
from tests.toy import SEQ, VOCAB, loss_fn, make_model


def _short_profile() -> Profile:
    """2 x A800-80G + 2 x V100S-32G at ZeRO-3 with a model that leaves the V100S few samples."""
    return synthetic_profile("C", 3, ModelSpec("m3e9", int(3e9), 1.0 * GIB))


def test_sizes_past_mbs_are_the_short_ranks_batches_up_to_their_room() -> None:
    prof = _short_profile()
    weights, sizes = sizes_past_mbs(prof, max_batch=10_000)
    assert weights == blended(proportional_weights(prof), emptied_blend(proportional_weights(prof)))
    room = shards.mbs_at(prof, weights)
    for r in prof.ranks:
        if r.device_type.startswith("V100"):
            assert sizes[r.rank] and min(sizes[r.rank]) > r.mbs and max(sizes[r.rank]) == room[r.rank]
        else:  # a roomy card's micro-batch only shrinks as it takes on state
            assert sizes[r.rank] == [] and room[r.rank] <= r.mbs
    capped = sizes_past_mbs(prof, max_batch=min(r.mbs for r in prof.ranks))
    assert capped is None  # nothing past a search's own cap


def test_no_sizes_without_shard_memory_or_a_second_rank() -> None:
    prof = _short_profile()
    legacy = copy.deepcopy(prof)
    for r in legacy.ranks:
        r.shard_bytes = None
    assert sizes_past_mbs(legacy, 10_000) is None
    single = synthetic_profile("A", 3, ModelSpec("m1e9", int(1e9), 1.0 * GIB))
    single.ranks, single.world_size = single.ranks[:1], 1
    assert sizes_past_mbs(single, 10_000) is None


def test_the_planner_prices_a_grown_micro_batch_at_its_points_past_mbs() -> None:
    """Points past mbs join a rank's curve wherever a candidate's weights let it run them; with
    them a short card whose speed rises with the batch takes more of the batch than the
    constant-speed extension gives it, and the plan is predicted faster."""
    prof = _short_profile()
    weights, sizes = sizes_past_mbs(prof, 10_000)
    short = [r for r in prof.ranks if sizes[r.rank]]
    timed = copy.deepcopy(prof)
    for r in timed.ranks:
        if sizes[r.rank]:
            t1 = min(r.points, key=lambda p: p.batch).compute_s
            r.points_past_mbs = [ProfilePoint(b, t1 * (1 + 0.05 * (b - 1))) for b in sizes[r.rank]]  # steep rise
    grown = shards.reshaped(timed, weights)
    for r in short:
        assert {p.batch for p in grown.ranks[r.rank].points} >= set(sizes[r.rank])
        assert grown.ranks[r.rank].points_past_mbs == []
    again = Profile.from_dict(timed.to_dict())  # kept in the profile's JSON
    assert again.ranks[short[0].rank].points_past_mbs == timed.ranks[short[0].rank].points_past_mbs
    gbs = 4 * max(r.mbs for r in prof.ranks)
    before, after = plan(prof, gbs, 3, shards="auto"), plan(timed, gbs, 3, shards="auto")
    assert after.predicted_iteration_s < before.predicted_iteration_s
    took = lambda p: sum(p.ranks[r.rank].num_samples for r in short)  # noqa: E731
    assert took(after) > took(before)


def test_a_point_past_mbs_at_or_below_mbs_is_refused() -> None:
    prof = _short_profile().to_dict()
    prof["ranks"][0]["points_past_mbs"] = [{"batch": prof["ranks"][0]["mbs"], "compute_s": 0.1}]
    with pytest.raises(ProfileError, match="past mbs"):
        Profile.from_dict(prof)


# the toy model at ZeRO-3 on 2 ranks: a batch-1 step holds about 7.6 kB besides the shard and an
# even shard is about 7.8 kB; the short card fits a sample or two at even shards
CAPACITY = (60_000, 16_500)
FIXED_S, PER_SAMPLE_S = 2.0, 0.1  # a curve whose speed rises steeply with the batch


def curve(batch: int) -> float:
    return FIXED_S + PER_SAMPLE_S * batch


# the toy model's real compute in a micro-step on a busy machine: milliseconds, only ever added
NOISE_S = 0.2


class ScriptedTimeDevice(VirtualDevice):
    """The emulator's memory (the real tensors of each shard, so the room shard weights give is
    the runtime's own) with the scripted device's time: no padding sleep, the clock moved on by
    ``curve(batch)`` when a micro-step ends (``tests.scripted_device``)."""

    def __init__(self, name: str, capacity_bytes: int, clock: ScriptedClock) -> None:
        super().__init__(name, capacity_bytes)
        self.clock, self.pad = clock, False

    def backward_end(self, step: MicroStep) -> None:
        self.clock.advance(curve(step.batch_size))
        super().backward_end(step)


def profile_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    clock = ScriptedClock()
    device = ScriptedTimeDevice(("roomy", "short")[rank], CAPACITY[rank], clock)
    with clock.installed():
        prof = profile_rank(make_model, loss_fn, lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)), device,
                            optimizer_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                            options=ProfileOptions(zero_stage=3, repeats=1, max_batch=32, progress=False),
                            log=lambda m: None)
    return {"profile": prof.to_dict()}


@pytest.mark.multiprocess
def test_a_short_card_is_timed_past_its_mbs_at_its_curve() -> None:
    r0, r1 = spawn(profile_worker, 2, timeout_s=240, collective_timeout_s=120)
    assert r0["profile"]["ranks"] == r1["profile"]["ranks"]
    prof = Profile.from_dict(r0["profile"])
    short = prof.ranks[1]
    weights, sizes = sizes_past_mbs(prof, 32)
    assert short.points_past_mbs and [p.batch for p in short.points_past_mbs] == sizes[1]
    assert prof.ranks[0].points_past_mbs == []
    assert prof.measurement.past_mbs.shard_weights == list(weights)
    for p in short.points_past_mbs:  # measured at the batch it names, not the extension of mbs
        assert curve(p.batch) <= p.compute_s <= curve(p.batch) + NOISE_S, p
    top = short.points_past_mbs[-1].batch
    assert curve(top) + NOISE_S < top / short.mbs * curve(short.mbs)  # what the extension would have said
