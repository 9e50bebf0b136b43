"""PoplarTrainer: 3 gloo ranks with an uneven plan train a tiny GPT-2 exactly as ``Trainer`` in one
process on the whole global batch (token-weighted loss, SGD with momentum, clipping that clips)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from poplar.process.launch import free_port, spawn  # noqa: E402
from tests import toy  # noqa: E402
from tests.integrations import hf_jobs as jobs  # noqa: E402


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-process Trainer's 3 steps: its model and its eval loss."""
    return jobs.reference(str(tmp_path_factory.mktemp("reference")), 3, evaluate=True)


def assert_equals_three_steps(out: dict, want: dict) -> None:
    assert toy.max_rel_err(out["state"], want["state"]) < 1e-5
    assert abs(out["eval_loss"] - want["eval_loss"]) < 1e-5 * want["eval_loss"]
    assert toy.max_rel_err(out["state"], jobs.tiny_gpt2().state_dict()) > 1e-3  # it trained


# ZeRO-3, the sharded stage, runs under torchrun below: one job per stage
@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage", [0])
def test_three_steps_equal_the_one_process_trainer(tmp_path, zero_stage: int, three_steps: dict) -> None:
    out = spawn(jobs.train_rank, 3, (free_port(), zero_stage, str(tmp_path / "poplar"), 3), timeout_s=300,
                collective_timeout_s=120)
    assert_equals_three_steps(out[0], three_steps)


TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).resolve().parents[2]


# What torchrun adds is the Trainer joining the job from its environment; the stages' numerics are
# those of the spawned test above, which leaves the sharded stage to this one.
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage", [3])
def test_under_torchrun_three_steps_equal_the_one_process_trainer(tmp_path, zero_stage: int,
                                                                  three_steps: dict) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "3", "-m", "tests.integrations.hf_torchrun",
                          str(zero_stage), str(tmp_path / "poplar"), str(tmp_path / "state.pt")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_equals_three_steps(torch.load(tmp_path / "state.pt"), three_steps)


@pytest.mark.multiprocess
def test_killed_after_step_2_resumes_from_its_checkpoint_exactly(tmp_path) -> None:
    """ZeRO-3: a run saving every 2 steps ends after step 2; a new job resumes from checkpoint-2
    (the Trainer's state and Poplar's) and goes on to step 5, across the epoch's end: the model
    equals the one-process Trainer's uninterrupted 5 steps."""
    out = str(tmp_path / "poplar")
    spawn(jobs.train_rank, 3, (free_port(), 3, out, 2, None, 2), timeout_s=300, collective_timeout_s=120)
    ckpt = tmp_path / "poplar" / "checkpoint-2"
    assert (ckpt / "poplar" / "index.json").exists() and (ckpt / "model.safetensors").exists()
    resumed = spawn(jobs.train_rank, 3, (free_port(), 3, out, 5, str(ckpt), None), timeout_s=300,
                    collective_timeout_s=120)
    assert toy.max_rel_err(resumed[0]["state"], jobs.reference(str(tmp_path / "reference"), 5)) < 1e-5


@pytest.mark.multiprocess
def test_auto_mode_on_emulated_cluster_b_profiles_plans_and_trains_20_steps(tmp_path) -> None:
    out = spawn(jobs.auto_train_rank, 4, (free_port(), str(tmp_path), 20), timeout_s=480, collective_timeout_s=180)
    assert [r["device"] for r in out] == ["V100-16G", "V100-16G", "T4-16G", "T4-16G"]
    plan = out[0]["plan"]
    assert all(r["plan"] == plan for r in out) and plan["global_batch_size"] == 24
    rows = [r["micro_batch_size"] * r["accum_steps"] + r["last_batch_size"] for r in plan["ranks"]]
    assert min(rows[:2]) > max(rows[2:])  # the V100s take more of the global batch than the T4s
    assert all(r["steps"] == 20 for r in out) and len(out[0]["losses"]) == 20
