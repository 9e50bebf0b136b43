"""The profiler and the planner on a scripted fake device (``tests.scripted_device``): known
memory, compute and collective seconds in; the largest batch each device holds, the compute with
the communication taken out, the recovery from out-of-memory errors, and the plan worked out by
hand out.

The numbers are exact up to the model's real compute and the real collectives, which the
scripted seconds dwarf (``NOISE_S``): a point that kept a collective's scripted second, or lost
a micro-step's scripted compute, is off by far more than the noise. ``test_profiler.py`` runs
the same road on the emulator's devices (real tensors counted) without bounding any time.
"""

from __future__ import annotations

import pytest

from poplar.planner import plan
from poplar.process.launch import spawn
from poplar.profiler import trial_budget
from poplar.profiler.profile_run import ProfileOptions, profile_rank
from poplar.types.profiles import Profile
from poplar.types.topology import Link
from poplar.workloads import get_workload
from tests.scripted_device import LinkScript, Script, ScriptedClock, ScriptedDevice, ScriptedLink

WORKLOAD = get_workload("token-mlp")
MB = 1_000_000
# the tiny model's real compute in a micro-step, on a busy machine, is milliseconds: far below
# the scripted seconds, and only ever added to them
NOISE_S = 0.1
# the fewest rounds: no timing past mbs, the least exposure precision, no progress bar
OPTIONS = dict(zero_stage=0, time_past_mbs=False, exposure_precision=0, progress=False)


def profile(device: ScriptedDevice, clock: ScriptedClock, **options: object) -> Profile:
    with clock.installed():
        return profile_rank(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, device,
                            options=ProfileOptions(**{**OPTIONS, **options}), log=lambda m: None)


def assert_points_follow(script: Script, points: list) -> None:
    for p in points:
        assert script.seconds(p.batch) <= p.compute_s <= script.seconds(p.batch) + NOISE_S, (script, p)
        # ZeRO-0: nothing blocks inside a micro-step; the closing all-reduce is issued in the
        # last backward (async), and only its issue is timed there
        assert 0.0 <= p.comm_s < 0.01


def test_one_rank_profile_measures_the_script() -> None:
    # 12 samples of 0.25 MB fit above 10 MB of states, the 13th does not (by 1 kB)
    script = Script("card", capacity_bytes=10 * MB + 13 * MB // 4 - 1000, base_bytes=10 * MB, bytes_per_sample=MB // 4,
                    fixed_s=2.0, per_sample_s=0.5)
    clock = ScriptedClock()
    device = ScriptedDevice(script, clock)
    prof = profile(device, clock)
    (rank,) = prof.ranks
    assert script.mbs == rank.mbs == 12
    # Algorithm 1: batch 1 gives the estimate (13 MB - 10 MB) / 0.25 MB = 12 exactly; powers of
    # two up to it, the estimate, and one past it, which does not fit
    assert device.started[:6] == [1, 2, 4, 8, 12, 13] and device.steps[:5] == [1, 2, 4, 8, 12]
    assert rank.trial_steps == 6
    assert rank.device_type == "card" and rank.capacity_bytes == script.capacity_bytes
    assert rank.base_bytes == 10 * MB and rank.bytes_per_sample == MB // 4
    # timed at powers of two, the points halfway between them, and mbs
    assert [p.batch for p in rank.points] == [1, 2, 3, 4, 6, 8, 12]
    assert_points_follow(script, rank.points)
    assert prof.zero_stage == 0 and prof.world_size == 1


