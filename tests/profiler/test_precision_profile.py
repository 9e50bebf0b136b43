"""The profiler under a mixed-precision policy: virtual devices pad to their preset's curve at the
precision they compute in, the capacity search measures the policy's memory (fp16 fits larger
micro-batches on cluster B), profiles record their precision, and bf16 on devices without it
(V100, T4) is one clear error everywhere, before anything runs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from poplar.comm import Communicator
from poplar.process.launch import spawn
from poplar.emulation import PresetCurve, VirtualDevice
from poplar.emulation import Scales, calibrate, cluster_device, cluster_devices, emulate_cluster, profile_cluster
from poplar.profiler.local_comm import local_engine, search_plan
from poplar.profiler.precision import agree_precision_support, precision_meta, profile_precision
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer, profile_rank, search_capacity
from poplar.emulation.cluster import ClusterSpec
from poplar.types.precision import MixedPrecision, Precision, resolve_precision
from poplar.emulation.presets import PresetError, get_preset
from poplar.emulation.synthetic import synthetic_profile
from poplar.types.profiles import Profile, ProfileError
from poplar.workloads import get_workload
from poplar.zero.runtime import ZeroRuntime
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import PlanCheck
from tests.timing_reference import latest_wake_up

WORKLOAD = get_workload("token-mlp")
PAIR = ClusterSpec("pair", [{"type": "V100-16G", "count": 1}, {"type": "T4-16G", "count": 1}])


def _never(*args: object) -> None:
    raise AssertionError("nothing may run before the precision check")


# ---------------------------------------------------------------------- devices and curves
def test_device_pads_to_its_preset_curve_at_its_precision() -> None:
    preset = get_preset("V100-16G")
    fp16 = VirtualDevice.from_preset("V100-16G", 1e-3, 2.0, precision="fp16")
    plain = VirtualDevice.from_preset("V100-16G", 1e-3, 2.0)
    assert fp16.precision is Precision.FP16 and fp16.fixed_precision is Precision.FP16
    assert plain.precision is Precision.FP32 and plain.fixed_precision is None  # follows its runtime
    for b in (1, 4, 16):
        assert fp16.time_s(b) == pytest.approx(2.0 * preset.time_s(b, precision="fp16"))
        assert plain.time_s(b) == pytest.approx(2.0 * preset.time_s(b))
        assert fp16.time_s(b) < plain.time_s(b)
    assert fp16.describe()["precision"] == "fp16" and fp16.capacity_bytes == plain.capacity_bytes
    assert PresetCurve("A100-80G", 1.0).at(Precision.BF16)(8) == pytest.approx(
        get_preset("A100-80G").time_s(8, precision="bf16"))


def test_bf16_devices_without_bf16_are_refused() -> None:
    with pytest.raises(PresetError, match=r"T4-16G: bf16 is not supported on T4-16G.*Use fp16"):
        VirtualDevice.from_preset("T4-16G", 1e-3, 1.0, precision="bf16")
    assert VirtualDevice.from_preset("A100-40G", 1e-3, 1.0, precision="bf16").supports(Precision.BF16)
    assert not VirtualDevice.from_preset("V100-16G", 1e-3, 1.0).supports(Precision.BF16)
    assert VirtualDevice("custom", 10 ** 6).supports(Precision.BF16)  # no preset: no known limit
    with pytest.raises(ProfileError, match=r"V100-16G \(ranks 0, 1\), T4-16G \(ranks 2, 3\)"):
        cluster_devices("B", 1e-3, 1.0, "bf16")
    assert [d.precision for d in cluster_devices("B", 1e-3, 1.0, "fp16")] == [Precision.FP16] * 4


def test_emulation_refuses_bf16_on_cluster_b_before_running_anything() -> None:
    job = ProfileJob(_never, _never, _never, _never, ProfileOptions(mixed_precision=MixedPrecision(torch.bfloat16)))
    for scales in (Scales(), Scales(1e-3, 1.0)):
        with pytest.raises(ProfileError, match=r"cluster 'B': bf16 is not supported on V100-16G.*Use fp16 instead"):
            emulate_cluster("B", job, scales)
    with pytest.raises(ProfileError, match="bf16 is not supported on V100-16G"):
        calibrate(job, "B")
    with pytest.raises(ProfileError, match=r"T4-16G \(rank 1\)"):
        profile_cluster(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, cluster=PAIR,
                        options=ProfileOptions(mixed_precision="bf16", progress=False))
    with pytest.raises(ValueError, match="'bf16', 'fp16'"):
        ProfileOptions(mixed_precision="fp8")


def bf16_worker(rank: int, world: int, devices: list[VirtualDevice]) -> str:
    options = ProfileOptions(mixed_precision="bf16", repeats=1, measure_comm=False)
    try:
        profile_rank(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, devices[rank], options=options,
                     log=lambda m: None)
    except ProfileError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_profile_rank_refuses_bf16_on_every_rank() -> None:
    devices = [VirtualDevice.from_preset(t, 1e-3, 1.0) for t in ("A100-80G", "T4-16G", "V100-16G")]
    messages = spawn(bf16_worker, 3, (devices,), timeout_s=120)
    assert len(set(messages)) == 1, messages  # the same error on every rank, no rank left waiting
    message = messages[0]
    assert "bf16 is not supported on T4-16G (rank 1), V100-16G (rank 2)" in message and "A100" not in message
    assert "Use fp16 instead" in message


def test_precision_agreement_in_one_process() -> None:
    comm = Communicator()
    assert agree_precision_support(comm, None, None, "x") is None
    assert agree_precision_support(comm, VirtualDevice.from_preset("T4-16G", 1e-3, 1.0), "fp16",
                                   "x").precision is Precision.FP16
    with pytest.raises(ProfileError, match=r"x: bf16 is not supported on T4-16G \(rank 0\)"):
        agree_precision_support(comm, VirtualDevice.from_preset("T4-16G", 1e-3, 1.0), "bf16", "x")
    assert precision_meta(None) == {"precision": "fp32", "mixed_precision": None}
    assert precision_meta(MixedPrecision(torch.float16))["mixed_precision"]["loss_scale"]["initial_scale"] == 2 ** 16
    assert profile_precision(synthetic_profile("B", 1)) is Precision.FP32
    assert profile_precision(replace(synthetic_profile("B", 1), precision="bf16")) is Precision.BF16


def test_auto_mode_refuses_a_profile_of_another_precision(tmp_path: Path) -> None:
    from poplar.auto import AutoOptions, auto_plan
    from poplar.emulation.synthetic import profile_from_presets

    path = tmp_path / "profile.json"
    profile_from_presets([get_preset("A100-80G")], 0).save(path)  # no precision recorded: fp32
    model = WORKLOAD.model_fn()
    args = dict(global_batch_size=8, zero_stage=0, loss_fn=WORKLOAD.loss_fn,
                options=AutoOptions(profile=str(path), progress=False))
    assert auto_plan(Communicator(), model, default_optimizer(model), **args).plan.global_batch_size == 8
    with pytest.raises(ProfileError, match="measured at fp32 but this run computes in fp16"):
        auto_plan(Communicator(), model, default_optimizer(model), mixed_precision="fp16", **args)
    with pytest.raises(ProfileError, match="mixed_precision='fp8'"):
        auto_plan(Communicator(), model, default_optimizer(model), mixed_precision="fp8", **args)


# ---------------------------------------------------------------------- under the runtime's policy
def _engine(stage: int, world: int, rank: int, precision: str | None) -> ZeroRuntime:
    model = WORKLOAD.model_fn()
    return local_engine(model, default_optimizer(model), world_size=world, rank=rank, zero_stage=ZeroConfig(stage, bucket_size_mb=0.03),
                        device=torch.device("cpu"), mixed_precision=resolve_precision(precision))


def test_device_follows_the_runtimes_precision() -> None:
    engine = _engine(0, 1, 0, "fp16")
    device = VirtualDevice.from_preset("T4-16G", 1.0, 1.0)
    with device.attach(engine):
        assert device.precision is Precision.FP16
        assert device.time_s(4) == pytest.approx(get_preset("T4-16G").time_s(4, precision="fp16"))
    assert device.precision is Precision.FP32
    with pytest.raises(ValueError, match="emulates bf16 but the runtime computes in fp16"):
        with VirtualDevice.from_preset("A100-80G", 1.0, 1.0, precision="bf16").attach(engine):
            pass
    with pytest.raises(PresetError, match="bf16 is not supported on T4-16G"):
        with device.attach(_engine(0, 1, 0, "bf16")):
            pass


def test_memory_is_counted_at_the_policys_dtypes() -> None:
    """Model states include the fp32 master; activations per sample shrink to about half."""
    slopes, states = {}, {}
    for precision in (None, "fp16"):
        engine = _engine(0, 1, 0, precision)
        device = VirtualDevice("d", 2 ** 40)
        with device.attach(engine):
            after = {}
            for b in (1, 2, 4, 8):
                engine.set_plan(search_plan(1, 0, b), PlanCheck.LOCAL)
                engine.train_step(WORKLOAD.sample_fn(b), WORKLOAD.loss_fn)
                after[b] = device.last_step.after_forward - device.last_step.before_forward
            report = engine.memory_report()
            states[precision] = device.static_bytes()
            assert states[precision] == sum(v for k, v in report.items() if k not in ("comm_buffers",
                                                                                     "gathered_params"))
        slopes[precision] = (after[8] - after[1]) / 7
    assert 0.4 < slopes["fp16"] / slopes[None] < 0.75, slopes  # fp16 activations
    assert states["fp16"] > states[None], states  # fp32 master + fp16 copy


def _mbs(devices: list[VirtualDevice], stage: int, precision: str | None) -> list[int]:
    options = ProfileOptions(zero_stage=stage, mixed_precision=precision)
    return [search_capacity(ProfileJob(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, default_optimizer, options), d,
                            world_size=len(devices), rank=r, stage=stage, log=lambda m: None).mbs
            for r, d in enumerate(devices)]


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.multiprocess
def test_fp16_fits_larger_micro_batches_on_cluster_b(stage: int) -> None:
    job = ProfileJob(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, default_optimizer,
                     ProfileOptions(zero_stage=stage, mixed_precision="fp16"))
    cal = calibrate(job, "B")
    fp32 = ProfileJob(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, default_optimizer,
                      ProfileOptions(zero_stage=stage))
    fp32_cal = calibrate(fp32, "B", scales=Scales(time=1.0))
    assert cal.memory_scale == pytest.approx(fp32_cal.memory_scale, rel=1e-6)  # the same GPUs at every precision
    mbs32 = _mbs(cluster_devices("B", cal.memory_scale, cal.time_scale), stage, None)
    mbs16 = _mbs(cluster_devices("B", cal.memory_scale, cal.time_scale, "fp16"), stage, "fp16")
    print(f"cluster B ZeRO-{stage}: mbs per rank fp32 {mbs32}, fp16 {mbs16}")
    assert all(b > a for a, b in zip(mbs32, mbs16)), (mbs32, mbs16)
    assert cal.predicted_mbs["T4-16G"] > fp32_cal.predicted_mbs["T4-16G"]


@pytest.mark.multiprocess
@pytest.mark.timing  # bounds measured compute by the curve: run alone, not beside another worker
def test_profile_records_its_precision_and_measures_the_fp16_curve() -> None:
    late = latest_wake_up(0.01)  # bare sleeps in this process before and after the profile: the reference
    prof = profile_cluster(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, cluster=PAIR,
                           options=ProfileOptions(zero_stage=1, mixed_precision="fp16", repeats=2, progress=False,
                                                          exposure_precision=0))
    late = max(late, latest_wake_up(0.01))
    emulated = prof.provenance.emulated
    assert prof.precision == "fp16" and prof.mixed_precision["param_dtype"] == "fp16"
    assert emulated.calibration["precision"] == "fp16"
    devices = cluster_devices(PAIR, emulated.memory_scale, emulated.time_scale, "fp16")
    for rp, dev in zip(prof.ranks, devices):  # the fp16 curves, ~3x faster than fp32 on V100 / T4
        for p in rp.points:  # (bench/profile_accuracy.py holds the 5 % target; a shared machine adds noise)
            curve_s = dev.time_s(p.batch)  # within 10 %; above, also by the latest wake-up of the reference
            assert 0.9 * curve_s <= p.compute_s <= 1.1 * curve_s + late, (rp.device_type, p, late)
    assert Profile.from_dict(prof.to_dict()).precision == "fp16"


def auto_fp16_rank(rank: int, world: int) -> dict:
    """Auto mode's profile-and-plan under fp16 on an emulated pair, then training on the plan with
    this rank's device attached (what PoplarEngine does with its own ``mixed_precision``)."""
    from poplar.auto import AutoOptions, auto_plan
    from poplar.engine import PoplarEngine

    model = WORKLOAD.model_fn()
    optimizer = default_optimizer(model)
    result = auto_plan(Communicator(), model, optimizer, global_batch_size=24, zero_stage=1, loss_fn=WORKLOAD.loss_fn,
                       options=AutoOptions(profile_data=WORKLOAD.sample_fn, device=cluster_device(PAIR), repeats=1, exposure_precision=0,
                                           progress=False), mixed_precision="fp16")
    # the engine runs the configuration auto mode chose: with checkpointing off and on allowed, a
    # loaded machine's timings can make the checkpointed one (a larger mbs) the faster
    engine = PoplarEngine(model, optimizer, plan=result.plan, zero_stage=result.plan.zero_stage,
                          mixed_precision="fp16", activation_checkpointing=result.activation_checkpointing)
    first = result.plan.sample_offsets()[rank]
    # this rank's share, in its own storage (as a data loader's batch: a view would pin all 24 samples)
    batch = WORKLOAD.sample_fn(24)[first:first + result.plan.ranks[rank].num_samples].clone()
    with result.device.attach(engine):
        losses = [engine.train_step(batch, WORKLOAD.loss_fn) for _ in range(2)]
        precision = str(result.device.precision)
    return {"profile": result.profile.to_dict(), "precision": precision, "losses": losses}


@pytest.mark.multiprocess
def test_auto_mode_profiles_and_plans_under_fp16() -> None:
    results = spawn(auto_fp16_rank, 2, timeout_s=300, collective_timeout_s=120)
    prof = Profile.from_dict(results[0]["profile"])
    assert prof.precision == "fp16" and prof.provenance.emulated is not None
    assert [r["precision"] for r in results] == ["fp16", "fp16"]  # the emulated devices run the fp16 curves
    assert results[0]["losses"] == results[1]["losses"] and all(x == x for x in results[0]["losses"])
