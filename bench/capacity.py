"""How large a model a mixed cluster trains at ZeRO-3: even shards against planned shards and
per-rank CPU offload of the optimizer, beside the cluster's aggregate-memory bound.

Clusters, emulated on CPU (one gloo rank per GPU; each a ``VirtualDevice`` with its preset's
memory times ``--memory-scale``; speed is not emulated here, only memory):

- A: 4 x A100-80G + 4 x A100-40G;  C: 4 x A800-80G + 4 x V100S-32G;  B: 2 x V100-16G + 2 x T4-16G.

Precision: fp16 mixed precision by default (``--precision``), what a DeepSpeed user runs on
these cards (V100 and T4 have no bf16) and compares ZeRO-Offload under: the device keeps the fp32
master shard, the fp32 gradient shard and AdamW's moments (16 bytes per shard element) and the
fp16 gathered parameters; an offloading rank keeps an fp16 shard and the fp32 gradient shard
(6 bytes), its fp32 master and moments in host memory (not counted: the host is assumed large).

Models: a Llama-style family (8 blocks by default, ``--layers``; SwiGLU of 4 x width, 512-token
vocabulary, sequence 32) growing in width. For each cluster and width, every rank first runs one iteration at even
shards on a device that records overflows instead of raising (its peak and its share of the
sharded state, ``sharded_bytes``). What does not move with the shard is the peak less that
share; a rank's room is its capacity less that. Then, each one full iteration (micro-batch 1
on every rank, AdamW) on devices that raise out-of-memory, trains or not:

- **even**: at even shards;
- **planned**: at the weights ``poplar.planner.shards.memory_weights`` gives for those rooms
  (shares in proportion to each rank's room);
- **offload**: at even shards, the ranks that even shards do not fit (room < even share)
  offloading their optimizer (``RankPlan.offload``); the rule: offload a rank exactly where its
  memory is short, keep the others on the device (on B every card holds 16 GB: beyond the
  even limit all four are short and all offload);
- **offload + planned**: the same ranks offloading, at shard weights in proportion to each
  rank's room per byte of its even share, both measured by a second probe with those ranks
  offloading (an offloading rank holds fewer bytes per element of the state);
- **bound**: the aggregate-memory bound without offload: the rooms add up to at least the whole
  sharded state.

Each cluster reports the largest width (and its parameters) that trained in each column, found
by bisection over the widths (each column fits up to a width and not beyond). ``capacity_gain_X``
= parameters of the largest planned ÷ largest even; ``offload_gain_X`` = offload ÷ even;
``offload_planned_gain_X`` = offload + planned ÷ even; ``min_fraction_of_aggregate`` = the
smallest planned ÷ bound over the clusters. Last line ``RESULT {json}``.

The speed of planned shards needs emulated speed, not only memory: ``--speed`` then runs
``bench/shard_speed.py``'s rows (its defaults: A and C as 2 + 2 ranks, ZeRO-2 and 3, where memory
binds and where it does not; about an hour on 2 cores) and adds its ``memory_bound_speedup`` and
``min_speedup_unbound`` to this RESULT (its whole result under ``speed``); ``--speed="--stages 3"``
gives it its own options.

    python bench/capacity.py [--clusters A,C,B] [--memory-scale 0.001] [--precision fp16|bf16|fp32]
                             [--speed [OPTIONS]]
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from typing import Any

import torch

import shard_speed  # bench/ is on the path of a script run from it
from poplar.process.launch import spawn
from poplar.emulation import VirtualDevice
from poplar.emulation.presets import get_preset
from poplar.engine import PoplarEngine
from poplar.planner.shards import memory_weights
from poplar.types.plans import Offload, Plan, PlanError, RankPlan
from poplar.workloads.configs import LlamaConfig, count_params
from poplar.workloads.models import LlamaModel, llama_loss_fn

CLUSTERS = {
    "A": [("A100-80G", 4), ("A100-40G", 4)],
    "C": [("A800-80G", 4), ("V100S-32G", 4)],
    "B": [("V100-16G", 2), ("T4-16G", 2)],
}
WIDTHS = list(range(64, 1025, 16))  # about 3-6 % more parameters a step where the limits lie
SEQ = 32
LAYERS = 8  # the family's default depth (--layers)


def config(width: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=512, dim=width, n_layers=LAYERS, n_heads=4, hidden_dim=4 * width,
                       max_seq_len=SEQ)


def rank_types(cluster: str) -> list[str]:
    return [name for name, count in CLUSTERS[cluster] for _ in range(count)]


def tokens_of(rank: int) -> torch.Tensor:
    return torch.randint(0, 512, (1, SEQ + 1), generator=torch.Generator().manual_seed(rank))


def engine_at(width: int, weights: tuple[float, ...], offloading: frozenset[int], precision: str | None
              ) -> PoplarEngine:
    model = LlamaModel(config(width), seed=0)
    plan = Plan([RankPlan(1, 1, shard_weight=w, offload=Offload.OPTIMIZER if r in offloading else Offload.NONE)
                 for r, w in enumerate(weights)])
    return PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=3, plan=plan,
                        mixed_precision=precision)


def one_iteration(rank: int, width: int, weights: tuple[float, ...], offloading: frozenset[int],
                  precision: str | None, device: VirtualDevice) -> str:
    """'' if one iteration trained within the device's memory, else why not (the same on every rank)."""
    try:
        engine = engine_at(width, weights, offloading, precision)
        with device.attach(engine):
            engine.train_step(tokens_of(rank), llama_loss_fn)
        return ""
    except Exception as e:  # noqa: BLE001 - an agreed out-of-memory error is the answer
        return f"{type(e).__name__}: " + " | ".join(line.strip()[:200] for line in str(e).splitlines()[:3])


