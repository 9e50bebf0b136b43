"""What fit measures beside the step: the lr schedule (DeepSpeed's shapes, checkpointed), periodic
evaluation, tokens/s and MFU (the formula of docs/design.md §9), peak memory, TensorBoard files."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.train import EvalOptions, FitConfig, ReportOptions, fit
from poplar.train.config import TrainConfig
from poplar.train.schedule import LRSchedule
from poplar.train.throughput import RankDevice, count_tokens, throughput
from poplar.train.peak_flops import DEVICE_TYPE_PEAK_TFLOPS, peak_flops
from poplar.emulation.presets import PRESETS
from tests.toy import SEQ, global_batch, loss_fn, make_model, plan_of

PLAN = plan_of((3, 1, 1), (2, 1, 0))  # 4 + 2 samples


def test_warmup_then_cosine_and_linear() -> None:
    cos = LRSchedule(max_lr=1.0, warmup_steps=4, total_steps=12, min_lr=0.1)
    assert [cos(k) for k in range(4)] == [0.1, 0.325, 0.55, 0.775]
    assert cos(4) == 1.0 and math.isclose(cos(8), 0.55) and cos(12) == pytest.approx(0.1) and cos(50) == cos(12)
    lin = LRSchedule(max_lr=1.0, warmup_steps=0, total_steps=10, decay="linear")
    assert [lin(k) for k in (0, 5, 10, 11)] == [1.0, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="total_steps"):
        LRSchedule(max_lr=1.0, decay="cosine")


def test_deepspeed_schedulers() -> None:
    params = {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 5, "total_num_steps": 20}
    cfg = TrainConfig.from_dict({"scheduler": {"type": "WarmupDecayLR", "params": params}})
    for k in range(25):  # DeepSpeed's WarmupDecayLR: log warmup, then linear decay back to the minimum
        gamma = math.log(k + 1) / math.log(5) if k < 5 else max(0.0, (20 - k) / 15)
        assert cfg.lr_at(k) == pytest.approx(1e-4 + gamma * 9e-4, rel=1e-12), k
    assert cfg.lr_schedule() == LRSchedule.from_deepspeed("WarmupDecayLR", params)
    warm = LRSchedule.from_deepspeed("WarmupLR", {**params, "warmup_type": "linear"})
    assert warm(0) == 1e-4 and warm(100) == 1e-3
    cosine = LRSchedule.from_deepspeed("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 2,
                                                          "warmup_type": "linear", "cos_min_ratio": 0.1}, 0.5)
    assert cosine(0) == 0.0 and cosine(1) == 0.25 and cosine(2) == 0.5
    assert cosine(7) == pytest.approx(0.5 * (0.1 + 0.9 * 0.5)) and cosine(12) == pytest.approx(0.05)


def test_mfu_is_model_flops_over_the_sum_of_every_rank_peak() -> None:
    records = [{"iteration": k, "wall_s": 0.5, "ranks": [{"tokens": 300, "peak_bytes": 10 + k},
                                                          {"tokens": 100, "peak_bytes": 7}]} for k in range(4)]
    devices = [RankDevice(0, "V100-16G", peak_flops("V100-16G"), "virtual device", None),
               RankDevice(1, "T4-16G", peak_flops("T4-16G"), "virtual device", None)]
    t = throughput(records, 8, 6e9, devices)
    assert t.tokens_per_s == 800 and t.samples_per_s == 16
    assert t.mfu == pytest.approx(6e9 * 800 / ((14.0 + 8.1) * 1e12))
    assert [r["peak_memory_bytes"] for r in t.ranks] == [13, 7]
    devices[1].peak_flops = None  # an unknown device: no MFU rather than a guess
    assert throughput(records, 8, 6e9, devices).mfu is None


def test_peaks_cover_every_preset_and_precision() -> None:
    assert set(DEVICE_TYPE_PEAK_TFLOPS) == set(PRESETS)
    assert peak_flops("A100-80G", "bf16") == 312e12 and peak_flops("T4-16G", "bf16") is None
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12 and peak_flops("cpu") is None
    assert count_tokens({"input_ids": torch.ones(2, 5), "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])}) == 7
    assert count_tokens(torch.zeros(3, 4, dtype=torch.long)) == 12


def _data() -> list[torch.Tensor]:
    return list(global_batch(0, 48))


def _engine() -> PoplarEngine:
    model = make_model(2)
    return PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), zero_stage=1, plan=PLAN,
                        loss_fn=loss_fn)


def fit_worker(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    sched = LRSchedule(max_lr=0.2, warmup_steps=2, total_steps=6, min_lr=0.01)
    data, held_out = _data()[:36], _data()[36:]
    common = {"checkpoint": f"{tmp}/ckpt", "evaluation": EvalOptions(held_out, every=2),
              "config": FitConfig(warmup=0)}
    report = ReportOptions(f"{tmp}/report", log_every=2, progress=False)
    first = fit(_engine(), data, 4, lr_schedule=sched, report=replace(report, tensorboard=True), **common)
    other = LRSchedule(max_lr=9.0, decay="constant")  # the checkpoint's schedule wins on resume
    engine = _engine()
    second = fit(engine, data, 6, lr_schedule=other, report=report, **common)
    return {"first": first.evals, "second": second.evals, "lr": engine.optimizer.param_groups[0]["lr"],
            "tps": second.tokens_per_s, "mfu": second.mfu}


@pytest.mark.multiprocess
def test_fit_evaluates_schedules_measures_and_resumes(tmp_path: Path) -> None:
    results = spawn(fit_worker, 2, (str(tmp_path),), timeout_s=120)
    sched = LRSchedule(max_lr=0.2, warmup_steps=2, total_steps=6, min_lr=0.01)
    assert [e["loss"] for e in results[0]["first"]] == [e["loss"] for e in results[1]["first"]]  # same floats
    r = results[0]
    assert [e["iteration"] for e in r["first"]] == [2, 4] and [e["iteration"] for e in r["second"]] == [6]
    assert r["first"][0]["samples"] == 12 and r["first"][0]["count"] == 12
    assert r["lr"] == sched(5) and r["mfu"] is None  # plain CPU: no peak, no MFU
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert [e["iteration"] for e in metrics["evals"]] == [2, 4, 6]
    its = metrics["iterations"]
    assert [it["lr"] for it in its] == [sched(k) for k in range(6)]
    assert all(rank["tokens"] == rank["samples"] * (SEQ + 1) for it in its for rank in it["ranks"])
    last_run = its[4:]
    assert r["tps"] == pytest.approx(sum(6 * (SEQ + 1) for _ in last_run) / sum(it["wall_s"] for it in last_run))
    assert all(rank["peak_bytes"] > 0 for it in its for rank in it["ranks"])
    assert metrics["throughput"]["formula"].startswith("MFU = flops_per_token")
    events = list((tmp_path / "report" / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    assert b"train/grad_norm" in b"".join(e.read_bytes() for e in events)  # beside train/loss
    assert all(it["grad_norm"] > 0 for it in its)
