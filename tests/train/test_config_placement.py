"""``poplar.shards`` and ``poplar.offload`` mean the same with and without auto mode and with a
plan file: an even plan takes them, auto mode plans with them, a plan file must agree with
them (a disagreement is an error naming both), and a list of the wrong length is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from poplar.train.config import ConfigError, TrainConfig
from poplar.train.from_config import choose_plan, offload_setting, placed, shard_setting
from poplar.types.plans import Offload, Plan, RankPlan

import torch

CPU = torch.device("cpu")


def _cfg(plan: Path | None = None, **poplar: object) -> TrainConfig:
    section = {**poplar, **({"plan": str(plan)} if plan is not None else {})}
    return TrainConfig.from_dict({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "poplar": section})


def _plan_file(tmp_path: Path, weights: tuple[float, ...], offloads: tuple[Offload, ...] | None = None) -> Path:
    offloads = offloads or (Offload.NONE,) * len(weights)
    gas = 8 // len(weights)  # 16 samples in all, as the config's train_batch_size
    plan = Plan([RankPlan(2, gas, 0, shard_weight=w, offload=o) for w, o in zip(weights, offloads)])
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def _placed(cfg: TrainConfig, world: int) -> Plan:
    plan, auto = choose_plan(cfg, world, CPU)
    assert not auto and plan is not None
    return placed(cfg, plan, world)


def test_shards_without_auto_mode_are_applied() -> None:
    plan = _placed(_cfg(shards=[2, 1, 1, 0.5]), 4)
    assert plan.shard_weights == (2.0, 1.0, 1.0, 0.5)
    assert "shard" in plan.table().splitlines()[0]  # the plan table shows the column
    assert _placed(_cfg(shards="even"), 4).even_shards and _placed(_cfg(), 4).even_shards


@pytest.mark.parametrize("weights", [[2, 1, 1], [2, 1, 1, 0.5, 1]])
def test_a_wrong_length_is_an_error_in_every_mode(weights: list[float]) -> None:
    cfg = _cfg(shards=weights)
    with pytest.raises(ConfigError, match=rf"gives {len(weights)} weights .* job has 4 ranks"):
        _placed(cfg, 4)
    with pytest.raises(ConfigError, match="one weight per rank"):
        shard_setting(cfg, 4)  # auto mode's options are built with it too


def test_plan_file_shards_must_agree_with_the_config(tmp_path: Path) -> None:
    path = _plan_file(tmp_path, (2.0, 1.0, 1.0, 0.5))
    assert _placed(_cfg(path), 4).shard_weights == (2.0, 1.0, 1.0, 0.5)  # "auto": the file's
    assert _placed(_cfg(path, shards=[4, 2, 2, 1]), 4).shard_weights == (4.0, 2.0, 2.0, 1.0)  # the same shares
    for given in ([1, 1, 1, 1], "even"):
        with pytest.raises(ConfigError, match=r'"poplar.shards" .* and the plan file .*plan.json.*\[2.0, 1.0, 1.0, '
                                              r'0.5\] disagree'):
            _placed(_cfg(path, shards=given), 4)


def test_offload_means_the_same_as_shards(tmp_path: Path) -> None:
    assert _placed(_cfg(offload=[1]), 2).offloads == (Offload.NONE, Offload.OPTIMIZER)
    assert offload_setting(_cfg(offload=[1]), 2, auto=True) == (Offload.NONE, Offload.OPTIMIZER)  # auto mode plans with it
    assert offload_setting(_cfg(offload="auto"), 2, auto=True) is None  # auto mode's planner chooses
    with pytest.raises(ConfigError, match="this run trains on an even plan .* which no planner chooses"):
        _placed(_cfg(offload="auto"), 2)
    path = _plan_file(tmp_path, (1.0, 1.0), (Offload.NONE, Offload.OPTIMIZER))
    assert _placed(_cfg(path), 2).offloads == (Offload.NONE, Offload.OPTIMIZER)  # not given: the file's
    with pytest.raises(ConfigError, match="this run trains on the plan file .*plan.json, which no planner"):
        _placed(_cfg(path, offload="auto"), 2)
    assert _placed(_cfg(path, offload=[1]), 2).offloads == (Offload.NONE, Offload.OPTIMIZER)
    with pytest.raises(ConfigError, match=r'"poplar.offload" .*\[\'optimizer\', \'optimizer\'\].* plan file .*'
                                          r"\['none', 'optimizer'\] disagree"):
        _placed(_cfg(path, offload="all"), 2)
    with pytest.raises(ConfigError, match="names ranks \\[3\\]"):
        _placed(_cfg(offload=[3]), 2)
