"""How large a model a mixed cluster trains at ZeRO-3: even shards against planned shards,
beside the cluster's aggregate-memory bound.

Clusters, emulated on CPU (one gloo rank per GPU; each a ``VirtualDevice`` with its preset's
memory times ``--memory-scale``; speed is not emulated here, only memory):

- A: 4 x A100-80G + 4 x A100-40G;  C: 4 x A800-80G + 4 x V100S-32G;  B: 2 x V100-16G + 2 x T4-16G.

Models: a Llama-style family (8 blocks, SwiGLU of 4 x width, 512-token vocabulary, sequence 32)
growing in width. For each cluster and width, every rank first runs one iteration at even
shards on a device that records overflows instead of raising (its peak and its share of the
sharded state, ``sharded_bytes``). What does not move with the shard is the peak less that
share; a rank's room is its capacity less that. Then:

- **even**: one full iteration (micro-batch 1 on every rank, AdamW) at even shards on devices
  that raise out-of-memory: trains or not;
- **planned**: the same at the weights ``poplar.planner.shards.memory_weights`` gives for those
  rooms (shares in proportion to each rank's room);
- **bound**: the aggregate-memory bound: the rooms add up to at least the whole sharded state.

Each cluster reports the largest width (and its parameters) that trained under even shards,
under planned shards, and within the bound. ``capacity_gain_X`` = parameters of the largest
planned ÷ largest even; ``min_fraction_of_aggregate`` = the smallest planned ÷ bound over the
clusters. Last line ``RESULT {json}``. The speed rows of the issue (memory-bound and unbound
speed-ups) need the emulated-speed runs of ``bench/hetero.py`` at 4 + 4 ranks and are not
measured here.

    python bench/capacity.py [--clusters A,C,B] [--memory-scale 0.001]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from poplar.comm.launch import spawn
from poplar.emulation import VirtualDevice
from poplar.engine import PoplarEngine
from poplar.planner.shards import memory_weights
from poplar.types.plans import Plan, PlanError, RankPlan
from poplar.workloads.configs import LlamaConfig, count_params
from poplar.workloads.models import LlamaModel, llama_loss_fn

CLUSTERS = {
    "A": [("A100-80G", 4), ("A100-40G", 4)],
    "C": [("A800-80G", 4), ("V100S-32G", 4)],
    "B": [("V100-16G", 2), ("T4-16G", 2)],
}
WIDTHS = list(range(64, 1025, 16))  # about 3-6 % more parameters a step where the limits lie
SEQ = 32
LAYERS = 8


def config(width: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=512, dim=width, n_layers=LAYERS, n_heads=4, hidden_dim=4 * width,
                       max_seq_len=SEQ)


def rank_types(cluster: str) -> list[str]:
    return [name for name, count in CLUSTERS[cluster] for _ in range(count)]


def one_iteration(rank: int, world: int, width: int, weights: tuple[float, ...], device: VirtualDevice) -> str:
    """'' if one iteration trained within the device's memory, else why not (the same on every rank)."""
    model = LlamaModel(config(width), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = Plan([RankPlan(1, 1, shard_weight=w) for w in weights])
    tokens = torch.randint(0, 512, (1, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    try:
        engine = PoplarEngine(model, opt, zero_stage=3, plan=plan)
        with device.attach(engine):
            engine.train_step(tokens, llama_loss_fn)
        return ""
    except Exception as e:  # noqa: BLE001 - an agreed out-of-memory error is the answer
        return f"{type(e).__name__}: " + " | ".join(line.strip()[:200] for line in str(e).splitlines()[:3])


def measure(rank: int, world: int, preset: str, memory_scale: float, width: int) -> dict[str, Any]:
    """One width: the probe, then one iteration at even and at planned shards (every rank together)."""
    even = (1.0,) * world
    probe = VirtualDevice.from_preset(preset, memory_scale, 1.0, raise_oom=False)
    probe.pad = False
    model = LlamaModel(config(width), seed=0)
    engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=3,
                          plan=Plan([RankPlan(1, 1)] * world))
    tokens = torch.randint(0, 512, (1, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    with probe.attach(engine):
        engine.train_step(tokens, llama_loss_fn)
    sharded = engine.stage.sharded_bytes()
    peak = max(probe.peak(), probe.last_step.peak if probe.last_step else 0)
    room = probe.capacity_bytes - (peak - sharded)
    rooms = engine.comm.all_gather_object(room, tag="capacity:rooms")
    total_sharded = sum(engine.comm.all_gather_object(sharded, tag="capacity:sharded"))
    del engine, model
    try:
        planned = memory_weights(rooms)
    except PlanError:
        planned = None
    # within the aggregate bound: every rank holds what does not move with the shard, and the
    # rooms left add up to the whole sharded state
    bound = min(rooms) >= 0 and sum(rooms) >= total_sharded
    row = {"width": width, "params": count_params(config(width)), "room": rooms, "sharded": total_sharded,
           "bound": bound, "planned_weights": planned}
    for name, weights in (("even", even), ("planned", planned)):
        if weights is None:
            row[name] = "no rank has room"
            continue
        device = VirtualDevice.from_preset(preset, memory_scale, 1.0)
        device.pad = False
        row[name] = one_iteration(rank, world, width, weights, device)
    return row


def worker(rank: int, world: int, cluster: str, memory_scale: float) -> list[dict[str, Any]]:
    """Bisection over the widths, for each of even, planned and bound (each fits up to a width and
    not beyond: memory grows with the width), measuring each width once."""
    torch.set_num_threads(1)
    preset = rank_types(cluster)[rank]
    rows: dict[int, dict[str, Any]] = {}

    def row(i: int) -> dict[str, Any]:
        if i not in rows:
            rows[i] = measure(rank, world, preset, memory_scale, WIDTHS[i])
        return rows[i]

    for fits in (lambda r: r["even"] == "", lambda r: r["planned"] == "", lambda r: r["bound"]):
        lo, hi = -1, len(WIDTHS)  # WIDTHS[lo] fits (or none), WIDTHS[hi] does not (or beyond)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(row(mid)) else (lo, mid)
    return [rows[i] for i in sorted(rows)]


def largest(rows: list[dict[str, Any]], ok: Any) -> dict[str, Any] | None:
    fits = [r for r in rows if ok(r)]
    return max(fits, key=lambda r: r["params"]) if fits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="A,C,B")
    ap.add_argument("--memory-scale", type=float, default=1e-3)
    args = ap.parse_args()
    started = time.perf_counter()
    result: dict[str, Any] = {"memory_scale": args.memory_scale, "stage": 3}
    fractions = []
    print(f"ZeRO-3, AdamW, micro-batch 1 per rank, memory x {args.memory_scale:g}; parameters (M) of the largest "
          "model that trains one iteration")
    print(f"{'cluster':<8} {'even':>12} {'planned':>12} {'bound':>12} {'gain':>6} {'of bound':>9}  planned weights")
    for cluster in args.clusters.split(","):
        world = len(rank_types(cluster))
        rows = spawn(worker, world, (cluster, args.memory_scale), timeout_s=1800, collective_timeout_s=300)[0]
        even = largest(rows, lambda r: r["even"] == "")
        planned = largest(rows, lambda r: r["planned"] == "")
        bound = largest(rows, lambda r: r["bound"])
        gain = planned["params"] / even["params"] if even and planned else None
        of_bound = planned["params"] / bound["params"] if planned and bound else None
        if of_bound is not None:
            fractions.append(of_bound)
        name = lambda r: "-" if r is None else f"{r['params'] / 1e6:.2f} (w{r['width']})"  # noqa: E731
        weights = "" if planned is None else ":".join(f"{w:.2f}" for w in planned["planned_weights"])
        print(f"{cluster:<8} {name(even):>12} {name(planned):>12} {name(bound):>12} "
              f"{gain if gain is None else round(gain, 2)!s:>6} {of_bound if of_bound is None else round(of_bound, 2)!s:>9}"
              f"  {weights}")
        result[f"capacity_gain_{cluster}"] = gain
        result[f"rows_{cluster}"] = [{k: r[k] for k in ("width", "params", "even", "planned", "bound")} for r in rows]
    result["min_fraction_of_aggregate"] = min(fractions) if fractions else None
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
