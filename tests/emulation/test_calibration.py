"""Honest emulation: the calibration's headroom under concurrency, and the late-step count."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from poplar.zero.config import ZeroConfig
from poplar.emulation import SaturatingCurve, VirtualDevice
from poplar.emulation.calibration import (TimingJob, batches_to_time, combine, interpolate, time_scale_needed,
                                         time_trials)
from poplar.profiler.local_comm import local_engine, search_plan
from poplar.profiler.profile_run import default_optimizer
from poplar.emulation.speed_padding import LATE_BUDGET, late_fraction
from poplar.emulation.presets import get_preset
from poplar.workloads import get_workload
from poplar.zero.runtime import PlanCheck

# bounds real wall time: make test runs these files alone, after the parallel pass
pytestmark = pytest.mark.timing

WORKLOAD = get_workload("token-mlp")
MB = 10 ** 6


def test_interpolation_between_and_beyond_the_measured_batches() -> None:
    seconds = {1: 1.0, 2: 1.5, 8: 3.0}
    assert interpolate(seconds, 1) == 1.0 and interpolate(seconds, 2) == 1.5
    assert interpolate(seconds, 5) == pytest.approx(2.25)
    assert interpolate(seconds, 12) == pytest.approx(3.0 + 4 * 0.25)  # the last segment's slope
    assert batches_to_time({"a": 13, "b": 3}) == [1, 2, 3, 4, 8, 13]


def test_time_scale_keeps_the_concurrent_compute_within_the_margin() -> None:
    presets = [get_preset("A800-80G"), get_preset("V100S-32G")]
    mbs = {"fp32": {"A800-80G": 20, "V100S-32G": 9}}
    concurrent = {"fp32": {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.024, 9: 0.026, 20: 0.050}}
    for margin in (0.6, 0.3):
        scale = time_scale_needed(presets, mbs, concurrent, margin, min_step_s=0.0)
        worst = max(interpolate(concurrent["fp32"], b) / (p.time_s(b) * scale)
                    for p in presets for b in range(1, mbs["fp32"][p.name] + 1))
        assert worst == pytest.approx(margin)  # the tightest batch sits exactly at the margin
    # the fastest device's batch-1 step must last min_step_s
    scale = time_scale_needed(presets, mbs, {"fp32": {1: 1e-9}}, 0.6, min_step_s=0.004)
    assert presets[0].time_s(1) * scale == pytest.approx(0.004)


def test_combine_takes_the_slowest_ranks_median() -> None:
    everyone = [{"fp32": {1: [1.0, 5.0, 2.0], 4: [3.0, 3.0, 3.0]}},
                {"fp32": {1: [1.5, 1.5, 9.0], 4: [2.0, 4.0, 3.5]}}]
    assert combine(everyone) == {"fp32": {1: 2.0, 4: 3.5}}


def test_time_trials_measure_every_batch_and_pass_every_barrier() -> None:
    barriers = []
    job = TimingJob(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, default_optimizer, 2, 1, [None],
                    [1, 3], repeats=2)
    out = time_trials(job, 0, lambda: barriers.append(1))
    assert set(out["fp32"]) == {1, 3} and all(len(v) == 2 and min(v) > 0 for v in out["fp32"].values())
    assert len(barriers) == 3 * 2  # (repeats + warm-up) x batches

    def failing_model() -> torch.nn.Module:
        raise RuntimeError("no model")

    barriers.clear()
    bad = TimingJob(failing_model, WORKLOAD.loss_fn, WORKLOAD.sample_fn, default_optimizer, 2, 1, [None], [1, 3],
                    repeats=2)
    with pytest.raises(RuntimeError, match="no model"):
        time_trials(bad, 0, lambda: barriers.append(1))
    assert len(barriers) == 3 * 2  # a failing rank still meets the others at every barrier


def _steps(device: VirtualDevice, n: int) -> None:
    model = WORKLOAD.model_fn()
    engine = local_engine(model, default_optimizer(model), world_size=1, rank=0, zero_stage=ZeroConfig(0),
                          device=torch.device("cpu"))
    with device.attach(engine):
        for _ in range(n):
            engine.set_plan(search_plan(1, 0, 4), PlanCheck.LOCAL)
            engine.train_step(WORKLOAD.sample_fn(4), WORKLOAD.loss_fn)


def test_a_curve_faster_than_the_cpu_makes_every_step_late() -> None:
    device = VirtualDevice("too-fast", 100 * MB, time_fn=SaturatingCurve(0.0, 0.0, 1e12))
    _steps(device, 3)
    assert device.padded_steps == 3 and device.late_steps == 3 and device.late_step_fraction == 1.0
    assert device.late_step_fraction > LATE_BUDGET


def test_unpadded_steps_are_not_counted_and_bad_room_is_refused() -> None:
    device = VirtualDevice("d", 100 * MB, time_fn=SaturatingCurve(0.0, 0.0, 1e12))
    with device.unpadded():
        _steps(device, 2)
    assert device.padded_steps == 0 and device.late_step_fraction == 0.0
    assert late_fraction(0, 0) == 0.0 and late_fraction(1, 50) == 0.02
    with pytest.raises(ValueError, match="backward_room"):
        VirtualDevice("d", MB, time_fn=SaturatingCurve(0.0, 0.0, 1.0), backward_room=1.0)


def test_a_late_emulated_run_is_made_again_with_more_headroom_then_kept_as_invalid() -> None:
    from poplar.emulation.runs import until_on_time

    margins: list[float] = []

    def late_once(margin: float) -> tuple[str, float]:
        margins.append(margin)
        return f"run {len(margins)}", 0.05 if len(margins) == 1 else 0.0

    assert until_on_time("X", 3, late_once, margin=0.6) == ("run 2", 0.0, 2)
    assert margins == pytest.approx([0.6, 0.42])
    margins.clear()

    def always_late(margin: float) -> tuple[str, float]:
        margins.append(margin)
        return "late", 0.02

    assert until_on_time("X", 2, always_late, margin=0.6) == ("late", 0.02, 2)  # over budget: invalid
    assert margins == pytest.approx([0.6, 0.42])


def one_link() -> Any:
    from poplar.emulation.virtual_link import LinkSpec

    return LinkSpec.create(0.05, 1e12, 2)


def two_nodes() -> Any:
    from poplar.emulation.virtual_network import NetworkSpec
    from poplar.types.profiles import LinkSpeed
    from poplar.types.topology import Topology

    fast = LinkSpeed(bandwidth_bytes_per_s=1e12, latency_s=0.001)
    cross = LinkSpeed(bandwidth_bytes_per_s=1e12, latency_s=0.05)
    return NetworkSpec.create(Topology.of_sizes([1, 1]), (fast, fast), cross)


@pytest.mark.multiprocess
@pytest.mark.parametrize("interconnect", [one_link, two_nodes])
def test_linked_timing_runs_real_paced_collectives_and_keeps_them_out_of_the_compute(interconnect: Any) -> None:
    """With an emulated link (or network: the ranks' flat collectives cross its 50 ms cross-node
    link) the trial steps run on the job's process group, every collective paced by it: the
    compute measured stays far below the link's 50 ms per collective (the pacing is
    communication, not compute), and every rank measured every batch."""
    from poplar.emulation.calibration import spawn_timing

    link = interconnect()
    try:
        job = TimingJob(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, default_optimizer, 2, 2, [None],
                        [1, 4], repeats=1, link=link)
        seconds = spawn_timing(job, timeout_s=120)["fp32"]
    finally:
        link.remove()
    # a paced collective counted as compute would add the link's whole time: the bound is the link's
    # own, not a guess at how fast this machine computes
    assert set(seconds) == {1, 4} and all(0 < s < 0.05 for s in seconds.values()), seconds


class HostHungry(torch.nn.Module):
    """The workload's model, but a batch of more than 2 asks the host for 2**48 bytes more (a real
    allocator failure, as a model too large for the machine would meet)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = WORKLOAD.model_fn()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[0] > 2:
            torch.empty(2 ** 46, dtype=torch.float32)
        return self.inner(tokens)


