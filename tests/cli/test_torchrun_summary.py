"""An error under torchrun is in torchrun's own failure summary (its "Root Cause" section), not
only in the one line on stderr, and only there: a bad config under ``torchrun -m poplar train`` on
4 ranks, which every rank meets, is printed once on stderr and once in the summary; the other
ranks' records point to the reporter's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_a_bad_config_under_torchrun_is_the_root_cause_in_torchruns_summary_once(tmp_path: Path) -> None:
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "train_batch_sise": 8,
           "poplar": {"iterations": 2, "model": {"name": "llama-tiny", "n_layers": 1}, "data": {"seq_len": 8},
                      "collective_timeout_s": 60}}
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "4", "-m", "poplar", "train", "--config",
                          "run.json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 1, run.stderr[-3000:]
    # the one line, printed once
    assert len([line for line in run.stderr.splitlines() if line.startswith("poplar train: ")]) == 1, run.stderr
    root = run.stderr.split("Root Cause (first observed failure):", 1)
    assert len(root) == 2, run.stderr[-3000:]
    assert "<N/A>" not in root[1] and re.search(r"traceback : poplar train: error: .*'train_batch_sise'", root[1]), \
        run.stderr[-3000:]
    # in all the output: that line and the root cause's record, nothing per rank
    assert (run.stdout + run.stderr).count("the config has keys Poplar does not know") == 2, run.stderr[-6000:]
    reporter = re.search(r"rank      : (\d+) ", root[1])
    pointers = re.findall(r"traceback : poplar train: rank (\d+) stopped because the job failed; the error is rank "
                          r"(\d+)'s record", root[0])
    assert reporter and sorted(int(r) for r, _ in pointers) == sorted({0, 1, 2, 3} - {int(reporter.group(1))}) and \
        {int(w) for _, w in pointers} == {int(reporter.group(1))}, run.stderr[-6000:]
