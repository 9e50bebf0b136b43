"""``PoplarTrainer`` reads a DeepSpeed config's ZeRO section: its stage and bucket size,
``zero_hpz_partition_size`` (secondary shards on a fixed plan), ``zero_quantized_weights`` /
``zero_quantized_gradients`` (the plan's quantized collectives; auto mode's ``compression``) and
``poplar.allow_lossy``; bad values are the config door's errors. Built in one process: the engine
is made when training starts, so the trainer's options are what is checked here."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import json  # noqa: E402

from poplar.auto import AutoOptions  # noqa: E402
from poplar.integrations.hf import PoplarTrainer  # noqa: E402
from poplar.train.config import ConfigError  # noqa: E402
from poplar.types.compression import CommPolicy  # noqa: E402
from poplar.types.plans import Offload  # noqa: E402
from poplar.zero.config import ZeroConfig  # noqa: E402
from tests import toy  # noqa: E402
from tests.integrations import hf_jobs as jobs  # noqa: E402

ROWS = ((2, 1, 0), (2, 1, 0), (2, 1, 0), (2, 1, 0))


def trainer(tmp_path, **kwargs) -> PoplarTrainer:
    return PoplarTrainer(model=jobs.tiny_gpt2(), args=jobs.arguments(str(tmp_path), 1),
                         train_dataset=jobs.LabelledTokens(), **kwargs)


def test_a_fixed_plan_gets_hpz_secondary_shards_and_quantized_collectives(tmp_path) -> None:
    ds = {"train_batch_size": "auto", "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": 2 ** 20, "zero_hpz_partition_size": 2,
                                "zero_quantized_weights": True, "zero_quantized_gradients": True},
          "poplar": {"topology": [[0, 1], [2, 3]]}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    got = trainer(tmp_path, plan=toy.plan_of(*ROWS), deepspeed=str(path)).poplar
    assert got.plan.hierarchical and got.plan.secondary_shards
    assert got.plan.compression == CommPolicy(weights="int8", gradients="int8")
    assert isinstance(got.zero_stage, ZeroConfig) and got.zero_stage.stage == 3
    assert got.zero_stage.bucket_size_mb == pytest.approx(4.0)  # 2**20 fp32 elements
    # without the keys the plan is exact and flat, as before
    plain = trainer(tmp_path, plan=toy.plan_of(*ROWS), deepspeed={"zero_optimization": {"stage": 3}}).poplar
    assert not plain.plan.compression.lossy and not plain.plan.secondary_shards
    assert trainer(tmp_path, plan=toy.plan_of(*ROWS)).poplar.zero_stage == 0  # no config: stage 0, as before


def test_auto_mode_gets_the_policy_and_allow_lossy(tmp_path) -> None:
    got = trainer(tmp_path, auto=AutoOptions(progress=False),
                  deepspeed={"zero_optimization": {"zero_quantized_gradients": True},
                             "poplar": {"allow_lossy": True}}).poplar
    assert got.auto.compression == CommPolicy(gradients="int8") and got.auto.allow_lossy
    assert got.zero_stage.stage == "auto"
    lossy = trainer(tmp_path, deepspeed={"zero_optimization": {"stage": 2}, "poplar": {"allow_lossy": True}}).poplar
    assert lossy.auto.allow_lossy and lossy.auto.compression is None and lossy.zero_stage.stage == 2


def test_offload_and_hpz_reach_the_plan_and_auto_mode_with_the_mapping_said(tmp_path) -> None:
    """The Hugging Face ZeRO-3 offload template: parameter offload becomes Poplar's optimizer
    offload on every rank (said once), and hpZ is a setting auto mode's planner keeps."""
    import logging

    from tests.log_lines import Lines

    ds = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, "offload_param": {"device": "cpu"},
                                "stage3_prefetch_bucket_size": "auto"},
          "poplar": {"topology": [[0, 1], [2, 3]]}}
    fixed = trainer(tmp_path, plan=toy.plan_of(*ROWS), deepspeed=ds).poplar
    assert fixed.plan.offloads == (Offload.OPTIMIZER,) * 4 and fixed.plan.secondary_shards
    lines, logger = Lines(), logging.getLogger("poplar")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    try:
        auto = trainer(tmp_path, auto=AutoOptions(progress=False), deepspeed=ds).poplar.auto
    finally:
        logger.removeHandler(lines)
        logger.level = level
    assert auto.collectives == "secondary_shards" and set(auto.offload) == {Offload.OPTIMIZER}
    said = [line for line in lines.lines if "offload_param" in line]
    assert len(said) == 1 and "Poplar has no parameter offload" in said[0], said
    plain = trainer(tmp_path, auto=AutoOptions(progress=False), deepspeed={"zero_optimization": {"stage": 3}}).poplar
    assert plain.auto.collectives == "auto" and plain.auto.offload == "none"  # nothing asked: the planner chooses


@pytest.mark.parametrize("ds, kwargs, message", [
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": "yes"}}, {}, "zero_quantized_weights\" must be true"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}, "poplar": {"topology": [[0, 1], [2, 3]]}}, {},
     "give the size of every node"),
    ({"zero_optimization": {"stage": 2}}, {"zero_stage": 3}, "give the stage in one place"),
    ({"zero_optimization": {"stage": 3}, "poplar": {"allow_lossy": True}}, {}, "which no planner chooses"),
])
def test_bad_deepspeed_values_name_the_key(tmp_path, ds: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        trainer(tmp_path, plan=toy.plan_of(*ROWS), deepspeed=ds, **kwargs)


def test_the_training_arguments_deepspeed_is_refused_with_the_way_to_give_it(tmp_path) -> None:
    args = jobs.arguments(str(tmp_path), 1)
    args.deepspeed = {"zero_optimization": {"stage": 3}}  # as TrainingArguments(deepspeed=...) keeps it
    with pytest.raises(ValueError, match=r"give the config to PoplarTrainer\(deepspeed=...\) instead"):
        PoplarTrainer(model=jobs.tiny_gpt2(), args=args, train_dataset=jobs.LabelledTokens(), plan=toy.plan_of(*ROWS))
