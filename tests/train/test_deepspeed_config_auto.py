"""A DeepSpeed config as the Hugging Face integration writes it ("auto" for what its
TrainingArguments fill in) is read as it is: each "auto" becomes auto mode's choice, the run's
own value or Poplar's default (``poplar.train.deepspeed_auto``), said once in one log line."""

from __future__ import annotations

import copy

import pytest

from poplar.train.config import ConfigError, TrainConfig
from poplar.train.deepspeed_auto import auto_line, global_batch_source
from poplar.train.deepspeed_hints import mapped_line

MODEL = {"iterations": 2, "model": {"name": "llama-tiny", "n_layers": 1}, "data": {"seq_len": 8}}

# the shape of transformers' docs ds_config_zero2.json / ds_config_zero3.json (Trainer's DeepSpeed integration)
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3_SECTION = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                    "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}


def test_the_hf_zero2_config_reads_with_each_auto_resolved() -> None:
    raw = {**copy.deepcopy(HF_ZERO2), "poplar": MODEL}
    before = copy.deepcopy(raw)
    cfg = TrainConfig.from_dict(raw)
    assert raw == before  # the caller's dict is not changed
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.accum_steps, cfg.gradient_clipping) == (None,) * 4
    assert cfg.optimizer == "AdamW" and cfg.optimizer_params == {"lr": 1e-3}  # the rest: torch's defaults
    assert cfg.scheduler_params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 0}
    assert cfg.mixed_precision is None and cfg.bucket_size_mb == 25.0 and cfg.offload == "all"
    assert cfg.global_batch_size(4) == 32  # 8 per rank, the Trainer's default per-device batch
    schedule = cfg.lr_schedule()  # total_num_steps: the run's iterations, --iterations included
    assert schedule is not None and schedule.total_steps == 2 and schedule.max_lr == 1e-3
    cfg.iterations = 50
    assert cfg.lr_schedule().total_steps == 50 and cfg.lr_at(0) == pytest.approx(1e-3)
    assert sorted(cfg.auto_notes) == [
        "bf16.enabled", "fp16.enabled", "gradient_accumulation_steps", "gradient_clipping", "optimizer.params.betas",
        "optimizer.params.eps", "optimizer.params.lr", "optimizer.params.weight_decay",
        "scheduler.params.total_num_steps", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_num_steps", "train_batch_size", "train_micro_batch_size_per_gpu",
        "zero_optimization.reduce_bucket_size"]
    line = auto_line(cfg.auto_notes, 32, global_batch_source(None, 4, None), cfg.iterations)
    assert "\n" not in line and line.count("train_batch_size 32 (8 per rank x 4 ranks") == 1
    assert "optimizer.params.betas [0.9, 0.999] (torch's default)" in line
    assert "optimizer.params.weight_decay 0.01 (torch's default)" in line
    assert "scheduler.params.total_num_steps 50 (the run's iterations)" in line
    assert "gradient_clipping off (Poplar's default)" in line and "fp16.enabled false" in line


def test_auto_beside_numbers_and_the_zero3_section() -> None:
    raw = {**HF_ZERO2, "zero_optimization": HF_ZERO3_SECTION, "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": "auto"}}, "poplar": MODEL}
    cfg = TrainConfig.from_dict(raw)
    assert cfg.global_batch_size(3) == 4 * 2 * 3  # DeepSpeed's identity where the others are numbers
    assert cfg.zero_stage == 3 and cfg.mixed_precision is not None and cfg.bucket_size_mb == 25.0
    assert cfg.optimizer_params == {"lr": 0.05} and cfg.scheduler_params["warmup_max_lr"] == 0.05
    assert "stage3_gather_16bit_weights_on_model_save" in cfg.deepspeed_hints  # accepted, said what Poplar does
    assert "stage3_prefetch_bucket_size" in cfg.deepspeed_hints


