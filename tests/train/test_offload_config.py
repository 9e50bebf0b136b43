"""The JSON config's offload keys: DeepSpeed's ``zero_optimization.offload_optimizer`` (every rank
or none) and ``poplar.offload`` (per rank); the plan rows they give."""

from __future__ import annotations

import pytest

from poplar.train.config import ConfigError, TrainConfig
from poplar.train.placement_config import offload_rows
from poplar.types.plans import Offload, Plan

BASE = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}


def read(zero: dict | None = None, **poplar: object) -> TrainConfig:
    return TrainConfig.from_dict({**BASE, "zero_optimization": {"stage": 2, **(zero or {})}, "poplar": poplar})


def test_deepspeed_offload_is_every_rank_or_none() -> None:
    assert read().offload is None  # not said: a plan file's rows keep theirs
    assert read({"offload_optimizer": {"device": "cpu", "pin_memory": True}}).offload == "all"
    assert read({"offload_optimizer": {"device": "cpu", "buffer_count": 4, "fast_init": False}}).offload == "all"
    assert read({"offload_optimizer": {"device": "none"}}).offload == "none"
    assert offload_rows("all", 3, ConfigError) == (Offload.OPTIMIZER,) * 3
    assert offload_rows("none", 2, ConfigError) == (Offload.NONE,) * 2


def test_poplar_offload_is_per_rank() -> None:
    assert read(offload=[2, 1]).offload == (1, 2)
    assert read(offload="all").offload == "all"
    rows = offload_rows((1, 2), 4, ConfigError)
    assert rows == (Offload.NONE, Offload.OPTIMIZER, Offload.OPTIMIZER, Offload.NONE)
    plan = Plan.even(4, 8, 2).with_offloads(rows)
    assert plan.offloads == rows and plan.global_batch_size == 8
    with pytest.raises(ConfigError, match=r"names ranks \[4\] but the world has 4 ranks"):
        offload_rows((1, 4), 4, ConfigError)


@pytest.mark.parametrize("zero, poplar, needle", [
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, {}, "not to NVMe"),
    ({"offload_optimizer": {"device": "gpu"}}, {}, '"device" must be "cpu" or "none"'),
    ({"offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}, {}, '"pin_memory" must be true or false'),
    ({"offload_optimizer": {"device": "cpu", "ratio": 0.3}}, {}, '"ratio" below 1'),
    ({"offload_optimizer": {"device": "cpu", "colour": 1}}, {}, "['colour']"),
    ({"offload_optimizer": "cpu"}, {}, "must be a dict"),
    ({"offload_optimizer": {"device": "cpu"}}, {"offload": [1]}, "both given"),
    ({"cpu_offload": True}, {}, '"offload_optimizer": {"device": "cpu"}'),
    ({}, {"offload": [1, 1]}, "distinct rank indices"),
    ({}, {"offload": [-1]}, "distinct rank indices"),
    ({}, {"offload": True}, "distinct rank indices"),
])
def test_bad_offload_keys_are_refused_by_name(zero: dict, poplar: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        read(zero, **poplar)
    assert needle in str(e.value)
