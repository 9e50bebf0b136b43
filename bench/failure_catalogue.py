"""The failure catalogue of `poplar train` under torchrun: what a job prints and how every rank
exits when it fails. Runs (llama-tiny, gloo, 3 ranks, checkpoints every 2 iterations):

- ``kill``: N runs, each SIGKILLs one rank chosen at random at a random moment after iteration 2;
- ``config``: a config with a misspelt key;
- ``plan``: a plan file whose global batch disagrees with ``train_batch_size``;
- ``unwritable``: a checkpoint directory the job cannot create (below a read-only directory, or
  below a file when run as root, who writes through permissions).

Per run: the number of failure paragraphs (lines starting "poplar train:"; the target is 1), each
surviving rank's exit status from torchrun's summary (the target: 1 on every rank that was not
killed), and whether the paragraph names a rank as died that was not killed (a false "died"; the
target is 0). Prints one row per run, a summary, and last ``RESULT {json}``.

    python bench/failure_catalogue.py [--runs 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from poplar.emulation.torchrun_workers import worker_pid

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
RANKS = 3
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}


def config(work: Path, **poplar: object) -> dict:
    return {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
            "poplar": {"iterations": 100_000, "model": {"name": "llama-tiny", "n_layers": 2}, "data": {"seq_len": 16},
                       "checkpoint": {"dir": "ckpt", "every": 2}, "collective_timeout_s": 30, "log_every": 1,
                       **poplar}}


def launch(work: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node", str(RANKS), "-m", "poplar", "train",
                             "--config", "run.json"], cwd=work, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)


def verdict(kind: str, text: str, killed: int | None, seconds: float) -> dict:
    paragraphs = [line for line in text.splitlines() if line.startswith("poplar train:")]
    codes = {int(r): int(c) for r, c in re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", text)}
    survivors = [r for r in range(RANKS) if r != killed]
    died = set()
    for p in paragraphs:
        lead = p.split(" died", 1)[0] if " died" in p else ""
        died |= {int(x) for x in re.findall(r"\d+", lead.removeprefix("poplar train: "))}
    return {"kind": kind, "killed": killed, "paragraphs": len(paragraphs),
            "survivor_codes": [codes.get(r) for r in survivors], "false_died": sorted(died - {killed}),
            "seconds": round(seconds, 1), "line": paragraphs[0][:150] if paragraphs else ""}


def kill_run(work: Path, rng: random.Random) -> dict:
    (work / "run.json").write_text(json.dumps(config(work)))
    log = work / "run.log"
    proc = launch(work, log)
    victim = rng.randrange(RANKS)
    t0 = time.monotonic()
    try:
        while "iteration 2/" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > t0 + 120:
                raise RuntimeError(log.read_text()[-2000:])
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        pid = worker_pid(proc.pid, victim)
        killed_at = time.monotonic()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return verdict("kill", log.read_text(), victim, time.monotonic() - killed_at)


def input_run(work: Path, kind: str) -> dict:
    cfg = config(work)
    if kind == "config":
        cfg["train_batch_sise"] = 8
    elif kind == "plan":
        plan = {"ranks": [{"micro_batch_size": 2, "accum_steps": 1, "last_batch_size": 0}] * RANKS}  # 6 samples
        (work / "plan.json").write_text(json.dumps(plan))
        cfg["poplar"]["plan"] = "plan.json"
    elif kind == "unwritable":
        if os.geteuid() == 0:  # root writes through permissions: put a file where a directory must be
            (work / "ro").write_text("a file, not a directory\n")
        else:
            (work / "ro").mkdir()
            os.chmod(work / "ro", 0o500)
        cfg["poplar"]["checkpoint"] = {"dir": "ro/ckpt", "every": 2}
    cfg["poplar"]["iterations"] = 4  # a run that does not fail ends soon
    (work / "run.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", str(RANKS), "-m", "poplar", "train",
                          "--config", "run.json"], cwd=work, env=ENV, capture_output=True, text=True, timeout=180)
    return verdict(kind, run.stderr, None, time.monotonic() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(kill_run(Path(tmp), rng))
        print(json.dumps(rows[-1]), flush=True)
    for kind in ("config", "plan", "unwritable"):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(input_run(Path(tmp), kind))
            for sub in Path(tmp).iterdir():
                if sub.is_dir():
                    os.chmod(sub, 0o700)
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'kind':>10} {'killed':>6} {'paras':>5} {'survivor exit':>14} {'false died':>10} {'s':>5}  line")
    for r in rows:
        print(f"{r['kind']:>10} {str(r['killed']):>6} {r['paragraphs']:>5} {str(r['survivor_codes']):>14} "
              f"{str(r['false_died']):>10} {r['seconds']:>5}  {r['line'][:90]}")
    one = sum(r["paragraphs"] == 1 for r in rows)
    exit1 = sum(all(c == 1 for c in r["survivor_codes"]) for r in rows)
    false = sum(bool(r["false_died"]) for r in rows)
    print(f"\n{len(rows)} runs: {one} with one paragraph, {exit1} with exit 1 on every surviving rank, "
          f"{false} with a false 'died'")
    print("RESULT " + json.dumps({"runs": len(rows), "one_paragraph": one, "exit_1_everywhere": exit1,
                                  "false_died": false,
                                  "median_kill_to_exit_s": sorted(r["seconds"] for r in rows[:args.runs])[
                                      args.runs // 2] if args.runs else None}))


if __name__ == "__main__":
    main()