def test_host_out_of_memory_names_the_model_and_what_to_change() -> None:
    from poplar.emulation.calibration import measure_pass
    from poplar.emulation.host_memory import HostMemoryError

    job = TimingJob(HostHungry, WORKLOAD.loss_fn, WORKLOAD.sample_fn, default_optimizer, 2, 1, [None], [1, 4],
                    repeats=1)
    for run in (lambda: measure_pass(job, None), lambda: time_trials(job, 0, lambda: None)):
        with pytest.raises(HostMemoryError) as info:
            run()
        message = str(info.value)
        assert "ran out of memory while calibrating the emulated cluster on the model HostHungry (" in message
        assert " parameters)" in message and "smaller model" in message and "fewer GPUs" in message
        assert "can't allocate memory" in message  # the allocator's own words, last


def test_a_checkpointed_hugging_face_model_with_eager_attention_calibrates() -> None:
    """A GPT-2 with eager attention and its key/value cache on (``config.use_cache``, as built):
    under activation checkpointing the recomputation must not append each layer's keys to the
    cache again (it did: "The size of tensor a (256) must match the size of tensor b (128)" in
    the calibration of the heaviest configuration, ZeRO-3 with checkpointing)."""
    from poplar.emulation.calibration import measure_pass
    from poplar.workloads.hf import causal_lm_loss_fn

    transformers = pytest.importorskip("transformers")

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=64, n_positions=128, n_embd=64, n_layer=2, n_head=32,
                                         attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config)

    model = gpt2()
    assert model.config.use_cache and model.config._attn_implementation == "eager"
    job = TimingJob(gpt2, causal_lm_loss_fn, lambda b: {"input_ids": torch.randint(0, 64, (b, 128))},
                    default_optimizer, 2, 3, [None], [], repeats=1, options={"activation_checkpointing": True})
    measured = measure_pass(job, None)
    assert measured.peaks[8] > measured.peaks[1] > measured.state_bytes > 0
    runtime = local_engine(model, default_optimizer(model), world_size=2, rank=0, zero_stage=ZeroConfig(3),
                           device=torch.device("cpu"), activation_checkpointing=True)
    assert runtime.activation_checkpointing.enabled and not model.config.use_cache  # turned off where checkpointed
