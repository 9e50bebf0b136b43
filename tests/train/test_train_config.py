"""The `poplar train` config: DeepSpeed keys read as DeepSpeed reads them, every unknown or
unsupported key refused by name, and the learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from poplar.cli.train import choose_plan
from poplar.train.config import ConfigError, TrainConfig

BASE = {"train_batch_size": 32, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2 ** 22},
        "gradient_clipping": 1.0, "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "poplar": {"iterations": 7, "model": {"name": "bert-tiny", "n_layers": 2}, "data": {"seq_len": 32},
                   "checkpoint": {"dir": "c", "every": 3}}}


def test_reads_deepspeed_keys_and_the_poplar_section() -> None:
    cfg = TrainConfig.from_dict(BASE)
    assert (cfg.train_batch_size, cfg.zero_stage, cfg.bucket_size_mb, cfg.gradient_clipping) == (32, 2, 4.0, 1.0)
    assert cfg.optimizer == "AdamW" and cfg.optimizer_params == {"lr": 3e-4, "betas": (0.9, 0.95)}
    assert (cfg.iterations, cfg.model, cfg.model_overrides, cfg.seq_len) == (7, "bert-tiny", {"n_layers": 2}, 32)
    assert (cfg.checkpoint_dir, cfg.checkpoint_every, cfg.resume) == ("c", 3, True)
    assert cfg.global_batch_size(4) == 32
    assert TrainConfig.from_dict({**BASE, "gradient_clipping": 0}).gradient_clipping is None  # 0 = off


@pytest.mark.parametrize("patch, needle", [
    ({"train_batch_sise": 8}, "['train_batch_sise']"),
    ({"fp16": {"enabled": True}}, "Poplar trains in fp32"),
    ({"zero_optimization": {"stage": 5}}, "must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 1, "overlap_comm": True}}, "['overlap_comm']"),
    ({"optimizer": {"type": "Lamb"}}, "'Lamb' is not supported"),
    ({"scheduler": {"type": "OneCycle"}}, "'OneCycle' is not supported"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "needs \"scheduler.params.total_num_steps\""),
    ({"train_batch_size": 0}, '"train_batch_size" must be an integer >= 1'),
    ({"poplar": {"iteratons": 3}}, "['iteratons']"),
    ({"poplar": {"strategy": "fastest"}}, '"poplar.strategy" must be'),
    ({"poplar": {"checkpoint": {"every": 2}}}, "needs \"poplar.checkpoint.dir\""),
    ({"poplar": {"model": {"n_layers": 2}}}, "needs \"name\""),
])
def test_bad_keys_are_refused_by_name(patch: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({**BASE, **patch})
    assert needle in str(e.value)


def test_disabled_fp16_is_accepted() -> None:
    assert TrainConfig.from_dict({**BASE, "fp16": {"enabled": False}}).zero_stage == 2


def test_schedules_follow_deepspeed() -> None:
    warm = TrainConfig.from_dict({**BASE, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 10}}})
    assert warm.lr_at(0) == 0.0 and math.isclose(warm.lr_at(4), math.log(5) / math.log(10))
    assert warm.lr_at(10) == 1.0 and warm.lr_at(1000) == 1.0
    decay = TrainConfig.from_dict({**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_max_lr": 1.0, "warmup_num_steps": 10, "warmup_type": "linear", "total_num_steps": 30}}})
    assert decay.lr_at(5) == 0.5 and decay.lr_at(10) == 1.0 and decay.lr_at(20) == 0.5 and decay.lr_at(40) == 0.0
    assert TrainConfig.from_dict(BASE).lr_at(3) is None


def test_plan_choice_on_cpu() -> None:
    cpu = torch.device("cpu")
    even = TrainConfig.from_dict({**BASE, "train_micro_batch_size_per_gpu": 3})
    plan, auto = choose_plan(even, 4, cpu)
    assert not auto and [r.num_samples for r in plan.ranks] == [8] * 4 and plan.ranks[0].micro_batch_size == 3
    assert choose_plan(TrainConfig.from_dict({**BASE, "poplar": {"cluster": "B"}}), 4, cpu) == (None, True)
    with pytest.raises(ConfigError, match="poplar.cluster"):
        choose_plan(TrainConfig.from_dict(BASE), 4, cpu)
    bad = TrainConfig.from_dict({**BASE, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 3 x 4 ranks"):
        choose_plan(bad, 4, cpu)
    ds = TrainConfig.from_dict({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    assert ds.global_batch_size(4) == 24  # DeepSpeed: micro x accumulation x world
