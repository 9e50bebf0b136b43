"""The profiler on a heterogeneous 3-rank emulated cluster (virtual devices, gloo), stages 0-3:
the devices count the real tensors of each stage, so the capacity search meets the memory the
runtime really holds.

Ground truth comes from the devices themselves: the largest fitting batch is found by trying
every batch 1, 2, 3, ... on a local engine (no collectives) until one does not fit. No time is
bounded here, so the devices run unpadded, at the machine's speed: what the profiler measures of
a device's compute and of the collectives is checked against scripted devices
(``test_scripted_profile.py``, ``test_candidate_timing.py``), the emulator's own pacing in
``tests/emulation``.
"""

from __future__ import annotations

import math

import pytest
import torch

from poplar.process.launch import spawn
from poplar.types.plans import Plan, RankPlan
from poplar.emulation import SaturatingCurve, VirtualDevice
from poplar.profiler import search_mbs, trial_budget
from poplar.profiler.capacity import CapacitySearch
from poplar.profiler.local_comm import local_engine, search_plan
from poplar.profiler.profile_run import ProfileOptions, default_optimizer, profile_rank
from poplar.types.profiles import Profile, ProfileError
from poplar.workloads import get_workload
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import PlanCheck

# the profiler's fast workload: the capacities and curves below are calibrated for it
WORKLOAD = get_workload("token-mlp")

KB = 1000
WORLD = 3
BUCKET_MB = 0.03  # a few buckets at stage 2
# t(1) ~ 20 ms: well above the real CPU compute of the tiny model (~2-4 ms with 3 ranks on 2 cores)
CURVES = [SaturatingCurve(0.016, 4.0, 2000.0), SaturatingCurve(0.016, 2.0, 1000.0), SaturatingCurve(0.018, 1.0, 500.0)]
CAPACITIES = [3600 * KB, 2000 * KB, 1100 * KB]
NAMES = ["big", "mid", "small"]


def make_devices() -> list[VirtualDevice]:
    """The three cards, unpadded: no time is bounded here, so compute runs at the machine's speed."""
    devices = [VirtualDevice(n, c, time_fn=t) for n, c, t in zip(NAMES, CAPACITIES, CURVES)]
    for device in devices:
        device.pad = False
    return devices


def true_mbs(device: VirtualDevice, rank: int, stage: int, limit: int = 400) -> int:
    """Try every batch from 1 up on a local engine until one does not fit."""
    model = WORKLOAD.model_fn()
    engine = local_engine(model, default_optimizer(model), world_size=WORLD, rank=rank, zero_stage=ZeroConfig(stage, bucket_size_mb=BUCKET_MB),
                          device=torch.device("cpu"))
    with device.attach(engine):
        search = CapacitySearch(engine, device, WORKLOAD.sample_fn, WORKLOAD.loss_fn, stage)
        for b in range(1, limit):
            if not search.trial(b):
                return b - 1
    raise AssertionError("no OOM up to the limit")


def profile_and_train(rank: int, world: int, devices_by_stage: dict[int, list[VirtualDevice]]) -> dict:
    """Per stage: profile, then train two iterations at every rank's mbs with OOMs raised for real."""
    from poplar.engine import PoplarEngine

    out = {}
    for stage, devices in devices_by_stage.items():
        device = devices[rank]
        # one measurement a batch, the fewest steady rounds and no timing past mbs: these tests check
        # capacities and what the profile records, not timing's precision (the repeats' minimum and
        # its confirmation are tested apart: tests/emulation/test_virtual_device.py)
        options = ProfileOptions(zero_stage=stage, bucket_size_mb=BUCKET_MB, repeats=1, max_extra_passes=0,
                                 exposure_precision=0, time_past_mbs=False)
        prof = profile_rank(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, device, options=options,
                            log=lambda m: None)
        mbs = [r.mbs for r in prof.ranks]
        plan = Plan([RankPlan(m, 2, 0) for m in mbs])
        model = WORKLOAD.model_fn()
        engine = PoplarEngine(model, default_optimizer(model), zero_stage=ZeroConfig(prof.zero_stage, bucket_size_mb=BUCKET_MB), plan=plan)
        device.raise_oom = True
        with device.attach(engine):
            for it in range(2):
                engine.train_step(WORKLOAD.sample_fn(2 * mbs[rank]), WORKLOAD.loss_fn)
            peak = device.peak()
        out[stage] = {"profile": prof.to_dict(), "train_peak": peak, "capacity": device.capacity_bytes}
    return out


