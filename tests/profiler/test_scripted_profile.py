"""The profiler and the planner on a scripted fake device (``tests.scripted_device``): known
memory and compute in, the profile and the plan worked out by hand out.

The emulator's tests (``test_profiler.py``) check the same road against real tensors and paced
sleeps, within the machine's noise; here the numbers are exact up to the model's real compute,
which the device's scripted seconds dwarf (``NOISE_S``).
"""

from __future__ import annotations

import pytest

from poplar.process.launch import spawn
from poplar.planner import plan
from poplar.profiler.profile_run import ProfileOptions, profile_rank
from poplar.types.profiles import Profile
from poplar.workloads import get_workload
from tests.scripted_device import Script, ScriptedClock, ScriptedDevice

WORKLOAD = get_workload("token-mlp")
MB = 1_000_000
# the tiny model's real compute in a micro-step, on a busy machine, is milliseconds: far below
# the scripted seconds, and only ever added to them
NOISE_S = 0.1
# the fewest rounds: no timing past mbs, the least exposure precision, no progress bar
OPTIONS = dict(zero_stage=0, time_past_mbs=False, exposure_precision=0, progress=False)


def profile(device: ScriptedDevice, clock: ScriptedClock) -> Profile:
    with clock.installed():
        return profile_rank(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, device,
                            options=ProfileOptions(**OPTIONS), log=lambda m: None)


def assert_points_follow(script: Script, points: list) -> None:
    for p in points:
        assert script.seconds(p.batch) <= p.compute_s <= script.seconds(p.batch) + NOISE_S, (script, p)
        assert p.comm_s == 0.0  # ZeRO-0: no collective inside a micro-step


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


# a big card (mbs 8, 1 s a sample) and a small one (mbs 4, 2 s a sample), each 0.1 s a micro-step
PAIR = [Script("big", 18 * MB, 10 * MB, MB, fixed_s=0.1, per_sample_s=1.0),
        Script("small", 14 * MB + MB // 2, 10 * MB, MB, fixed_s=0.1, per_sample_s=2.0)]


def profile_worker(rank: int, world: int, scripts: list[Script]) -> dict:
    clock = ScriptedClock()
    return profile(ScriptedDevice(scripts[rank], clock), clock).to_dict()


@pytest.mark.multiprocess
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
