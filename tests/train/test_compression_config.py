"""The doors of quantized collectives in the JSON config: DeepSpeed's ``zero_quantized_weights`` /
``zero_quantized_gradients`` (true: int8 across nodes) become the plan's ``CommPolicy`` on a fixed
plan and ``AutoOptions.compression`` in auto mode; ``poplar.allow_lossy`` becomes
``AutoOptions.allow_lossy``; a bad value or a stage without those collectives is an error naming the
key and the fix."""

from __future__ import annotations

import json

import pytest

from poplar.train.config import ConfigError, TrainConfig
from poplar.train.from_config import with_collectives
from poplar.types.compression import CommPolicy
from poplar.types.plans import Plan
from tests import toy


def config(zero: dict, poplar: dict | None = None) -> TrainConfig:
    return TrainConfig.from_dict({"zero_optimization": zero, **({"poplar": poplar} if poplar else {})})


@pytest.mark.parametrize("zero, want", [
    ({"stage": 3, "zero_quantized_weights": True}, CommPolicy(weights="int8")),
    ({"stage": 2, "zero_quantized_gradients": True}, CommPolicy(gradients="int8")),
    ({"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True},
     CommPolicy(weights="int8", gradients="int8")),
    ({"stage": 1, "zero_quantized_weights": False, "zero_quantized_gradients": False}, CommPolicy()),
    ({"zero_quantized_weights": True}, CommPolicy(weights="int8")),  # no stage: auto mode chooses stage 3
    ({"stage": 3}, None),
])
def test_deepspeed_quantized_keys_map_to_a_comm_policy(zero: dict, want: CommPolicy | None) -> None:
    cfg = config(zero)
    assert cfg.compression == want and not cfg.allow_lossy


@pytest.mark.parametrize("zero, poplar, message", [
    ({"stage": 3, "zero_quantized_weights": "int8"}, None, r'"zero_optimization.zero_quantized_weights" must be true'),
    ({"stage": 3, "zero_quantized_gradients": 1}, None, r'"zero_optimization.zero_quantized_gradients" must be true'),
    ({"stage": 2, "zero_quantized_weights": True}, None, r'zero_quantized_weights" quantizes collectives of ZeRO-3 '
                                                         r'but the run\'s stage is 2: set "stage": 3'),
    ({"stage": 1, "zero_quantized_gradients": True}, None, r'ZeRO-2/3 but the run\'s stage is 1: set "stage": 3'),
    ({"stage": 3, "zero_quantized_weight": True}, None, 'did you mean "zero_quantized_weights"'),
    ({"stage": 3}, {"allow_lossy": "yes"}, r'"poplar.allow_lossy" must be true'),
])
def test_bad_values_name_the_key_and_the_fix(zero: dict, poplar: dict | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(zero, poplar)


def test_a_fixed_plan_takes_the_keys_and_a_plan_file_that_disagrees_is_an_error(tmp_path) -> None:
    plan = toy.plan_of((2, 1, 0), (2, 1, 0), (2, 1, 0), (2, 1, 0))
    cfg = config({"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2},
                 {"topology": [[0, 1], [2, 3]]})
    fixed = with_collectives(cfg, plan, 4, 3)
    assert fixed.compression == CommPolicy(weights="int8") and fixed.secondary_shards and fixed.hierarchical
    assert "quantized weights int8" in fixed.table()
    assert with_collectives(config({"stage": 3}), plan, 4, 3).compression == CommPolicy()  # no keys: the plan's own
    # a plan file: its own compression where no key is given, an error where a key says otherwise
    on_file = Plan.from_dict({**plan.to_dict(), "zero_stage": 3, "compression": CommPolicy(gradients="int8").to_dict()})
    path = tmp_path / "plan.json"
    on_file.save(path)
    cfg.plan = str(path)
    with pytest.raises(ConfigError, match="disagree; say it in one place"):
        with_collectives(cfg, Plan.load(path), 4, 3)
    kept = config({"stage": 3}, {"plan": str(path)})
    assert with_collectives(kept, Plan.load(path), 4, 3).compression == CommPolicy(gradients="int8")
    # no stage in the config: the run's stage (a plan's, else DeepSpeed's 0) must have the collectives
    with pytest.raises(ConfigError, match=r"the run's stage is 0: set \"stage\": 3"):
        with_collectives(config({"zero_quantized_weights": True}), plan, 4, 0)


def test_allow_lossy_is_auto_modes_and_a_fixed_plan_refuses_it() -> None:
    cfg = config({"stage": 3}, {"allow_lossy": True})
    assert cfg.allow_lossy and cfg.compression is None
    with pytest.raises(ConfigError, match='"poplar.allow_lossy" lets auto mode\'s planner choose'):
        with_collectives(cfg, toy.plan_of((2, 1, 0), (2, 1, 0)), 2, 3)


def test_a_json_file_reads_the_same(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True},
                                "poplar": {"model": "llama-tiny", "allow_lossy": False}}))
    cfg = TrainConfig.load(path)
    assert cfg.compression == CommPolicy(gradients="int8") and cfg.allow_lossy is False


def test_a_replan_prices_and_keeps_the_running_quantized_collectives() -> None:
    from poplar.planner import CollectivesRequest, plan
    from poplar.train.replan import _price
    from tests.planner.test_link_pricing import SLOW, profile, two_nodes

    prof = profile(two_nodes(cross=SLOW), stage=3)
    policy = CommPolicy(weights="int8", gradients="int8")
    lossy = plan(prof, 1000, 3, collectives=CollectivesRequest("flat", compression=policy))
    exact = replace_compression(lossy, CommPolicy())
    assert _price(prof, lossy) == lossy.predicted_iteration_s < _price(prof, exact)


def replace_compression(plan: Plan, policy: CommPolicy) -> Plan:
    from dataclasses import replace
    return replace(plan, meta=dict(plan.meta), compression=policy)
