"""From launch to the first trained iteration: how much a warm profile store saves.

The quick-start job of docs/engine.md (llama-tiny, sequence 32, AdamW, ZeRO-2, global batch 32) on
emulated cluster B (2 x V100-16G + 2 x T4-16G), 4 ranks launched with torchrun, each start a
fresh ``torchrun`` process tree timed from launch to the end of its first trained iteration:

- **first**: an empty profile store: auto mode profiles every device type (and keeps them);
- **warm**: the same job again: every type comes from the store, nothing is profiled;
- **plain**: the same job with a given even plan (8 per rank in one micro-step): no profiling,
  no store, no emulated device; the start a job without auto mode has;
- **mix**: the same job on another mix of the known types (3 x V100-16G + 1 x T4-16G): planned
  from the stored profiles, nothing profiled;
- **done**: a finished job (its checkpoint at the last iteration) started again: launch to its
  "nothing to do" (and to the exit of every process).

warm, plain and mix run side by side (one of each per round), ``--repeats`` rounds; medians.
``warm_vs_plain_start`` = median warm ÷ median plain (target <= 1.3). Timings follow the
machine's load. Last line ``RESULT {json}``.

    python bench/startup.py [--repeats 3]
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

MARK = "STARTUP_FIRST_ITERATION_AT"
CLUSTERS = {"B": "B", "mix": [{"type": "V100-16G", "count": 3}, {"type": "T4-16G", "count": 1}]}


def job(args: argparse.Namespace) -> None:
    """One rank of the quick-start job (run under torchrun)."""
    import torch
    import torch.distributed as dist

    from poplar import AutoOptions, PoplarEngine, fit
    from poplar.emulation import cluster_device
    from poplar.emulation.cluster import ClusterSpec
    from poplar.train import CheckpointOptions, ReportOptions
    from poplar.types.plans import Plan
    from poplar.workloads.models import create_model, llama_loss_fn
    from poplar.workloads.text import TextBlocks

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = TextBlocks(seq_len=32, split="train")
    model = create_model("llama-tiny", max_seq_len=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.kind == "plain":
        engine = PoplarEngine(model, optimizer, zero_stage=2, loss_fn=llama_loss_fn,
                              plan=Plan.even(dist.get_world_size(), 32, 8))
    else:
        spec = CLUSTERS[args.cluster]
        cluster = spec if isinstance(spec, str) else ClusterSpec(args.cluster, spec)
        engine = PoplarEngine(model, optimizer, zero_stage=2, global_batch_size=32, loss_fn=llama_loss_fn,
                              auto=AutoOptions(profile_data=data, device=cluster_device(cluster), store=args.store))
    fit(engine, data, iterations=args.iterations, report=ReportOptions(log_every=0, progress=False),
        checkpoint=CheckpointOptions(args.checkpoint) if args.checkpoint else None)
    if dist.get_rank() == 0:
        print(f"{MARK} {time.time():.6f} store={engine.auto_result.store_use.value if engine.auto_result else None}",
              flush=True)
    engine.close()
    dist.destroy_process_group()


def launch(kind: str, store: str, cluster: str = "B", checkpoint: str = "", iterations: int = 1) -> dict:
    """One start: seconds from launch to the first iteration's end (and to exit), its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", __file__, "--job",
           "--kind", kind, "--store", store, "--cluster", cluster, "--iterations", str(iterations)]
    if checkpoint:
        cmd += ["--checkpoint", checkpoint]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    out = run.stdout + run.stderr
    if run.returncode != 0:
        raise RuntimeError(f"{kind} start failed ({run.returncode}):\n{out[-4000:]}")
    marks = [line.split() for line in run.stdout.splitlines() if line.startswith(MARK)]
    first = float(marks[0][1]) - t0 if marks else None
    return {"first_iteration_s": first, "exit_s": time.time() - t0, "store": marks[0][2] if marks else None,
            "output": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", default="B", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "profiles")
        first = launch("auto", store)
        assert first["store"] == "store=measured", first["output"][-3000:]
        warm, plain, mix, mix_error = [], [], [], []
        for _ in range(args.repeats):  # side by side: one of each per round
            w = launch("auto", store)
            assert w["store"] == "store=reused", w["output"][-3000:]
            warm.append(w["first_iteration_s"])
            plain.append(launch("plain", store)["first_iteration_s"])
            m = launch("auto", store, cluster="mix")
            assert m["store"] == "store=reused", m["output"][-3000:]
            mix.append(m["first_iteration_s"])
            mix_error += [line.split("(predicted ")[-1].rstrip(")") for line in m["output"].splitlines()
                          if "iteration 1/1:" in line]
        ckpt = os.path.join(tmp, "ckpt")
        launch("auto", store, checkpoint=ckpt, iterations=2)
        done = [launch("auto", store, checkpoint=ckpt, iterations=2) for _ in range(args.repeats)]
        said = all("nothing to do" in d["output"] for d in done)
    w, p, m = statistics.median(warm), statistics.median(plain), statistics.median(mix)
    said_s = statistics.median(d["first_iteration_s"] for d in done)
    exit_s = statistics.median(d["exit_s"] for d in done)
    rows = [("first (profiles)", [first["first_iteration_s"]]), ("warm (store)", warm), ("plain (even plan)", plain),
            ("mix 3xV100+1xT4 (store)", mix)]
    print(f"{'start':<26} {'median s':>9}   runs")
    print("-" * 60)
    for name, xs in rows:
        print(f"{name:<26} {statistics.median(xs):>9.2f}   " + ", ".join(f"{x:.2f}" for x in xs))
    print(f"mix, first iteration against the plan's prediction: {', '.join(mix_error)}")
    print(f"finished job started again: 'nothing to do' after {said_s:.2f} s, exit after {exit_s:.2f} s "
          f"(medians of {args.repeats}; said every time: {said})")
    print(f"load average (1 min) before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"warm / plain: {w / p:.2f} (side by side, medians of {args.repeats})")
    print("RESULT " + json.dumps({"first_start_s": round(first["first_iteration_s"], 2), "warm_start_s": round(w, 2),
                                  "plain_start_s": round(p, 2), "warm_vs_plain_start": round(w / p, 3),
                                  "other_mix_start_s": round(m, 2), "nothing_to_do_s": round(said_s, 2),
                                  "nothing_to_do_exit_s": round(exit_s, 2),
                                  "nothing_to_do_said": said, "repeats": args.repeats,
                                  "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
