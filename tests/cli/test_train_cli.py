"""`torchrun -m poplar train --config ...` trains on CPU (gloo), resumes, runs auto mode on an
emulated cluster, and refuses a bad config with the key's name, or more ranks than GPUs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).resolve().parents[2]
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # these runs test the gloo path, also on a machine with fewer GPUs than ranks


def _config(tmp: Path, **poplar: object) -> Path:
    cfg = {
        "train_batch_size": 12,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 0.003}},
        "poplar": {"iterations": 4, "model": {"name": "llama-tiny", "n_layers": 2}, "data": {"seq_len": 16},
                   "checkpoint": {"dir": "ckpt", "every": 2}, "report_dir": "report", "collective_timeout_s": 60,
                   **poplar},
    }
    path = tmp / "run.json"
    path.write_text(json.dumps(cfg))
    return path


def _torchrun(tmp: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY}
    return subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), "-m", "poplar", "train",
                           "--config", "run.json", *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_torchrun_trains_checkpoints_and_resumes_in_another_precision(tmp_path: Path) -> None:
    """DeepSpeed's precision keys under torchrun: a bf16 run checkpoints and reports; its
    checkpoint resumes under fp16 (one job pair for both: resuming is the same in any precision)."""
    path = _config(tmp_path)
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "bf16": {"enabled": True}}))
    run = _torchrun(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "iteration 4/4" in run.stderr and "plan (even, ZeRO-2)" in run.stderr and "bf16" in run.stderr
    assert json.loads((tmp_path / "ckpt" / "index.json").read_text())["iteration"] == 4
    index = json.loads((tmp_path / "ckpt" / "step-00000004" / "index.json").read_text())
    assert index["precision"]["policy"]["param_dtype"] == "bf16"
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["end_iteration"] == 4 and [r["samples"] for r in metrics["ranks"]] == [6, 6]
    assert (tmp_path / "report" / "trace.json").is_file()

    path.write_text(json.dumps({**cfg, "fp16": {"enabled": True, "initial_scale_power": 8}}))
    again = _torchrun(tmp_path, "--iterations", "6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from ckpt at iteration 4" in again.stderr and "iteration 6/6" in again.stderr
    assert json.loads((tmp_path / "ckpt" / "index.json").read_text())["iteration"] == 6
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert all(math.isfinite(x) for x in metrics["losses"]) and len(metrics["losses"]) == 6, metrics["losses"]


@pytest.mark.multiprocess
def test_bad_config_exits_1_naming_the_key(tmp_path: Path) -> None:
    cfg = json.loads(_config(tmp_path).read_text())
    cfg["train_batch_sise"] = 8
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    run = subprocess.run([sys.executable, "-m", "poplar", "train", "--config", "run.json"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "['train_batch_sise']" in run.stderr, run.stderr[-2000:]


@pytest.mark.multiprocess
def test_a_deepspeed_config_without_a_model_exits_1_before_training(tmp_path: Path) -> None:
    cfg = json.loads(_config(tmp_path).read_text())
    del cfg["poplar"]
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    run = subprocess.run([sys.executable, "-m", "poplar", "train", "--config", "run.json"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and 'names no model' in run.stderr and '"poplar"' in run.stderr, run.stderr[-2000:]
    assert "data:" not in run.stdout + run.stderr and not (tmp_path / "ckpt").exists()  # nothing built


def test_more_local_ranks_than_gpus_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, local rank 1 of a one-GPU machine is refused by name before CUDA fails on it."""
    import torch

    from poplar.cli.train import init_distributed
    from poplar.train.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device was reached"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="local rank 1 has no GPU: 1 visible"):
        init_distributed(60.0)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_torchrun_auto_mode_on_an_emulated_cluster_with_a_hugging_face_config_says_what_each_auto_became(
        tmp_path: Path) -> None:
    """Auto mode under torchrun on an emulated pair, from the Hugging Face ZeRO-2 DeepSpeed config:
    its "auto" values resolved and said once, its performance hints (overlap_comm,
    allgather_bucket_size, ...) said once, and the stage given is the stage run (auto mode chooses
    it only with "stage": "auto")."""
    from tests.train.test_deepspeed_config_auto import HF_ZERO2

    (tmp_path / "pair.json").write_text(json.dumps(
        {"name": "pair", "devices": [{"type": "V100-16G", "count": 1}, {"type": "T4-16G", "count": 1}]}))
    cfg = {**HF_ZERO2, "zero_optimization": {k: v for k, v in HF_ZERO2["zero_optimization"].items()
                                             if k != "offload_optimizer"},
           "poplar": {"iterations": 2, "model": {"name": "llama-tiny", "n_layers": 2}, "data": {"seq_len": 16},
                      "cluster": "pair.json", "report_dir": "report", "collective_timeout_s": 60}}
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    run = _torchrun(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if 'config: "auto" values became' in line]
    assert len(said) == 1, run.stderr[-3000:]
    assert "train_batch_size 16 (8 per rank x 2 ranks" in said[0] and "optimizer.params.lr 0.001" in said[0]
    assert "scheduler.params.total_num_steps 2 (the run's iterations)" in said[0]
    assert "iteration 2/2" in run.stderr
    assert re.search(r"plan \(poplar, ZeRO-2", run.stderr) and "V100-16G" in run.stderr and "predicted" in run.stderr
    hints = [line for line in run.stderr.splitlines() if "DeepSpeed performance hints" in line]
    assert len(hints) == 1 and "overlap_comm" in hints[0] and "allgather_bucket_size" in hints[0], hints
    profile = json.loads((tmp_path / "report" / "profile.json").read_text())
    assert [r["device_type"] for r in profile["ranks"]] == ["V100-16G", "T4-16G"]
    plan = json.loads((tmp_path / "report" / "plan.json").read_text())
    assert plan["strategy"] == "poplar" and plan["global_batch_size"] == 16