class Width:
    """One width on one rank: the probes and the trials of each column, run when first asked
    for (every rank asks in the same order: each is a collective)."""

    def __init__(self, rank: int, world: int, presets: list[str], memory_scale: float, precision: str | None,
                 width: int) -> None:
        self.rank, self.world, self.presets, self.memory_scale = rank, world, presets, memory_scale
        self.preset = presets[rank]
        self.precision, self.width = precision, width
        self.even = (1.0,) * world
        self.rooms, self.shares = self.probe(frozenset())
        self.offloading = frozenset(r for r in range(world) if self.rooms[r] < self.shares[r])
        self.total = sum(self.shares)
        self.results: dict[str, str] = {}
        self.weights: dict[str, tuple[float, ...] | None] = {"even": self.even, "offload": self.even}
        try:
            self.weights["planned"] = memory_weights(self.rooms)
        except PlanError:
            self.weights["planned"] = None

    def device(self, raise_oom: bool = True) -> VirtualDevice:
        device = VirtualDevice.from_preset(self.preset, self.memory_scale, 1.0, raise_oom=raise_oom)
        device.pad = False
        return device

    def probe(self, offloading: frozenset[int]) -> tuple[list[int], list[int]]:
        """Every rank's room and device bytes of its even share of the sharded state, with the
        ``offloading`` ranks offloaded (one iteration at even shards, overflows recorded)."""
        probe = self.device(raise_oom=False)
        engine = engine_at(self.width, self.even, offloading, self.precision)
        with probe.attach(engine):
            engine.train_step(tokens_of(self.rank), llama_loss_fn)
        sharded = engine.stage.sharded_bytes()
        peak = max(probe.peak(), probe.last_step.peak if probe.last_step else 0)
        room = probe.capacity_bytes - (peak - sharded)
        rooms = engine.comm.all_gather_object(room, tag="capacity:rooms")
        shares = engine.comm.all_gather_object(sharded, tag="capacity:sharded")
        return rooms, shares

    @property
    def bound(self) -> bool:
        """Within the aggregate bound: every rank holds what does not move with the shard, and the
        rooms left add up to the whole sharded state."""
        return min(self.rooms) >= 0 and sum(self.rooms) >= self.total

    def fits(self, column: str) -> bool:
        if column == "bound":
            return self.bound
        if column not in self.results:
            self.results[column] = self._trial(column)
        return self.results[column] == ""

    def _trial(self, column: str) -> str:
        offloading = self.offloading if column.startswith("offload") else frozenset()
        if column.startswith("offload") and not offloading:  # no rank is short: nothing to offload
            same = "even" if column == "offload" else "planned"
            self.fits(same)
            self.weights[column] = self.weights[same]
            return self.results[same]
        if column == "offload_planned":
            rooms, shares = self.probe(offloading)
            try:
                self.weights[column] = memory_weights([room / share for room, share in zip(rooms, shares)])
            except PlanError:
                self.weights[column] = None
        weights = self.weights[column]
        if weights is None:
            return "no rank has room"
        return one_iteration(self.rank, self.width, weights, offloading, self.precision, self.device())

    def row(self) -> dict[str, Any]:
        capacities = [get_preset(name).capacity_bytes(self.memory_scale) for name in self.presets]
        return {"width": self.width, "params": count_params(config(self.width)), "room": self.rooms,
                "fixed": [(c - room) / c for c, room in zip(capacities, self.rooms)], "sharded": self.total, "bound": self.bound, "offloading": sorted(self.offloading),
                **{k: v for k, v in self.results.items()},
                **{f"{k}_weights": v for k, v in self.weights.items() if k in self.results}}


COLUMNS = ("even", "planned", "offload", "offload_planned", "bound")


def worker(rank: int, world: int, cluster: str, memory_scale: float, precision: str | None, layers: int = LAYERS
           ) -> list[dict[str, Any]]:
    """Bisection over the widths, for each column (each fits up to a width and not beyond: memory
    grows with the width), measuring each width's probe and trials once."""
    global LAYERS
    LAYERS = layers  # this rank process's family: config() builds every width at this depth
    torch.set_num_threads(1)
    presets = rank_types(cluster)
    widths: dict[int, Width] = {}

    def at(i: int) -> Width:
        if i not in widths:
            widths[i] = Width(rank, world, presets, memory_scale, precision, WIDTHS[i])
        return widths[i]

    for column in COLUMNS:
        lo, hi = -1, len(WIDTHS)  # WIDTHS[lo] fits (or none), WIDTHS[hi] does not (or beyond)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid).fits(column) else (lo, mid)
    return [widths[i].row() for i in sorted(widths)]


