"""Auto mode chooses the stage and nothing else: every other ``ZeroConfig`` field the caller gave
reaches the runtime as given."""

from __future__ import annotations

import torch
from torch import nn

from poplar.auto import AutoOptions
from poplar.engine import PoplarEngine
from poplar.types.profiles import CommProfile, Links, Profile, ProfilePoint, RankProfile
from poplar.zero.config import ZeroConfig
from poplar.zero.nonfinite import SkipReport


def _loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (module(batch) ** 2).mean()


def test_auto_mode_keeps_every_zero_config_field() -> None:
    profile = Profile(0, 1, 10, 40, [RankProfile(0, "X", 8, [ProfilePoint(b, 0.001 * b) for b in (1, 2, 4, 8)])],
                      CommProfile(Links(1e12)))
    model = nn.Linear(4, 1)
    given = ZeroConfig("auto", bucket_size_mb=7.0, nonfinite="raise", max_consecutive_skips=3,
                       skip_report=SkipReport.COUNT)
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), zero_stage=given,
                          global_batch_size=8, loss_fn=_loss, auto=AutoOptions(profile=profile, progress=False))
    assert engine.zero_stage == 0  # the stage is the profile's
    assert engine.zero_config == ZeroConfig(0, bucket_size_mb=7.0, nonfinite="raise", max_consecutive_skips=3,
                                            skip_report=SkipReport.COUNT)
    assert engine.skip_report is SkipReport.COUNT
    engine.close()
