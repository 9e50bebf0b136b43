"""Auto mode's timing of candidates on a 2-rank emulated cluster (virtual devices, gloo): a probe
is one round at each rank's mbs (no steady rounds); the probed configuration's full timing keeps the probe's point
(``Reuse.SAME_CONFIG``) and times only the sparse grid's other batches; another stage with the
same compute keeps those points and times its own mbs again (``Reuse.SAME_COMPUTE``). Every
point is the device's padded curve."""

from __future__ import annotations

import pytest

from poplar.process.launch import spawn
from poplar.emulation import SaturatingCurve, VirtualDevice
from poplar.profiler.configurations import CandidateProfiler, Reuse, uncovered
from poplar.profiler.exposure import MAX_STEADY_ROUNDS, STEADY_ROUNDS, ExposureRounds
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, RankPhases
from poplar.profiler.timing import Confirmation, TimingGrid, timing_batches
from poplar.types.configuration import Configuration
from poplar.workloads import get_workload
from tests.timing_reference import latest_wake_up

WORKLOAD = get_workload("token-mlp")
KB = 1000
# t(1) ~ 20 ms: well above the real CPU compute of the tiny model
CURVES = [SaturatingCurve(0.016, 4.0, 2000.0), SaturatingCurve(0.018, 1.0, 500.0)]
CAPACITIES = [3600 * KB, 1500 * KB]


def worker(rank: int, world: int, devices: list[VirtualDevice]) -> dict:
    import torch
    torch.set_num_threads(1)
    device = devices[rank]
    job = ProfileJob(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn,
                     options=ProfileOptions(repeats=1, bucket_size_mb=0.03, progress=False, exposure_precision=0))
    prof = CandidateProfiler(RankPhases(job, device, log=lambda m: None))
    late = latest_wake_up(CURVES[rank](1))  # bare sleeps as long as a step, before and after: the reference
    caps = prof.capacities([Configuration(0), Configuration(1)])
    curve = dict(confirm=Confirmation.CURVE)
    probe = prof.time(caps[0], sizes=[[m] for m in caps[0].mbs], exposure=ExposureRounds.GRID, **curve)
    probe_rounds = prof.rounds
    full = prof.time(caps[0], reuse=probe, how=Reuse.SAME_CONFIG, grid=TimingGrid.SPARSE, **curve)
    full_rounds = prof.rounds - probe_rounds
    other = prof.time(caps[1], reuse=full, how=Reuse.SAME_COMPUTE, grid=TimingGrid.SPARSE, **curve)
    return {"mbs": [c.mbs for c in caps], "probe": probe.to_dict(), "full": full.to_dict(), "other": other.to_dict(),
            "rounds": (probe_rounds, full_rounds, prof.rounds - probe_rounds - full_rounds),
            "late_s": max(late, latest_wake_up(CURVES[rank](1)))}


@pytest.fixture(scope="module")
def run() -> list[dict]:
    devices = [VirtualDevice(f"d{i}", c, time_fn=t) for i, (c, t) in enumerate(zip(CAPACITIES, CURVES))]
    return spawn(worker, 2, (devices,), timeout_s=300, collective_timeout_s=120)


def on_curve(measured: float, curve_s: float, late_s: float) -> bool:
    """A point is the device's curve: a busy machine only delays a wake-up (CI saw +9 % on one
    single-round point), so the bound is tight below and loose above, and looser by the latest
    wake-up of a bare sleep on any rank before and after its timing (``late_s``)."""
    return 0.95 * curve_s <= measured <= 1.25 * curve_s + late_s


def late_s(run: list[dict]) -> float:
    return max(r["late_s"] for r in run)


def points(profile: dict, rank: int) -> dict[int, float]:
    return {p["batch"]: p["compute_s"] for p in profile["ranks"][rank]["points"]}


@pytest.mark.multiprocess
def test_the_probe_is_one_round_at_each_ranks_mbs(run: list[dict]) -> None:
    mbs0 = run[0]["mbs"][0]
    assert min(mbs0) >= 4, mbs0  # enough batches for a grid
    assert run[0]["rounds"][0] == 1
    for r in range(2):
        assert list(points(run[0]["probe"], r)) == [mbs0[r]]


@pytest.mark.multiprocess
def test_the_full_timing_keeps_the_probe_and_times_the_rest_of_the_sparse_grid(run: list[dict]) -> None:
    mbs0 = run[0]["mbs"][0]
    for r in range(2):
        full, probe = points(run[0]["full"], r), points(run[0]["probe"], r)
        assert sorted(full) == timing_batches(mbs0[r], TimingGrid.SPARSE)
        assert full[mbs0[r]] == probe[mbs0[r]]  # kept, not measured again
        for b, t in full.items():  # the device's curve, measured or kept
            assert on_curve(t, CURVES[r](b), late_s(run)), (r, b, t, late_s(run))
    # every other grid batch is new: one pass, and at most 3 more passes over the batches a
    # disturbed measurement broke the shape of (on a loaded machine); then the steady rounds:
    # balanced, led by each of the two types, and by a little where the batches allow one, each
    # until its exposure is known well enough
    grid = max(len(uncovered(timing_batches(m, TimingGrid.SPARSE), {m}, m)) for m in mbs0)
    assert grid + 3 * STEADY_ROUNDS <= run[0]["rounds"][1] <= 4 * grid + 5 * MAX_STEADY_ROUNDS


@pytest.mark.multiprocess
def test_a_same_compute_stage_keeps_the_points_and_times_its_own_mbs(run: list[dict]) -> None:
    mbs0, mbs1 = run[0]["mbs"]
    assert all(b >= a for a, b in zip(mbs0, mbs1))  # stage 1 shards optimizer state: at least as much room
    for r in range(2):
        other, full = points(run[0]["other"], r), points(run[0]["full"], r)
        assert mbs1[r] in other and on_curve(other[mbs1[r]], CURVES[r](mbs1[r]), late_s(run)), (r, other)
        kept = {b: t for b, t in other.items() if b in full and b != mbs1[r]}
        assert kept and all(t == full[b] for b, t in kept.items())
