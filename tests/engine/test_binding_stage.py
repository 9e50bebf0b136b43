"""The stage means what it says: auto mode runs at a stage given (never another), names the
stage that would fit when batch 1 does not fit the one given, and chooses among every stage only
for "auto". Three emulated ranks whose smallest fits batch 1 only from ZeRO-2 on
(tests/profiler/test_profiler.py's devices)."""

from __future__ import annotations

from typing import Any

import pytest

from poplar.auto import AutoOptions, auto_plan
from poplar.comm import Communicator
from poplar.process.launch import spawn
from poplar.emulation import VirtualDevice
from poplar.profiler.profile_run import ProfileOptions, default_optimizer, profile_rank
from poplar.types.profiles import ProfileError
from poplar.zero.config import ZeroConfig
from tests.profiler.test_profiler import BUCKET_MB, CURVES, WORKLOAD, WORLD, batch1_peak, make_devices


def binding_rank(rank: int, world: int, capacity: int) -> dict[str, Any]:
    devices = make_devices()
    devices[2] = VirtualDevice("tiny", capacity, time_fn=CURVES[2])  # batch 1 fits from ZeRO-2 on
    device = devices[rank]
    out: dict[str, Any] = {}
    for stage in (2, 0, "auto"):
        model = WORKLOAD.model_fn()
        options = AutoOptions(profile_data=WORKLOAD.sample_fn, device=device, repeats=1, exposure_precision=0, progress=False,
                              max_batch=64)
        try:
            result = auto_plan(Communicator(), model, default_optimizer(model), global_batch_size=12,
                               zero_stage=ZeroConfig(stage, bucket_size_mb=BUCKET_MB), loss_fn=WORKLOAD.loss_fn,
                               options=options, activation_checkpointing=False)
            out[str(stage)] = {"stage": result.plan.zero_stage,
                               "considered": sorted({r.stage for r in result.candidates or []}),
                               "checkpointing": sorted({r.checkpointing for r in result.candidates or []})}
        except ProfileError as e:
            out[str(stage)] = {"error": str(e)}
    # the profiler alone, escalation off (the paper's rule, a stage given): the error names the fit
    options = ProfileOptions(zero_stage=0, escalate=False, bucket_size_mb=BUCKET_MB, repeats=1, measure_comm=False)
    try:
        profile_rank(WORKLOAD.model_fn, WORKLOAD.loss_fn, WORKLOAD.sample_fn, device, options=options,
                     log=lambda m: None)
        out["profiler"] = {"error": None}
    except ProfileError as e:
        out["profiler"] = {"error": str(e)}
    return out


@pytest.mark.multiprocess
def test_a_given_stage_is_binding_and_auto_chooses() -> None:
    peaks = {s: batch1_peak(2, s) for s in range(4)}
    assert peaks[0] > peaks[1] > peaks[2], peaks
    results = spawn(binding_rank, WORLD, ((peaks[1] + peaks[2]) // 2,), timeout_s=300, collective_timeout_s=120)
    assert all(r == results[0] for r in results), results  # every rank the same verdicts
    r = results[0]
    assert r["2"] == {"stage": 2, "considered": [2], "checkpointing": [False]}  # stage 2 stays at stage 2
    assert "ZeRO-0" in r["0"]["error"] and "rank 2 (tiny)" in r["0"]["error"], r["0"]
    assert "ZeRO-2 would fit" in r["0"]["error"] and '"auto"' in r["0"]["error"], r["0"]
    assert r["auto"]["considered"] == [0, 1, 2, 3] and r["auto"]["stage"] >= 2, r["auto"]
    assert r["auto"]["checkpointing"] == [False], r["auto"]  # a setting given is binding too
    assert "at ZeRO-0, the stage given" in r["profiler"]["error"], r["profiler"]
    assert "ZeRO-2 fits batch 1 on every rank" in r["profiler"]["error"], r["profiler"]


def test_auto_needs_auto_mode() -> None:
    import torch

    from poplar.engine import PoplarEngine
    from tests.toy import make_model, plan_of

    model = make_model(0)
    for kwargs in ({"zero_stage": "auto"}, {"activation_checkpointing": "auto"}):
        with pytest.raises(ValueError, match="ask auto mode to choose: give global_batch_size"):
            PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan_of((2, 1, 0)), **kwargs)
    model = make_model(0)
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan_of((2, 1, 0)))
    assert engine.zero_stage == 0  # with a plan, no stage given is DeepSpeed's default
    engine.close()
