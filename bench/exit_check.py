"""Clean exits: a finished `poplar train` (ZeRO-3, llama-tiny, 10 iterations, 4 gloo ranks under
torchrun, no fault) run N times; counts the runs whose launcher exits 0 and, of the others, the
status and the last lines of stderr. A scheduler judges a job by its exit status, so the target is
N of N. Prints one row per run, a summary, and last ``RESULT {json}``.

    python bench/exit_check.py [--runs 20] [--ranks 4] [--stage 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def config(stage: int, iterations: int) -> dict:
    return {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
        "poplar": {"iterations": iterations, "model": "llama-tiny", "data": {"seq_len": 32},
                   "report_dir": "report", "collective_timeout_s": 120},
    }


def one_run(work: Path, ranks: int, timeout_s: float) -> tuple[int, float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    try:
        run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", str(ranks), "-m", "poplar", "train",
                              "--config", "run.json"], cwd=work, env=env, capture_output=True, text=True,
                             timeout=timeout_s)
        code, err = run.returncode, run.stderr
    except subprocess.TimeoutExpired as e:
        code, err = -1, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    seconds = time.perf_counter() - t0
    if code == 0 and "[poplar] done:" not in err:
        code = -2  # exited 0 without finishing: not a clean run either
    return code, seconds, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args()
    if not TORCHRUN.exists():
        sys.exit(f"torchrun not found beside {sys.executable}")
    codes, seconds, failures = [], [], []
    print(f"{'run':>4} {'exit':>5} {'seconds':>8}")
    with tempfile.TemporaryDirectory(prefix="poplar-exit-check-") as tmp:
        for i in range(args.runs):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            (work / "run.json").write_text(json.dumps(config(args.stage, args.iterations)))
            code, s, err = one_run(work, args.ranks, args.timeout_s)
            codes.append(code)
            seconds.append(s)
            print(f"{i:>4} {code:>5} {s:>8.1f}", flush=True)
            if code != 0:
                failures.append({"run": i, "exit": code, "stderr_tail": err.splitlines()[-40:]})
    clean = sum(c == 0 for c in codes)
    for f in failures:
        print(f"run {f['run']} exited {f['exit']}:\n  " + "\n  ".join(f["stderr_tail"]))
    print(f"{clean} of {args.runs} runs exited 0 (ZeRO-{args.stage}, {args.ranks} ranks, llama-tiny, "
          f"{args.iterations} iterations); median run {statistics.median(seconds):.1f} s")
    print("RESULT " + json.dumps({"runs": args.runs, "exit_0": clean, "ranks": args.ranks, "stage": args.stage,
                                  "iterations": args.iterations, "exit_codes": codes,
                                  "median_run_s": statistics.median(seconds)}))


if __name__ == "__main__":
    main()
