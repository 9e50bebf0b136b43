"""`torchrun -m poplar train` with ``poplar.offload``: rank 1 of 2 keeps its optimizer in host
memory, beside the config's shard weights; the plan table says so, the run trains and
checkpoints, and the checkpoint's plan keeps the placement, in an even plan as in auto mode's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli.test_train_cli import REPO, TORCHRUN, _config, _torchrun


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_torchrun_trains_with_the_config_shards_and_rank_1_offloaded_without_auto_mode(tmp_path: Path) -> None:
    """An even plan (train_micro_batch_size_per_gpu, no auto mode) takes both of the config's
    placements: shard weights 2 : 0.5 and rank 1's optimizer in host memory; it trains and
    checkpoints, and the checkpoint's plan keeps both."""
    _config(tmp_path, shards=[2, 0.5], offload=[1])
    run = _torchrun(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "iteration 4/4" in run.stderr and "plan (even, ZeRO-2)" in run.stderr
    table = run.stderr[run.stderr.index("plan (even, ZeRO-2)"):].splitlines()
    assert "shard" in table[1] and "offload" in table[1], table[:5]
    assert "80.0%" in table[3] and "none" in table[3] and "20.0%" in table[4] and "optimizer" in table[4], table[:5]
    index = json.loads((tmp_path / "ckpt" / "step-00000004" / "index.json").read_text())
    assert index["iteration"] == 4
    assert [(r["shard_weight"], r["offload"]) for r in index["plan"]["ranks"]] == [(2.0, "none"), (0.5, "optimizer")]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_auto_mode_plans_with_the_config_shards_and_offload(tmp_path: Path) -> None:
    """``poplar profile --config`` (the job up to its plan) on an emulated pair: auto mode's plan
    carries the config's shard weights and offloading rank, as an even plan does."""
    (tmp_path / "pair.json").write_text(json.dumps(
        {"name": "pair", "devices": [{"type": "V100-16G", "count": 1}, {"type": "T4-16G", "count": 1}]}))
    _config(tmp_path, cluster="pair.json", shards=[2, 1], offload=[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "",
           "POPLAR_PROFILE_STORE": str(tmp_path / "store")}
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "poplar", "profile",
                          "--config", "run.json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    table = run.stderr[run.stderr.index("plan (poplar, ZeRO-2"):].splitlines()
    assert "shard" in table[1] and "offload" in table[1], table[:5]
    assert "66.7%" in table[3] and "none" in table[3] and "33.3%" in table[4] and "optimizer" in table[4], table[:5]