@pytest.mark.parametrize("patch, needle", [
    ({"steps_per_print": "auto"}, '"steps_per_print" must be an integer'),
    ({"fp16": {"enabled": True, "loss_scale": "auto"}}, '"loss_scale" must be a number'),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "auto"}}, '"zero_optimization.offload_optimizer" must be'),
])
def test_auto_where_nothing_fills_it_is_an_error_naming_the_key(patch: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({**HF_ZERO2, **patch, "poplar": MODEL})
    assert needle in str(e.value)


def test_the_hf_zero3_offload_template_reads_with_parameter_offload_mapped_and_said() -> None:
    """The Hugging Face ZeRO-3 example offloads parameters and optimizer; Poplar has no parameter
    offload and maps it to the nearest thing it does: every rank's optimizer state and fp32
    master weights in host memory, with one line saying so."""
    zero3 = {**HF_ZERO3_SECTION, "offload_optimizer": {"device": "cpu", "pin_memory": True},
             "offload_param": {"device": "cpu", "pin_memory": True}}
    cfg = TrainConfig.from_dict({**HF_ZERO2, "zero_optimization": zero3, "poplar": MODEL})
    assert cfg.zero_stage == 3 and cfg.offload == "all"
    assert list(cfg.deepspeed_mapped) == ["zero_optimization.offload_param"]
    line = mapped_line(cfg.deepspeed_mapped)
    assert "\n" not in line and line.startswith("config: DeepSpeed keys mapped to the nearest thing Poplar does: "
                                                "zero_optimization.offload_param {\"device\": \"cpu\"} became every "
                                                "rank's optimizer state and fp32 master weights in host memory")
    assert "Poplar has no parameter offload" in line
    alone = {**HF_ZERO3_SECTION, "offload_param": {"device": "cpu", "buffer_size": 1e8, "max_in_cpu": 1e9}}
    assert TrainConfig.from_dict({"zero_optimization": alone}).offload == "all"  # the nearest thing, alone too
    zero3["offload_param"] = {"device": "none"}  # moves nothing: read as DeepSpeed reads it, and nothing said
    none = TrainConfig.from_dict({**HF_ZERO2, "zero_optimization": zero3, "poplar": MODEL})
    assert none.offload == "all" and none.deepspeed_mapped == {}


@pytest.mark.parametrize("zero, poplar, needle", [
    ({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "none"}},
     {}, 'offload_param" asks for parameters in host memory but "offload_optimizer" says "device": "none"'),
    ({"offload_param": {"device": "cpu"}}, {"offload": [1]}, '"zero_optimization.offload_param" and "poplar.offload"'),
    ({"offload_param": {"device": "nvme"}}, {}, '"zero_optimization.offload_param": Poplar offloads to the CPU'),
    ({"offload_param": {"device": "cpu", "ratio": 0.5}}, {}, '"zero_optimization.offload_param" has keys Poplar does '
                                                             "not know: ['ratio']"),
])
def test_parameter_offload_poplar_cannot_map_is_an_error_naming_the_fix(zero: dict, poplar: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"zero_optimization": {"stage": 3, **zero}, "poplar": {**MODEL, **poplar}})
    assert needle in str(e.value)
    param_none = {**zero, "offload_param": {"device": "none"}}  # offload_param moving nothing: no problem
    if "poplar.offload" in needle:
        assert TrainConfig.from_dict({"zero_optimization": param_none, "poplar": poplar}).offload == (1,)


def test_every_problem_of_a_config_is_said_at_once(tmp_path) -> None:
    """A bad key hides no other: the config door reads every part and names every problem, the
    missing model included, in one error."""
    import json

    raw = {**HF_ZERO2, "zero_optimization": {**HF_ZERO3_SECTION, "offload_param": {"device": "nvme"}},
           "seed": -1, "gradient_clipping": "big", "fp16": {"enabled": True, "hysteresis": 0}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(path)
    text = str(e.value)
    assert text.startswith("the config has 5 problems:\n  1. ")
    for needle in ('"hysteresis" must be an integer >= 1', '"gradient_clipping" must be a number >= 0',
                   '"seed" must be an integer >= 0', '"zero_optimization.offload_param": Poplar offloads to the CPU',
                   "the config names no model"):
        assert text.count(needle) == 1, (needle, text)
    bad_model = {"poplar": {"model": 5, "iterations": -1}}  # a model given but bad: not also "names no model"
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(bad_model, require_model=True)
    assert str(e.value).startswith("the config has 2 problems:") and "names no model" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # one problem: its own message, as before
        TrainConfig.from_dict({"seed": -1})
    assert str(e.value) == 'the config: "seed" must be an integer >= 0, got -1'


@pytest.mark.parametrize("name, local", [("gpt2", "gpt2"), ("meta-llama/Llama-3.2-1B", "Llama-3.2-1B")])
def test_a_hub_name_gets_the_way_to_a_local_hugging_face_model(name: str, local: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"poplar": {"model": name}})
    text = str(e.value)
    assert f'"poplar.model" {name!r} is not a built-in model (llama-tiny, llama-small' in text
    assert f'{{"hf_pretrained": "{local}"}}' in text and f'save_pretrained("{local}")' in text
    assert TrainConfig.from_dict({"poplar": {"model": {"name": "llama-small", "n_layers": 2}}}).model == "llama-small"
