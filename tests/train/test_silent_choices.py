"""No silent choices in a run's reports: a report an extra would write says that it is skipped."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from poplar.engine import PoplarEngine
from poplar.train import ReportOptions, fit
from poplar.train.tensorboard import ScalarLog
from tests.toy import global_batch, loss_fn, make_model, plan_of
from tests.log_lines import Lines


@pytest.mark.parametrize("installed", [True, False])
def test_tensorboard_missing_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    if not installed:  # as on a machine without the tensorboard extra
        monkeypatch.setattr(ScalarLog, "open", classmethod(lambda cls, log_dir: None))
    lines, logger = Lines(), logging.getLogger("poplar")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    try:
        model = make_model(2)
        engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan_of((2, 1, 0)),
                              loss_fn=loss_fn)
        fit(engine, list(global_batch(0, 8)), 2, report=ReportOptions(str(tmp_path), log_every=0, progress=False))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    said = [line for line in lines.lines if "TensorBoard events skipped" in line]
    assert len(said) == (0 if installed else 1), lines.lines
    assert "pip install 'poplar[tensorboard]'" in "".join(said) or installed
