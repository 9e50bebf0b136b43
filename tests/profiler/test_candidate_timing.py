"""Auto mode's timing of candidates on 2 gloo ranks of scripted devices (``tests.scripted_device``):
a probe is one round at each rank's mbs (no steady rounds); the probed configuration's full
timing keeps the probe's point (``Reuse.SAME_CONFIG``) and times only the sparse grid's other
batches; another stage with the same compute keeps those points and times its own mbs again
(``Reuse.SAME_COMPUTE``). Every point measured is the script's compute, up to the tiny model's
real compute (``NOISE_S``); a point kept is the very number measured before."""

from __future__ import annotations

import pytest

from poplar.process.launch import spawn
from poplar.profiler.configurations import CandidateProfiler, Reuse, uncovered
from poplar.profiler.exposure import MAX_STEADY_ROUNDS, STEADY_ROUNDS, ExposureRounds
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, RankPhases
from poplar.profiler.timing import Confirmation, TimingGrid, timing_batches
from poplar.types.configuration import Configuration
from poplar.workloads import get_workload
from tests.scripted_device import Script, ScriptedClock, ScriptedDevice

WORKLOAD = get_workload("token-mlp")
MB = 1_000_000
# a big card and a small one whose speed rises with the batch (a fixed cost per micro-step), and
# whose activations take 0.25 MB a sample above 1 MB of states; ZeRO-1 shards nothing these
# devices count, so both stages hold the same batches
SCRIPTS = [Script("big", MB + 6 * MB // 2, MB, MB // 4, fixed_s=1.0, per_sample_s=0.25),
           Script("small", MB + 5 * MB // 4 + 1000, MB, MB // 4, fixed_s=1.0, per_sample_s=0.5)]
# the tiny model's real compute in a micro-step on a busy machine: milliseconds, only ever added
NOISE_S = 0.1


def worker(rank: int, world: int, scripts: list[Script]) -> dict:
    clock = ScriptedClock()
    device = ScriptedDevice(scripts[rank], clock)
    job = ProfileJob(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn,
                     options=ProfileOptions(repeats=1, bucket_size_mb=0.03, progress=False, exposure_precision=0))
    prof = CandidateProfiler(RankPhases(job, device, log=lambda m: None))
    with clock.installed():
        caps = prof.capacities([Configuration(0), Configuration(1)])
        curve = dict(confirm=Confirmation.CURVE)
        probe = prof.time(caps[0], sizes=[[m] for m in caps[0].mbs], exposure=ExposureRounds.GRID, **curve)
        probe_rounds = prof.rounds
        full = prof.time(caps[0], reuse=probe, how=Reuse.SAME_CONFIG, grid=TimingGrid.SPARSE, **curve)
        full_rounds = prof.rounds - probe_rounds
        other = prof.time(caps[1], reuse=full, how=Reuse.SAME_COMPUTE, grid=TimingGrid.SPARSE, **curve)
    return {"mbs": [c.mbs for c in caps], "probe": probe.to_dict(), "full": full.to_dict(), "other": other.to_dict(),
            "rounds": (probe_rounds, full_rounds, prof.rounds - probe_rounds - full_rounds)}


@pytest.fixture(scope="module")
def run() -> list[dict]:
    return spawn(worker, 2, (SCRIPTS,), timeout_s=300, collective_timeout_s=120)


def scripted(measured: float, rank: int, batch: int) -> bool:
    """A point is the script's compute at its batch, plus at most the model's real compute."""
    return SCRIPTS[rank].seconds(batch) <= measured <= SCRIPTS[rank].seconds(batch) + NOISE_S


def points(profile: dict, rank: int) -> dict[int, float]:
    return {p["batch"]: p["compute_s"] for p in profile["ranks"][rank]["points"]}


@pytest.mark.multiprocess
def test_the_probe_is_one_round_at_each_ranks_mbs(run: list[dict]) -> None:
    mbs0 = run[0]["mbs"][0]
    assert mbs0 == [s.mbs for s in SCRIPTS] == [12, 5]  # enough batches for a grid
    assert run[0]["rounds"][0] == 1
    for r in range(2):
        assert list(points(run[0]["probe"], r)) == [mbs0[r]]
        assert scripted(points(run[0]["probe"], r)[mbs0[r]], r, mbs0[r])


@pytest.mark.multiprocess
def test_the_full_timing_keeps_the_probe_and_times_the_rest_of_the_sparse_grid(run: list[dict]) -> None:
    mbs0 = run[0]["mbs"][0]
    for r in range(2):
        full, probe = points(run[0]["full"], r), points(run[0]["probe"], r)
        assert sorted(full) == timing_batches(mbs0[r], TimingGrid.SPARSE)
        assert full[mbs0[r]] == probe[mbs0[r]]  # kept, not measured again
        for b, t in full.items():  # the script's compute, measured or kept
            assert scripted(t, r, b), (r, b, t)
    # every other grid batch is new: one pass (the scripted compute keeps the curve's shape, so no
    # batch is measured again); then the steady rounds: balanced, led by each of the two types,
    # and by a little where the batches allow one, each until its exposure is known well enough
    grid = max(len(uncovered(timing_batches(m, TimingGrid.SPARSE), {m}, m)) for m in mbs0)
    assert grid + 3 * STEADY_ROUNDS <= run[0]["rounds"][1] <= grid + 5 * MAX_STEADY_ROUNDS


@pytest.mark.multiprocess
def test_a_same_compute_stage_keeps_the_points_and_times_its_own_mbs(run: list[dict]) -> None:
    mbs0, mbs1 = run[0]["mbs"]
    assert mbs1 == mbs0  # the scripted states are the same at both stages
    for r in range(2):
        other, full = points(run[0]["other"], r), points(run[0]["full"], r)
        assert mbs1[r] in other and scripted(other[mbs1[r]], r, mbs1[r]), (r, other)
        kept = {b: t for b, t in other.items() if b in full and b != mbs1[r]}
        assert kept and all(t == full[b] for b, t in kept.items())
