"""Checkpoints across precision policies: weights and optimizer state are fp32 under every policy,
so a run resumes under another one (fp32 -> bf16 -> fp32) with the state it saved, and an fp16
run continues its loss scale and skipped-step count."""

from __future__ import annotations

import pytest

import math
from pathlib import Path

import torch

from poplar.checkpoint import load_checkpoint, read_index, save_checkpoint
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.workloads.models import create_model, llama_loss_fn
from tests.checkpoint.test_checkpoint import PLAN2, SMALL, loader, train


def engine_under(stage: int, policy: str | None) -> PoplarEngine:
    model = create_model("llama-tiny", seed=0, **SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return PoplarEngine(model, opt, zero_stage=stage, plan=PLAN2, mixed_precision=policy, loss_fn=llama_loss_fn)


def across_policies(rank: int, world: int, directory: str, stage: int) -> dict:
    out = {}
    first = engine_under(stage, None)
    data = loader(PLAN2, rank)
    train(first, data, 2)
    saved = first.full_state_dict()
    save_checkpoint(first, Path(directory) / "fp32")
    second = engine_under(stage, "bf16")
    load_checkpoint(second, Path(directory) / "fp32")
    loaded = second.full_state_dict()
    out["fp32_to_bf16_equal"] = all(torch.equal(saved[k], loaded[k]) for k in saved)
    out["dtypes"] = sorted({str(v.dtype) for v in loaded.values()})
    out["bf16_losses"] = train(second, data, 2)
    saved_bf16 = second.full_state_dict()
    save_checkpoint(second, Path(directory) / "bf16")
    third = engine_under(stage, None)
    load_checkpoint(third, Path(directory) / "bf16")
    back = third.full_state_dict()
    out["bf16_to_fp32_equal"] = all(torch.equal(saved_bf16[k], back[k]) for k in saved_bf16)
    out["iteration"] = third.iteration
    return out


@pytest.mark.multiprocess
def test_resume_across_policies(tmp_path: Path) -> None:
    for stage in (1, 3):
        results = spawn(across_policies, 2, (str(tmp_path / f"s{stage}"), stage), timeout_s=240)
        for r in results:
            assert r["fp32_to_bf16_equal"] and r["bf16_to_fp32_equal"], (stage, r)
            assert r["dtypes"] == ["torch.float32"], r
            assert all(math.isfinite(x) for x in r["bf16_losses"]) and r["iteration"] == 4, r
        assert read_index(tmp_path / f"s{stage}" / "bf16")["precision"]["policy"]["param_dtype"] == "bf16"


def fp16_scale_kept(rank: int, world: int, directory: str) -> dict:
    engine = engine_under(2, "fp16")
    data = loader(PLAN2, rank)
    def overflowing(module, tokens):
        return llama_loss_fn(module, tokens) * float("inf")

    for _, batch in zip(range(2), data):  # two overflows in a row back the scale off (hysteresis 2)
        engine.train_step(batch, overflowing)
    train(engine, data, 1)
    scale, skipped = engine.loss_scale, engine.skipped_steps
    save_checkpoint(engine, directory)
    again = engine_under(2, "fp16")
    load_checkpoint(again, directory)
    fresh = engine_under(2, "fp16")
    return {"saved": (scale, skipped), "loaded": (again.loss_scale, again.skipped_steps),
            "fresh": fresh.loss_scale}


@pytest.mark.multiprocess
def test_fp16_loss_scale_and_skips_are_resumed(tmp_path: Path) -> None:
    for r in spawn(fp16_scale_kept, 2, (str(tmp_path / "c"),), timeout_s=240):
        assert r["loaded"] == r["saved"] and r["saved"][0] < 2.0 ** 16 and r["saved"][1] >= 2, r
        assert r["fresh"] == 2.0 ** 16, r