def cluster_worker(rank: int, world: int, scenarios: list[tuple[list[VirtualDevice], int]]) -> dict:
    """One 3-rank run for every test here: this rank's true mbs at every stage (a scan on local
    engines, each rank its own, side by side), then the profile and training at every stage 0-3,
    then the scenarios (``scenario_worker``)."""
    truth = {s: true_mbs(make_devices()[rank], rank, s) for s in range(4)}
    devices = {s: make_devices() for s in range(4)}
    if rank == 1:  # stage 3: an OOM in the middle of a forward (at the 2nd gather), at a batch that does not fit
        devices[3][1].inject_oom(min_batch=truth[3] + 1, after_checks=3, where="gather")
    return {"truth": truth, "stages": profile_and_train(rank, world, devices),
            "scenarios": scenario_worker(rank, world, scenarios)}


@pytest.fixture(scope="module")
def cluster() -> tuple[dict[int, int], list[dict]]:
    """The one cluster run of this module, and the batch-1 peaks its scenarios are built from: a
    rank that fits batch 1 only from ZeRO-2 on (asked: ZeRO-0), and a rank that fits nothing even
    at ZeRO-3 (asked: ZeRO-1)."""
    peaks = {s: batch1_peak(2, s) for s in range(4)}
    escalating = make_devices()
    escalating[2] = VirtualDevice("tiny", (peaks[1] + peaks[2]) // 2, time_fn=CURVES[2])
    hopeless = make_devices()
    hopeless[1] = VirtualDevice("crumb", 50 * KB, time_fn=CURVES[1])
    escalating[2].pad = hopeless[1].pad = False
    return peaks, spawn(cluster_worker, WORLD, ([(escalating, 0), (hopeless, 1)],), timeout_s=600,
                        collective_timeout_s=200)


@pytest.fixture(scope="module")
def truth(cluster: tuple[dict[int, int], list[dict]]) -> dict[int, list[int]]:
    return {s: [r["truth"][s] for r in cluster[1]] for s in range(4)}


@pytest.fixture(scope="module")
def cluster_run(cluster: tuple[dict[int, int], list[dict]]) -> list[dict]:
    """Per rank, what it profiled (and then trained at) at every stage 0-3."""
    return [r["stages"] for r in cluster[1]]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.multiprocess
def test_profile_finds_true_mbs(stage: int, truth: dict[int, list[int]], cluster_run: list[dict]) -> None:
    expected = truth[stage]
    assert len(set(expected)) == 3 and min(expected) >= 4, expected  # heterogeneous, and a real search
    results = [r[stage] for r in cluster_run]
    prof = Profile.from_dict(results[0]["profile"])
    assert prof.zero_stage == stage and prof.measurement.escalations == []
    assert all(Profile.from_dict(r["profile"]).ranks == prof.ranks for r in results)
    for rank, rp in enumerate(prof.ranks):
        extra = prof.measurement.ranks[rank]
        assert rp.mbs == expected[rank], (rank, rp.mbs, expected)
        assert rp.trial_steps <= trial_budget(rp.mbs), (rank, rp.trial_steps, extra.trials)
        assert rp.trial_steps == len(extra.trials)
        for ev in extra.oom_events:  # every OOM released all of its memory
            assert ev.memory_after == ev.memory_before, ev
            assert ev.gathered_after == ev.gathered_before == 0, ev
        assert rp.capacity_bytes == CAPACITIES[rank] and rp.device_type == NAMES[rank]
        assert rp.bytes_per_sample and rp.base_bytes
        # timed at powers of two, midpoints and mbs
        batches = [p.batch for p in rp.points]
        assert {1, 2, 4, rp.mbs} <= set(batches) and max(batches) == rp.mbs
        assert all(p.compute_s > 0 for p in rp.points)
        # the found mbs trained without OOM under real collectives
        assert results[rank]["train_peak"] <= results[rank]["capacity"]
    comm = [p.comm_s for rp in prof.ranks for p in rp.points]
    if stage >= 2:  # collectives inside the micro-step were timed (and taken out of compute)
        assert min(comm) > 0, comm
    else:  # no collective of a micro-step (``ops`` below): a point's comm is the closing
        # reduction's issue alone (async, in the last backward; the ledger counts it where it is spent)
        assert min(comm) >= 0, comm
    assert prof.comm.links.bandwidth_bytes_per_s > 0
    # what the engine issued at this stage, and what of it compute did not hide, for the cost model
    c = prof.comm
    ops = {op for op, _ in c.micro_step}
    assert c.collectives_stage == stage and ops == {0: set(), 1: set(), 2: {"reduce_scatter"},
                                                    3: {"all_gather", "reduce_scatter"}}[stage]
    assert ("all_reduce", 8 * (7 + 3 * WORLD)) in [tuple(x) for x in c.iteration]  # the status all-reduce (7 + 3N float64)
    x = c.exposure
    assert x.micro_step_s >= 0 and x.iteration_s > 0 and x.overhead_s >= 0
    # stages 0/1: no collective of a micro-step, only the closing reduction's issue (the cost
    # model prices no micro-step exposure there: its c_m is 0)
    assert x.micro_step_s > 0 or stage < 2
    if stage == 3:
        events = prof.measurement.ranks[1].oom_events
        injected = [e for e in events if "injected" in e.message]
        assert injected and injected[0].at["where"] == "gather" and injected[0].at["gathered"] > 0
        assert injected[0].at["saved"] > 0  # mid-forward: activations of earlier blocks were alive


def scenario_worker(rank: int, world: int, scenarios: list[tuple[list[VirtualDevice], int]]) -> list[dict]:
    out = []
    for devices, stage in scenarios:
        options = ProfileOptions(zero_stage=stage, bucket_size_mb=BUCKET_MB, repeats=1, max_extra_passes=0, exposure_precision=0,
                                 measure_comm=False)
        try:
            out.append({"profile": profile_rank(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn,
                                                devices[rank], options=options, log=lambda m: None).to_dict()})
        except ProfileError as e:
            out.append({"error": str(e)})
    return out


def batch1_peak(rank: int, stage: int) -> int:
    device = VirtualDevice("probe", 2 ** 40)
    model = WORKLOAD.model_fn()
    engine = local_engine(model, default_optimizer(model), world_size=WORLD, rank=rank, zero_stage=ZeroConfig(stage, bucket_size_mb=BUCKET_MB),
                          device=torch.device("cpu"))
    with device.attach(engine):
        engine.set_plan(search_plan(WORLD, rank, 1), PlanCheck.LOCAL)
        engine.train_step(WORKLOAD.sample_fn(1), WORKLOAD.loss_fn)
        return device.last_step.peak


@pytest.fixture(scope="module")
def scenarios_run(cluster: tuple[dict[int, int], list[dict]]) -> tuple[dict[int, int], list[dict]]:
    """The two profiles of ``cluster``'s scenarios: one escalating from ZeRO-0, one hopeless."""
    peaks, results = cluster
    return peaks, [r["scenarios"] for r in results]


@pytest.mark.multiprocess
def test_escalation_picks_lowest_stage_that_fits(scenarios_run: tuple[dict[int, int], list[dict]]) -> None:
    peaks, results = scenarios_run
    assert peaks[0] > peaks[1] > peaks[2], peaks
    prof = Profile.from_dict(results[0][0]["profile"])
    assert prof.zero_stage == 2
    assert [(e.from_stage, e.to_stage, e.ranks) for e in prof.measurement.escalations] == [(0, 1, [2]), (1, 2, [2])]
    assert prof.measurement.requested_stage == 0 and prof.ranks[2].mbs >= 1
    assert all(Profile.from_dict(r[0]["profile"]).zero_stage == 2 for r in results)


@pytest.mark.multiprocess
def test_model_larger_than_every_stage_is_a_clear_error(scenarios_run: tuple[dict[int, int], list[dict]]) -> None:
    _, results = scenarios_run
    assert all("error" in r[1] for r in results)  # the same error on every rank, no hang
    message = results[0][1]["error"]
    assert "29,472 parameters" in message and "even at ZeRO-3" in message, message
    assert "rank 1 (crumb, 0.050 MB)" in message and "Smallest capacity: 0.050 MB" in message, message


def test_search_trial_budget_exhaustive() -> None:
    """The search finds mbs with at most 2 log2(mbs) + 4 trials, whatever the estimate."""
    for mbs in range(1, 600):
        for estimate in {1, 2, 3, mbs // 4, mbs // 2, mbs - 1, mbs, mbs + 1, mbs + mbs // 10, 2 * mbs, 10 * mbs}:
            if estimate < 1:
                continue
            calls = [1]  # batch 1, run before the search

            def trial(b: int) -> bool:
                calls.append(b)
                return b <= mbs
            assert search_mbs(trial, estimate) == mbs
            assert len(calls) <= trial_budget(mbs), (mbs, estimate, calls)
            if estimate == mbs:
                assert len(calls) <= math.floor(math.log2(mbs)) + 3


def test_search_stops_at_max_batch() -> None:
    assert search_mbs(lambda b: True, 5, max_batch=50) == 50


def test_bad_cluster_input_is_a_clear_error(tmp_path) -> None:
    from poplar.cli import main
    from poplar.emulation import profile_cluster
    from poplar.emulation.cluster import ClusterError
    from poplar.emulation.presets import PresetError

    broken = tmp_path / "broken.json"
    broken.write_text('{"name": "x", "devices": [{"type": "T4-16G", "count": 2}')
    with pytest.raises(ClusterError, match="not valid JSON"):
        profile_cluster(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, cluster=str(broken))
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"name": "x", "devices": [{"type": "H100-80G", "count": 2}]}')
    with pytest.raises(ClusterError, match="unknown device preset 'H100-80G'.*known presets"):
        profile_cluster(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, cluster=str(unknown))
    no_devices = tmp_path / "empty.json"
    no_devices.write_text('{"name": "x"}')
    with pytest.raises(ClusterError, match="devices"):
        profile_cluster(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, cluster=str(no_devices))
    with pytest.raises(PresetError, match="known presets"):
        VirtualDevice.from_preset("RTX 5090", 1e-3, 1.0)
    with pytest.raises(ProfileError, match="cluster= .* or devices="):
        profile_cluster(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn)
    assert main(["profile", "--cluster", str(broken), "--quiet"]) == 2  # the CLI prints the error


@pytest.mark.multiprocess
def test_cli_profile_end_to_end(tmp_path, capsys) -> None:
    """`poplar profile` on a 2-rank emulated cluster file: auto scales, progress, JSON the planner reads."""
    from poplar.cli import main
    from poplar.planner.curves import SpeedCurve

    cluster = tmp_path / "pair.json"
    cluster.write_text('{"name": "pair", "devices": [{"type": "V100-16G", "count": 1}, {"type": "RTX3060-12G", '
                       '"count": 1}]}')
    out = tmp_path / "profile.json"
    assert main(["profile", "--cluster", str(cluster), "--stage", "2", "--model", "token-mlp", "--repeats", "1",
                 "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "V100-16G" in captured.out and "RTX3060-12G" in captured.out
    prof = Profile.load(out)
    assert prof.zero_stage == 2 and [r.device_type for r in prof.ranks] == ["V100-16G", "RTX3060-12G"]
    assert prof.ranks[0].mbs > prof.ranks[1].mbs >= 4  # 16 GB vs 12 GB
    for r in prof.ranks:
        SpeedCurve.from_points(r.device_type, r.mbs, [(p.batch, p.compute_s) for p in r.points])
    assert prof.provenance.emulated.cluster == "pair" and prof.provenance.emulated.memory_scale > 0


def test_stage3_engine_cleans_up_after_an_oom_inside_a_block() -> None:
    """Without the profiler's rebuild: the engine itself must come back to its memory before."""
    model = WORKLOAD.model_fn()
    engine = local_engine(model, default_optimizer(model), world_size=WORLD, rank=1, zero_stage=ZeroConfig(3, bucket_size_mb=BUCKET_MB),
                          device=torch.device("cpu"))
    device = VirtualDevice("d", 10 ** 9)
    device.inject_oom(batch=4, after_checks=6, where="saved")  # inside blocks.0's forward
    with device.attach(engine):
        search = CapacitySearch(engine, device, WORKLOAD.sample_fn, WORKLOAD.loss_fn, 3)  # no rebuild
        assert search.trial(2)
        assert not search.trial(4)
        event = search.result.oom_events[0]
        assert event.memory_after == event.memory_before and event.gathered_after == 0
        assert search.trial(4)
