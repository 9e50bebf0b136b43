"""`poplar train` on a job whose checkpoint has reached its iterations says so before it builds
or profiles anything."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from poplar.cli.train import finished_at, run
from poplar.train.from_config import profile_store_dir
from poplar.train.config import TrainConfig
from tests.checkpoint.test_checkpoint_kept import PLAN1, fit, make_engine


def _config(tmp_path: Path, iterations: int, resume: bool = True) -> TrainConfig:
    return TrainConfig.from_dict({"poplar": {
        "model": "llama-tiny", "iterations": iterations, "cluster": "B",
        # a data file that does not exist: building the job's parts would fail on it
        "data": {"path": str(tmp_path / "no-such-corpus.txt")},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "resume": resume}}})


def test_a_finished_job_says_nothing_to_do_before_building_anything(tmp_path: Path) -> None:
    with torch.random.fork_rng(devices=[]):
        fit(make_engine(1, PLAN1), 3, tmp_path / "ckpt", 3)
    assert finished_at(_config(tmp_path, 3)) == 3
    assert finished_at(_config(tmp_path, 4)) is None  # more to train
    assert finished_at(_config(tmp_path, 3, resume=False)) is None  # a fresh start is asked for
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("poplar").addHandler(handler)
    try:
        assert run(_config(tmp_path, 3)) == 0  # the missing data file is never opened
    finally:
        logging.getLogger("poplar").removeHandler(handler)
    assert any("nothing to do" in line and "iteration 3" in line for line in lines), lines
    assert profile_store_dir(_config(tmp_path, 3)) in ("default", str(tmp_path / "profiles"))
