"""The `poplar train` config: DeepSpeed keys read as DeepSpeed reads them (the fp16 / bf16 sections
as a mixed-precision policy), every unknown or unsupported key refused by name, and the
learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from poplar.cli.train import describe_precision, emulated_device
from poplar.train.from_config import choose_plan
from poplar.train.config import ConfigError, TrainConfig
from poplar.types.precision import LossScaleConfig, MixedPrecision

BASE = {"train_batch_size": 32, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2 ** 22},
        "gradient_clipping": 1.0, "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "poplar": {"iterations": 7, "model": {"name": "bert-tiny", "n_layers": 2}, "data": {"seq_len": 32},
                   "checkpoint": {"dir": "c", "every": 3}}}


def test_reads_deepspeed_keys_and_the_poplar_section() -> None:
    cfg = TrainConfig.from_dict(BASE)
    assert (cfg.train_batch_size, cfg.zero_stage, cfg.bucket_size_mb, cfg.gradient_clipping) == (32, 2, 16.0, 1.0)
    assert cfg.optimizer == "AdamW" and cfg.optimizer_params == {"lr": 3e-4, "betas": (0.9, 0.95)}
    assert (cfg.iterations, cfg.model, cfg.model_overrides, cfg.seq_len) == (7, "bert-tiny", {"n_layers": 2}, 32)
    assert (cfg.checkpoint_dir, cfg.checkpoint_every, cfg.resume, cfg.checkpoint_async) == ("c", 3, True, False)
    assert cfg.global_batch_size(4) == 32
    background = {**BASE, "poplar": {**BASE["poplar"], "checkpoint": {"dir": "c", "async": True}}}
    assert TrainConfig.from_dict(background).checkpoint_async is True
    assert TrainConfig.from_dict({**BASE, "gradient_clipping": 0}).gradient_clipping is None  # 0 = off


@pytest.mark.parametrize("patch, needle", [
    ({"train_batch_sise": 8}, "['train_batch_sise']"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, '"bf16.enabled" and "fp16.enabled" are both true'),
    ({"fp16": {"enabled": True, "loss_scael": 0}}, "\"fp16\" has keys Poplar does not know: ['loss_scael']"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "['immediate_grad_update']"),
    ({"fp16": {"enabled": "yes"}}, '"fp16.enabled" must be true or false'),
    ({"bf16": {"enabled": 1}}, '"bf16.enabled" must be true or false'),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, '"loss_scale" must be a number >= 0 (0: dynamic)'),
    ({"fp16": {"enabled": True, "initial_scale_power": -2}}, '"initial_scale_power" must be an integer >= 0'),
    ({"fp16": {"enabled": True, "initial_scale_power": 200}}, '"initial_scale_power" must be at most 64'),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, '"loss_scale_window" must be an integer >= 1'),
    ({"fp16": {"enabled": True, "hysteresis": 1.5}}, '"hysteresis" must be an integer >= 1'),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, '"min_loss_scale" must be a number > 0'),
    ({"fp16": {"enabled": False, "hysteresis": 0}}, '"hysteresis" must be an integer >= 1'),  # checked, off or on
    ({"fp16": True}, '"fp16" must be a dict'),
    ({"zero_optimization": {"stage": 5}}, 'must be 0, 1, 2, 3 or "auto"'),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}}, "not to NVMe"),
    ({"optimizer": {"type": "Lamb"}}, "'Lamb' is not supported"),
    ({"scheduler": {"type": "OneCycle"}}, "'OneCycle' is not supported"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "needs \"scheduler.params.total_num_steps\""),
    ({"train_batch_size": 0}, '"train_batch_size" must be an integer >= 1'),
    ({"poplar": {"iteratons": 3}}, "['iteratons']"),
    ({"poplar": {"strategy": "fastest"}}, '"poplar.strategy" must be'),
    ({"poplar": {"checkpoint": {"every": 2}}}, "needs \"poplar.checkpoint.dir\""),
    ({"poplar": {"checkpoint": {"dir": "c", "async": "yes"}}}, '"poplar.checkpoint.async" must be true or false'),
    ({"poplar": {"shards": "proportional"}}, '"poplar.shards" must be "even", "auto" or a list'),
    ({"poplar": {"shards": [1, -1]}}, '"poplar.shards" must be'),
    ({"poplar": {"shards": [0, 0]}}, "not all 0"),
    ({"poplar": {"model": {"n_layers": 2}}}, "needs exactly one of \"name\""),
])
def test_bad_keys_are_refused_by_name(patch: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({**BASE, **patch})
    assert needle in str(e.value)


def test_shards_key() -> None:
    assert TrainConfig.from_dict(BASE).shards == "auto"  # auto mode chooses them with the batches
    assert TrainConfig.from_dict({**BASE, "poplar": {"shards": "even"}}).shards == "even"
    assert TrainConfig.from_dict({**BASE, "poplar": {"shards": [2, 1, 1]}}).shards == (2.0, 1.0, 1.0)


def test_disabled_fp16_is_accepted() -> None:
    cfg = TrainConfig.from_dict({**BASE, "fp16": {"enabled": False}, "bf16": {"enabled": False}})
    assert cfg.zero_stage == 2 and cfg.mixed_precision is None
    assert TrainConfig.from_dict(BASE).mixed_precision is None  # fp32 by default


def test_bf16_section_maps_to_a_bf16_policy() -> None:
    policy = TrainConfig.from_dict({**BASE, "bf16": {"enabled": True}, "fp16": {"enabled": False}}).mixed_precision
    assert policy == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert policy.loss_scale is None  # bf16 has fp32's range: no loss scaling


def test_fp16_section_maps_to_deepspeed_loss_scaling() -> None:
    policy = TrainConfig.from_dict({**BASE, "fp16": {"enabled": True}}).mixed_precision
    assert policy.param_dtype == torch.float16 and policy.reduce_dtype == torch.float32
    # DeepSpeed's defaults: dynamic (loss_scale 0) from 2**16, window 1000, hysteresis 2, floor 1
    assert policy.loss_scale == LossScaleConfig(initial_scale=2.0 ** 16, growth_interval=1000, hysteresis=2,
                                                min_scale=1.0, static_scale=None)
    assert policy.loss_scale.dynamic
    tuned = TrainConfig.from_dict({**BASE, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                                    "loss_scale_window": 200, "hysteresis": 4,
                                                    "min_loss_scale": 0.25}}).mixed_precision.loss_scale
    assert (tuned.initial_scale, tuned.growth_interval, tuned.hysteresis, tuned.min_scale) == (4096.0, 200, 4, 0.25)
    assert tuned.dynamic and (tuned.growth_factor, tuned.backoff) == (2.0, 0.5)  # DeepSpeed's fixed factors
    static = TrainConfig.from_dict({**BASE, "fp16": {"enabled": True, "loss_scale": 128}}).mixed_precision
    assert static.loss_scale.static_scale == 128.0 and not static.loss_scale.dynamic


def test_train_passes_the_policy_and_refuses_bf16_on_an_emulated_v100_t4_cluster() -> None:
    cfg = TrainConfig.from_dict({**BASE, "bf16": {"enabled": True}, "poplar": {"cluster": "B"}})
    with pytest.raises(ValueError, match=r"bf16 is not supported on V100-16G \(ranks 0, 1\), T4-16G.*Use fp16"):
        emulated_device(cfg)
    fp16 = TrainConfig.from_dict({**BASE, "fp16": {"enabled": True}, "poplar": {"cluster": "B"}})
    assert choose_plan(fp16, 4, torch.device("cpu"), object()) == (None, True)  # a device to profile on
    assert "dynamic loss scale from 65536" in describe_precision(fp16.mixed_precision)


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
    emulated = TrainConfig.from_dict({**BASE, "poplar": {"cluster": "B"}})
    assert choose_plan(emulated, 4, cpu, object()) == (None, True)
    with pytest.raises(ConfigError, match="only the command line"):  # from Python: give auto mode its device
        choose_plan(emulated, 4, cpu)
    with pytest.raises(ConfigError, match="poplar.cluster"):
        choose_plan(TrainConfig.from_dict(BASE), 4, cpu)
    bad = TrainConfig.from_dict({**BASE, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 3 x 4 ranks"):
        choose_plan(bad, 4, cpu)
    ds = TrainConfig.from_dict({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    assert ds.global_batch_size(4) == 24  # DeepSpeed: micro x accumulation x world


@pytest.mark.parametrize("gbs, world, near", [(15, 2, "14 or 16"), (3, 4, "4")])
def test_an_even_plan_batch_error_names_the_config_keys(gbs: int, world: int, near: str) -> None:
    cfg = TrainConfig.from_dict({**BASE, "train_batch_size": gbs, "train_micro_batch_size_per_gpu": 2})
    with pytest.raises(ConfigError) as e:
        choose_plan(cfg, world, torch.device("cpu"))
    text = str(e.value)
    assert text.startswith(f'"train_batch_size" {gbs} does not divide among {world} ranks') and f"(e.g. {near})" in text
    assert '"train_micro_batch_size_per_gpu" 2' in text and "global_batch_size" not in text and "world_size" not in text


def test_the_idle_ranks_warning_speaks_of_the_config() -> None:
    """Auto mode's warning names AutoOptions(require_all_ranks=True), which a config cannot set;
    built from a config (``CONFIG_REMEDIES``), it names the train_batch_size that gives every rank
    samples."""
    from poplar.auto import AutoOptions
    from poplar.auto.mode import idle_ranks_line
    from poplar.planner import plan as make_plan
    from poplar.planner.planning import batch_using_every_rank
    from poplar.train.config_terms import CONFIG_REMEDIES
    from tests.planner.test_idle_ranks import PROFILE

    plan = make_plan(PROFILE, 16, 2)
    config = idle_ranks_line(PROFILE, plan, [2, 3], AutoOptions(remedies=CONFIG_REMEDIES))
    python = idle_ranks_line(PROFILE, plan, [2, 3], AutoOptions())
    found = batch_using_every_rank(PROFILE, 16, 2)
    assert "get 0 samples at global batch 16" in config and f'"train_batch_size": {found} would give' in config
    assert "AutoOptions" not in config and "require_all_ranks" not in config, config
    assert f"a global batch of {found} would give" in python and "AutoOptions(require_all_ranks=True)" in python
