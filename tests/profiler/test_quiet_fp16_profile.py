"""Profiling prints no training messages: an fp16 trial step that overflows is skipped by the
loss scaler as in training, but counted in the profile's notes instead of logged as a skipped
optimizer step; training on the same model and loss still warns of each skip. The emulated
cluster's calibration, which auto mode runs before profiling on one, is as quiet."""

from __future__ import annotations

import logging

import torch

from poplar.emulation import SaturatingCurve, VirtualDevice
from poplar.emulation.calibration import TimingJob, measure_pass
from poplar.profiler.profile_run import ProfileOptions, default_optimizer, profile_rank
from poplar.types.plans import Plan
from poplar.workloads import get_workload
from poplar.zero.runtime import ZeroRuntime
from poplar.types.precision import MixedPrecision
from tests.log_lines import Lines

WORKLOAD = get_workload("token-mlp")


def overflowing_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The workload's loss times 2000: at fp16's initial loss scale (65536) its gradients overflow,
    after the scale has backed off a few times they do not."""
    return WORKLOAD.loss_fn(model, batch) * 2000.0


def test_fp16_profiling_counts_overflows_and_training_reports_them() -> None:
    torch.set_num_threads(1)
    lines, logger = Lines(), logging.getLogger("poplar")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    try:
        device = VirtualDevice("X", 2 ** 30, time_fn=SaturatingCurve(0.002, 4.0, 2000.0))
        profile = profile_rank(WORKLOAD.model_fn, overflowing_loss, WORKLOAD.sample_fn, device,
                               options=ProfileOptions(mixed_precision="fp16", repeats=1, max_batch=8, progress=False,
                                                      measure_comm=False), log=lambda m: None)
        skipped = [line for line in lines.lines if "skipped" in line]
        assert skipped == [], skipped
        notes = profile.measurement.ranks[0]
        assert profile.measurement.overflowing_trials == notes.overflowing_trials > 0, notes

        model = WORKLOAD.model_fn()
        runtime = ZeroRuntime(model, default_optimizer(model), plan=Plan.even(1, 4, 4),
                              mixed_precision=MixedPrecision(param_dtype=torch.float16))
        runtime.train_step(WORKLOAD.sample_fn(4), overflowing_loss)
        assert runtime.skipped_steps == 1
        assert any("optimizer step was skipped" in line and "loss scale 65536" in line for line in lines.lines), \
            lines.lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def test_fp16_calibration_of_an_emulated_cluster_logs_no_skipped_steps() -> None:
    torch.set_num_threads(1)
    lines, logger = Lines(), logging.getLogger("poplar")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    fp16 = MixedPrecision(param_dtype=torch.float16)
    try:
        job = TimingJob(WORKLOAD.model_fn, overflowing_loss, WORKLOAD.sample_fn, default_optimizer, 2, 2, [fp16],
                        [1, 4], repeats=1)
        measure_pass(job, fp16)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert [line for line in lines.lines if "skipped" in line] == [], lines.lines
