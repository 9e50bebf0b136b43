"""The emulator (``poplar.emulation``) is imported only when the config names an emulated
cluster: a real run (here an even plan on CPU, a world of one) trains without it. The run is a
fresh interpreter (a subprocess: this one has imported the emulator already), so the test is in
the multi-process tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = """
import json, sys
from poplar.cli.train import emulated_device, run
from poplar.train.config import TrainConfig
cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))
assert run(cfg) == 0
print("after the run:", "poplar.emulation" in sys.modules)
emulated_device(TrainConfig.from_dict({"poplar": {"cluster": "B"}, "fp16": {"enabled": True}}))
print("after a cluster:", "poplar.emulation" in sys.modules)
"""


@pytest.mark.multiprocess
def test_a_real_run_does_not_import_the_emulator(tmp_path: Path) -> None:
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "poplar": {"iterations": 1, "model": {"name": "llama-tiny", "n_layers": 1}, "data": {"seq_len": 8},
                      "log_every": 0}}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(cfg)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "after the run: False" in done.stdout and "after a cluster: True" in done.stdout, done.stdout
