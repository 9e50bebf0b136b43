"""``poplar.offload: "auto"``: auto mode's planner chooses which ranks offload; a plan file cannot
take it (it has no planner)."""

from __future__ import annotations

import pytest

from poplar.auto.mode import AutoOptions
from poplar.train.config import ConfigError, TrainConfig
from poplar.train.placement_config import offload_rows


def test_auto_is_accepted_and_reaches_auto_mode_only() -> None:
    cfg = TrainConfig.from_dict({"train_batch_size": 8, "zero_optimization": {"stage": 2},
                                 "poplar": {"offload": "auto"}})
    assert cfg.offload == "auto"
    with pytest.raises(ConfigError, match="cannot apply to a plan file"):
        offload_rows("auto", 4, ConfigError)
    assert AutoOptions().offload == "none" and AutoOptions(offload="auto").offload == "auto"