def test_out_of_memory_in_the_search_is_recovered_from_and_the_largest_batch_found() -> None:
    # activations grow with the square of the batch: batch 1's estimate, (capacity - states) /
    # its bytes, is 12 where only 6 fit; the trials past 6 run out of memory and the search
    # must come back from each to the memory it had, and end at the largest batch that fits
    script = Script("square", capacity_bytes=10 * MB + 3 * MB, base_bytes=10 * MB, bytes_per_sample=MB // 5,
                    fixed_s=2.0, per_sample_s=0.5, bytes_per_sample_squared=MB // 20)
    assert script.mbs == 6
    clock = ScriptedClock()
    device = ScriptedDevice(script, clock)
    prof = profile(device, clock)
    (rank,) = prof.ranks
    assert rank.mbs == 6
    failed = [b for b in device.started if b not in device.steps]
    assert failed and all(b > 6 for b in failed), device.started  # it met the errors, and only past mbs
    events = prof.measurement.ranks[0].oom_events
    assert sorted(e.batch for e in events) == sorted(failed)
    for event in events:  # every error gave all of its memory back
        assert event.memory_after == event.memory_before == 10 * MB, event
    assert rank.trial_steps <= trial_budget(6)
    assert 6 in device.steps[:rank.trial_steps]  # the answer was a trial that ran to its end
    assert [p.batch for p in rank.points] == [1, 2, 3, 4, 6]
    assert_points_follow(script, rank.points)


# a big card (mbs 8, 1 s a sample) and a small one (mbs 4, 2 s a sample), each 0.1 s a micro-step
PAIR = [Script("big", 18 * MB, 10 * MB, MB, fixed_s=0.1, per_sample_s=1.0),
        Script("small", 14 * MB + MB // 2, 10 * MB, MB, fixed_s=0.1, per_sample_s=2.0)]


def profile_worker(rank: int, world: int, scripts: list[Script]) -> dict:
    clock = ScriptedClock()
    return profile(ScriptedDevice(scripts[rank], clock), clock).to_dict()


# timing: with two ranks the closing all-reduce is a real gloo collective, and its issue, the
# only part a ZeRO-0 point may time, is bounded in real milliseconds (``assert_points_follow``).
# A blocking all-reduce takes only a few more, so the bound cannot widen; the load of a parallel
# pass can push an issue alone past it, so the test runs alone
@pytest.mark.multiprocess
@pytest.mark.timing
def test_two_rank_profile_gives_the_plan_worked_out_by_hand() -> None:
    prof = Profile.from_dict(spawn(profile_worker, 2, (PAIR,), timeout_s=300)[0])
    assert [r.device_type for r in prof.ranks] == ["big", "small"] and [r.mbs for r in prof.ranks] == [8, 4]
    for script, rank in zip(PAIR, prof.ranks):
        assert [p.batch for p in rank.points] == {8: [1, 2, 3, 4, 6, 8], 4: [1, 2, 3, 4]}[rank.mbs]
        assert_points_follow(script, rank.points)
    # 24 samples: big takes two micro-steps of 8 (2 x 8.1 s), small two of 4 (2 x 8.1 s): both
    # 16.2 s. Moving a sample either way makes one rank slower: big 8 + 8 + 1 = 17.3 s, or small
    # 4 + 4 + 1 = 18.3 s. The even split (12 each) leaves small at 3 x 8.1 = 24.3 s.
    best = plan(prof, 24)
    assert [(r.micro_batch_size, r.accum_steps, r.last_batch_size) for r in best.ranks] == [(8, 2, 0), (4, 2, 0)]
    for r in best.ranks:
        assert 16.2 <= r.predicted_compute_s <= 16.2 + 2 * NOISE_S, r
    assert 16.2 <= best.predicted_iteration_s <= 16.2 + 3 * NOISE_S, best.predicted_iteration_s
    even = plan(prof, 24, strategy="even")
    assert [r.num_samples for r in even.ranks] == [12, 12]
    assert 24.3 <= even.predicted_iteration_s <= 24.3 + 4 * NOISE_S, even.predicted_iteration_s


# three cards at ZeRO-3 (a gather of each block in forward and backward, a reduce-scatter of each
# bucket): every collective crosses a scripted link of 1 s + 1 MB/s, more than any real gloo
# collective here, so a micro-step's wall time is its scripted compute plus several seconds of
# collectives, which the profiler must take out of compute and report as communication
TRIO = [Script("big", 14 * MB, 10 * MB, MB // 4, fixed_s=1.0, per_sample_s=0.5),
        Script("mid", 12 * MB + MB // 2 + 1000, 10 * MB, MB // 4, fixed_s=1.0, per_sample_s=1.0),
        Script("small", 11 * MB + MB // 4 + 100, 10 * MB, MB // 4, fixed_s=1.0, per_sample_s=2.0,
               bytes_per_sample_squared=20_000)]
LINK = LinkScript(bandwidth_bytes_per_s=1e6, latency_s=1.0)
# the real part of a micro-step here: its compute and about ten real gloo collectives on a busy
# machine (tens of ms); a point that kept the collectives' scripted seconds is off by over 10 s
TRIO_NOISE_S = 0.5


def comm_worker(rank: int, world: int, scripts: list[Script]) -> dict:
    clock = ScriptedClock()
    device = ScriptedDevice(scripts[rank], clock, link=ScriptedLink(clock, {Link.FLAT: LINK}))
    return profile(device, clock, zero_stage=3, bucket_size_mb=0.03).to_dict()


@pytest.mark.multiprocess
def test_communication_is_taken_out_of_compute_at_zero3() -> None:
    profiles = spawn(comm_worker, 3, (TRIO,), timeout_s=300, collective_timeout_s=120)
    prof = Profile.from_dict(profiles[0])
    assert all(Profile.from_dict(p).ranks == prof.ranks for p in profiles[1:])
    assert prof.zero_stage == 3 and prof.measurement.escalations == []
    assert [r.mbs for r in prof.ranks] == [s.mbs for s in TRIO] == [16, 10, 3]
    ops = {op for op, _ in prof.comm.micro_step}
    assert ops == {"all_gather", "reduce_scatter"}, prof.comm.micro_step
    # the scripted seconds of the collectives inside one micro-step: the same at every batch
    scripted_comm_s = sum(LINK.seconds(op, nbytes, 3) for op, nbytes in prof.comm.micro_step)
    assert scripted_comm_s > 5.0
    for script, rank in zip(TRIO, prof.ranks):
        assert rank.trial_steps <= trial_budget(rank.mbs)
        assert [p.batch for p in rank.points][-1] == rank.mbs
        for p in rank.points:
            # compute is the script's alone: without the subtraction it would be seconds over
            assert script.seconds(p.batch) <= p.compute_s <= script.seconds(p.batch) + TRIO_NOISE_S, (script, p)
            assert scripted_comm_s <= p.comm_s <= scripted_comm_s + TRIO_NOISE_S, (p, scripted_comm_s)
    events = prof.measurement.ranks[2].oom_events  # the small card's estimate overshot
    assert events and all(e.memory_after == e.memory_before for e in events), events