def largest(rows: list[dict[str, Any]], ok: Any) -> dict[str, Any] | None:
    fits = [r for r in rows if ok(r)]
    return max(fits, key=lambda r: r["params"]) if fits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="A,C,B")
    ap.add_argument("--memory-scale", type=float, default=1e-3)
    ap.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"))
    ap.add_argument("--layers", type=int, default=LAYERS, help="blocks of every model in the family")
    ap.add_argument("--speed", nargs="?", const="", default=None, metavar="OPTIONS",
                    help="also bench/shard_speed.py's rows (module doc), with its options in one string if given")
    args = ap.parse_args()
    precision = None if args.precision == "fp32" else args.precision
    started = time.perf_counter()
    result: dict[str, Any] = {"memory_scale": args.memory_scale, "stage": 3, "precision": args.precision,
                              "layers": args.layers}
    fractions, notes = [], []
    print(f"ZeRO-3, AdamW, {args.precision}, {args.layers} blocks, micro-batch 1 per rank, memory x {args.memory_scale:g}; parameters (M) "
          "of the largest model that trains one iteration")
    print(f"{'cluster':<8} {'even':>12} {'planned':>12} {'offload':>12} {'off+plan':>12} {'bound':>12} "
          f"{'plan':>5} {'off':>5} {'o+p':>5}  offloading ranks (offload | offload + planned weights)")
    for cluster in args.clusters.split(","):
        world = len(rank_types(cluster))
        rows = spawn(worker, world, (cluster, args.memory_scale, precision, args.layers), timeout_s=3000,
                     collective_timeout_s=300)[0]
        best = {c: largest(rows, (lambda r: r["bound"]) if c == "bound" else (lambda r, c=c: r.get(c) == ""))
                for c in COLUMNS}
        even = best["even"]
        gain = {c: best[c]["params"] / even["params"] if even and best[c] else None
                for c in ("planned", "offload", "offload_planned")}
        if best["planned"] and best["bound"]:
            fractions.append(best["planned"]["params"] / best["bound"]["params"])
        name = lambda r: "-" if r is None else f"{r['params'] / 1e6:.2f} (w{r['width']})"  # noqa: E731
        rounded = lambda g: "-" if g is None else f"{g:.2f}"  # noqa: E731
        op = best["offload_planned"]
        where = "-" if op is None else (f"{op['offloading']} | "
                                         + ":".join(f"{w:.2f}" for w in op.get("offload_planned_weights") or ()))
        print(f"{cluster:<8} " + " ".join(f"{name(best[c]):>12}" for c in COLUMNS) + " "
              + " ".join(f"{rounded(gain[c]):>5}" for c in ("planned", "offload", "offload_planned")) + f"  {where}")
        result[f"capacity_gain_{cluster}"] = gain["planned"]
        result[f"offload_gain_{cluster}"] = gain["offload"]
        result[f"offload_planned_gain_{cluster}"] = gain["offload_planned"]
        for c, target in (("offload", 2.0), ("offload_planned", 2.0)):
            if gain[c] is not None and gain[c] < target:
                notes.append(f"{cluster}: {c} gain {gain[c]:.2f} < {target}: " + why_short(best[c], even, 8 if precision is None else 6,
                                                                                       args.layers))
        result[f"rows_{cluster}"] = [{k: r.get(k) for k in ("width", "params", "offloading", *COLUMNS)} for r in rows]
        result[f"rows_{cluster}"] = [{k: v[:80] if isinstance(v, str) else v for k, v in r.items()}
                                     for r in result[f"rows_{cluster}"]]
    for note in notes:
        print("note: " + note)
    result["min_fraction_of_aggregate"] = min(fractions) if fractions else None
    result["notes"] = notes
    if args.speed is not None:
        speed_args, speed_started = shard_speed.parse_args(shlex.split(args.speed)), time.perf_counter()
        speed_rows = shard_speed.run_rows(speed_args)
        print(shard_speed.table(speed_rows))
        speed = shard_speed.summary(speed_rows, speed_args, time.perf_counter() - speed_started)
        result.update({k: speed[k] for k in ("memory_bound_speedup", "min_speedup_unbound")}, speed=speed)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print("RESULT " + json.dumps(result))


def why_short(best: dict[str, Any] | None, even: dict[str, Any] | None, offloaded_bytes: int, layers: int) -> str:
    """Where a column's limit lies: what does not move with the shard at its largest width."""
    if best is None or even is None:
        return "nothing trained"
    fixed = max(best["fixed"])
    return (f"largest {best['params'] / 1e6:.2f} M vs even {even['params'] / 1e6:.2f} M; at w{best['width']} what "
            f"does not move with the shard (activations, gathered blocks, a block's fp32 gradient buffers, "
            f"communication buffers) takes {fixed:.0%} of a card, and offload shrinks only the rest (16 to "
            f"{offloaded_bytes} bytes per shard element): this family has {layers} blocks, so one block's buffers "
            f"are large beside a rank's share of the state (--layers: a deeper family)")


if __name__ == "__main__":
    main()
