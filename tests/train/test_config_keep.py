"""`poplar.checkpoint.keep` in a `poplar train` config: how many checkpoints fit keeps."""

from __future__ import annotations

import pytest

from poplar.train.config import ConfigError, TrainConfig

BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "poplar": {"model": "llama-tiny"}}


def _with_checkpoint(section: dict) -> dict:
    return {**BASE, "poplar": {**BASE["poplar"], "checkpoint": section}}


def test_keep_defaults_to_two_and_is_read() -> None:
    assert TrainConfig.from_dict(_with_checkpoint({"dir": "c"})).checkpoint_keep == 2
    assert TrainConfig.from_dict(_with_checkpoint({"dir": "c", "every": 5, "keep": 4})).checkpoint_keep == 4


@pytest.mark.parametrize("bad", [0, "3", 1.5, True])
def test_a_bad_keep_names_the_key(bad) -> None:
    with pytest.raises(ConfigError, match='"poplar.checkpoint": "keep" must be an integer >= 1'):
        TrainConfig.from_dict(_with_checkpoint({"dir": "c", "keep": bad}))
