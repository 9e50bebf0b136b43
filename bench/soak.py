"""Soak: 10,000 iterations of a tiny model at ZeRO-3 on 2 gloo ranks, a `PoplarEngine` driven
by `train_step` (its ledger, observers and timeline all on). Per window of 1,000 iterations it
prints each rank's resident memory (RSS) at the window's end and the median iteration time.
A long job must cost the same at iteration 100,000 as at 1,000: targets are an RSS growth of at
most 5 MB and an iteration-time drift of at most 5 %, both last window against the second (the
first holds the warm-up).

The machine's own speed is not constant: on a shared 2-core machine the median iteration of
one window moves by 10-20 % over minutes, up or down, whatever the engine does. So, as every
bench here does, the time is measured against a reference side by side: each window builds a
fresh engine and runs it alternately with the long-lived one for ``--paired`` iterations
(after its first 20); "vs fresh" is the median of their per-pair ratios (long-lived / fresh),
which moves only with what the long-lived engine has accumulated. ``iteration_time_drift`` is
its change from the second window to the last; the raw change of the window medians is
``raw_iteration_time_drift`` and their Theil-Sen trend ``raw_iteration_time_trend``. The last
line is ``RESULT {"rss_growth_mb": ..., "iteration_time_drift": ..., ...}`` (the worse rank of
each). Building a fresh engine every window also checks that dropped engines are freed: each
one that stayed alive would add its model and buffers to the RSS.

    python bench/soak.py [--iterations 10000] [--window 1000] [--paired 200]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.types.plans import Plan

VOCAB, DIM, SEQ, GBS = 64, 32, 8, 8
WARM_UP = 20  # steps of each fresh reference engine left out of the pairs


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def trend_over_run(medians: list[float]) -> float:
    """Growth from the first to the last window along the Theil-Sen line (the median of the
    pairwise slopes), relative to the median window: one noisy window on a shared machine moves
    it far less than it moves the last-vs-second ratio."""
    slopes = [(medians[j] - medians[i]) / (j - i) for i in range(len(medians)) for j in range(i + 1, len(medians))]
    return statistics.median(slopes) * (len(medians) - 1) / statistics.median(medians)


def build(world: int) -> PoplarEngine:
    torch.manual_seed(0)
    model = Tiny()
    return PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), zero_stage=3,
                        plan=Plan.even(world, GBS, 2), loss_fn=loss_fn)


def worker(rank: int, world: int, iterations: int, window: int, paired: int) -> list[dict]:
    engine = build(world)
    data = torch.randint(0, VOCAB, (64, GBS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    share = GBS // world
    rows, times, ratios, fresh = [], [], [], None
    for it in range(iterations):
        batch = data[it % len(data), rank * share:(rank + 1) * share]
        if it % window == 0:  # a fresh engine, run alternately with the long-lived one: the reference
            fresh, ratios = build(world), []
        t0 = time.perf_counter()
        engine.train_step(batch)
        times.append(time.perf_counter() - t0)
        if fresh is not None:
            t0 = time.perf_counter()
            fresh.train_step(batch)
            if it % window >= WARM_UP:  # the fresh engine's first steps allocate
                ratios.append(times[-1] / (time.perf_counter() - t0))
            if len(ratios) == paired:
                fresh.close()
                fresh = None
        if (it + 1) % window == 0:
            gc.collect()  # what stays after a collection is what grows for real
            rows.append({"window": (it + 1) // window, "rss_mb": rss_mb(),
                         "median_iteration_ms": 1e3 * statistics.median(times[-window:]),
                         "paired_ratio": statistics.median(ratios), "ledger_records": len(engine.comm_ledger.records)})
    engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=10_000)
    ap.add_argument("--window", type=int, default=1_000)
    ap.add_argument("--paired", type=int, default=200,
                    help="iterations per window run alternately with a freshly built engine (the reference)")
    args = ap.parse_args()
    if not 0 < args.paired <= args.window - WARM_UP:
        raise SystemExit(f"--paired must be between 1 and --window - {WARM_UP}")
    if args.iterations < 3 * args.window:
        raise SystemExit("--iterations must be at least 3 windows (the first is the warm-up)")
    results = spawn(worker, 2, (args.iterations, args.window, args.paired), timeout_s=3600, collective_timeout_s=120)
    print(f"{'window':>6} {'iterations':>12} " + " ".join(f"{f'rank{r} RSS MB':>13} {f'rank{r} ms':>9}"
                                                          for r in range(len(results))) + f" {'vs fresh':>8} {'ledger':>7}")
    for k in range(len(results[0])):
        first = k * args.window
        print(f"{k + 1:>6} {f'{first}-{first + args.window - 1}':>12} "
              + " ".join(f"{res[k]['rss_mb']:>13.1f} {res[k]['median_iteration_ms']:>9.3f}" for res in results)
              + f" {max(res[k]['paired_ratio'] for res in results):>8.3f} {results[0][k]['ledger_records']:>7}")
    growth = max(res[-1]["rss_mb"] - res[1]["rss_mb"] for res in results)
    drift = max(res[-1]["median_iteration_ms"] / res[1]["median_iteration_ms"] - 1 for res in results)
    trend = max(trend_over_run([row["median_iteration_ms"] for row in res[1:]]) for res in results)
    paired = max(res[-1]["paired_ratio"] / res[1]["paired_ratio"] - 1 for res in results)
    print(f"last window vs second: RSS {growth:+.2f} MB (target <= 5); iteration time vs a fresh engine run "
          f"alternately with it {paired:+.1%} (target <= 5 %); raw window medians {drift:+.1%} (the machine's drift "
          "included)")
    print(f"raw trend of the window medians from the second window on (Theil-Sen, over the run): {trend:+.1%}")
    print("RESULT " + json.dumps({"rss_growth_mb": round(growth, 3), "iteration_time_drift": round(paired, 4),
                                  "raw_iteration_time_drift": round(drift, 4),
                                  "raw_iteration_time_trend": round(trend, 4),
                                  "iterations": args.iterations, "window": args.window, "ranks": len(results),
                                  "zero_stage": 3}))


if __name__ == "__main__":
    main()
