"""A DeepSpeed config as DeepSpeed's docs give it runs unchanged: its performance hints are
accepted and named once in the log; a typo is still an error, with the key it is closest to; a
stage given is binding, "auto" (or none) lets auto mode choose."""

from __future__ import annotations

import pytest

from poplar.train.config import ConfigError, TrainConfig
from poplar.train.deepspeed_hints import ZERO_HINTS, hint_line

# DeepSpeed's ZeRO-2 example (deepspeed.ai, "ZeRO" tutorial / config-json docs), with the
# batch, optimizer and fp16 sections its docs put beside it
DEEPSPEED_ZERO2 = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
    },
}


def test_deepspeeds_zero2_config_reads_unchanged_and_names_each_hint() -> None:
    cfg = TrainConfig.from_dict(DEEPSPEED_ZERO2)
    assert cfg.zero_stage == 2 and cfg.bucket_size_mb == pytest.approx(5e8 * 4 / 2 ** 20)  # elements of fp32
    assert sorted(cfg.deepspeed_hints) == ["allgather_bucket_size", "allgather_partitions", "contiguous_gradients",
                                           "overlap_comm", "reduce_scatter"]
    line = hint_line(cfg.deepspeed_hints)
    assert "\n" not in line and all(f"{k}: {ZERO_HINTS[k]}" in line for k in cfg.deepspeed_hints)
    assert TrainConfig.from_dict({"train_batch_size": 8}).deepspeed_hints == {}


@pytest.mark.parametrize("patch, needle", [
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, 'did you mean "overlap_comm" for "overlap_com"?'),
    ({"zero_optimization": {"stag": 2}}, 'did you mean "stage" for "stag"?'),
    ({"train_batch_sise": 8}, 'did you mean "train_batch_size" for "train_batch_sise"?'),
    ({"poplar": {"iteratons": 3}}, 'did you mean "iterations" for "iteratons"?'),
    ({"fp16": {"enabled": True, "loss_scael": 0}}, 'did you mean "loss_scale" for "loss_scael"?'),
])
def test_a_typo_is_an_error_that_says_what_was_meant(patch: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({**DEEPSPEED_ZERO2, **patch})
    assert needle in str(e.value)


def test_a_key_like_nothing_known_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({**DEEPSPEED_ZERO2, "zzzz": 1})
    assert "['zzzz']" in str(e.value) and "did you mean" not in str(e.value)


def test_stage_and_checkpointing_given_or_auto() -> None:
    assert TrainConfig.from_dict(DEEPSPEED_ZERO2).zero_stage == 2
    assert TrainConfig.from_dict({"train_batch_size": 8}).zero_stage is None  # not given: auto mode chooses
    auto = TrainConfig.from_dict({"train_batch_size": 8, "zero_optimization": {"stage": "auto"},
                                  "poplar": {"activation_checkpointing": "auto"}})
    assert auto.zero_stage is None and auto.activation_checkpointing is None
    off = TrainConfig.from_dict({"train_batch_size": 8, "poplar": {"activation_checkpointing": False}})
    assert off.activation_checkpointing is False  # binding: passed to the engine as off
    with pytest.raises(ConfigError, match='"auto"'):
        TrainConfig.from_dict({"train_batch_size": 8, "zero_optimization": {"stage": "fast"}})


def test_a_config_without_a_model_is_an_error_naming_poplar_model(tmp_path) -> None:
    """DeepSpeed's own config has no "poplar" section: there is no default model to train."""
    import json

    import torch

    from poplar.train.run_parts import build_parts

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEEPSPEED_ZERO2))
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(path)
    for form in ('"poplar"', '"model"', '"llama-small"', '"hf_config"', '"hf_pretrained"', '"package.module:function"'):
        assert form in str(e.value)
    with pytest.raises(ConfigError, match="names no model"):  # the Python road too
        build_parts(TrainConfig.from_dict({**DEEPSPEED_ZERO2, "poplar": {"iterations": 3}}), torch.device("cpu"))
    named = TrainConfig.from_dict({**DEEPSPEED_ZERO2, "poplar": {"model": "llama-tiny"}})
    named.check_model()
    assert named.model == "llama-tiny"
