"""Speed of planned shards against even shards, where memory binds and where it does not.

A card that holds a full 1/N shard of the model state has less room for activations: it runs
smaller micro-batches, and at ZeRO-2/3 every extra micro-step is another round of collectives.
Planned shards (``plan(..., shards="auto")``, what auto mode does) move state to the cards with
room and plan the batches at the micro-batches that frees. This bench measures what that buys.

Clusters, emulated as in ``bench/hetero.py`` (one gloo rank per GPU, a ``VirtualDevice`` per rank
with its preset's memory and speed curve, collectives on a virtual link calibrated on this
machine): A = A100-80G + A100-40G and C = A800-80G + V100S-32G, 2 + 2 ranks (``--full``: 4 + 4).
Model: a Llama-style model whose state is large beside one sample's activations (``--dim 256``,
``--layers 4``, ``--seq 8``: about 4 M parameters, 16 bytes each under AdamW), as in a model at
the edge of what a cluster holds; next-token loss on random tokens, AdamW. With ``--full`` the
samples are 4 tokens: 8 ranks cut the state into shards half as large as 4 ranks do, and half
the tokens keep a rank's even shard the same size beside a sample's activations, the balance
that decides how many samples a card gains when it gives its shard up (at 8 tokens on 4 + 4 a
short A100-40G gained 7 at ZeRO-2, against 15 on 2 + 2).

Per cluster x ZeRO stage x memory regime, with its own calibration:

- **bound**: the memory scale at which the smallest card fits ``--bound-mbs`` samples at even
  shards, at this stage (the largest model the cluster trains at even shards, seen from the
  other side: the model fixed, the memory shrunk to its limit);
- **unbound**: the scale at which the smallest card fits the whole global batch at even shards,
  so that no card's memory limits the plan.

Every rank profiles (capacity search at even shards, lock-step timing, collective bandwidth);
then ``even`` = ``plan(profile, gbs, stage, shards="even")`` and ``planned`` =
``plan(..., shards="auto")`` train side by side as in ``bench/hetero.py`` (interleaved rounds,
each plan with its own engine, the same global batches; an iteration's time is its period,
averaged over the ranks; medians). Where ``auto`` keeps even shards (its prediction is not
faster by more than the plan's tie) the two are the same program, run once (ratio 1.00,
"same plan").

``memory_bound_speedup`` = the smallest planned ÷ even throughput over the bound rows;
``min_speedup_unbound`` the smallest over the unbound rows. ``late_step_fraction``: the share of
padded micro-steps whose real compute overshot the device's curve; a run above the budget is
re-calibrated with more headroom and, if still late, marked INVALID. Last line ``RESULT {json}``.

    .venv/bin/python bench/shard_speed.py [--clusters A,C] [--stages 2,3] [--regimes bound,unbound]
                                          [--iterations 12] [--rounds 3] [--gbs 192] [--full]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Any

from hetero import cluster_link, rows_of, sample, train  # bench/ is on the path of a script run from it

from poplar.process.launch import spawn
from poplar.emulation.calibration import calibrate
from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.emulate import cluster_devices
from poplar.emulation.runs import until_on_time
from poplar.emulation.speed_padding import LATE_BUDGET, late_fraction
from poplar.planner import plan
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer, profile_rank
from poplar.types.configuration import Configuration
from poplar.types.plan_choice import row_dicts
from poplar.types.plans import Plan
from poplar.workloads.configs import LlamaConfig
from poplar.workloads.models import LlamaModel, llama_loss_fn

REGIMES = ("bound", "unbound")
FULL = {"A": ClusterSpec("A-4+4", [{"type": "A100-80G", "count": 4}, {"type": "A100-40G", "count": 4}]),
        "C": ClusterSpec("C-4+4", [{"type": "A800-80G", "count": 4}, {"type": "V100S-32G", "count": 4}])}
# tokens a sample: 8 on 2 + 2 ranks; on 4 + 4 an even shard is half as large, and half the tokens
# keep it as large beside a sample's activations (module doc)
SEQ, FULL_SEQ = 8, 4
TARGETS = {"memory_bound_speedup": 1.15, "min_speedup_unbound": 0.98, "late_step_fraction": LATE_BUDGET}


def worker(rank: int, world: int, job: dict) -> dict:
    device, stage = job["devices"][rank], job["stage"]
    padded0, late0 = device.padded_steps, device.late_steps
    options = ProfileOptions(zero_stage=stage, escalate=False, repeats=job["repeats"], model_name=job["model"])
    prof = profile_rank(job["model_fn"], llama_loss_fn, job["sample_fn"], device,
                        optimizer_fn=default_optimizer, options=options, log=lambda m: None)
    plans = {"even": plan(prof, job["gbs"], stage, shards="even"),
             "planned": plan(prof, job["gbs"], stage, shards="auto")}
    same = rows_of(plans["even"]) == rows_of(plans["planned"]) and plans["planned"].even_shards
    runs = train(job, device, stage, {"even": plans["even"]} if same else plans, rank)
    out = {"runs": {s: runs["even" if same else s] for s in plans}, "same": same,
           "padded_steps": device.padded_steps - padded0, "late_steps": device.late_steps - late0}
    if rank == 0:
        out["plans"] = {s: p.to_dict() for s, p in plans.items()}
        out["profile"] = prof.to_dict()
    return out


def measured_s(per_rank: list[dict]) -> float:
    """The median over measured iterations of an iteration's period, averaged over the ranks."""
    ok = [i for i, m in enumerate(per_rank[0]["measured"]) if m]
    return statistics.median(statistics.fmean(pr["end"][i] - pr["end"][i - 1] for pr in per_rank) for i in ok)


def analyse(cluster: str, stage: int, regime: str, results: list[dict], gbs: int) -> dict[str, Any]:
    plans = {s: Plan.from_dict(d) for s, d in results[0]["plans"].items()}
    row: dict[str, Any] = {"cluster": cluster, "stage": stage, "regime": regime, "same_plan": results[0]["same"],
                           "padded_steps": sum(r["padded_steps"] for r in results),
                           "late_steps": sum(r["late_steps"] for r in results), "plans": {}}
    for s, p in plans.items():
        t = measured_s([r["runs"][s] for r in results])
        row["plans"][s] = {"rows": [list(x) for x in rows_of(p)], "weights": [r.shard_weight for r in p.ranks],
                           "measured_s": t, "samples_per_s": gbs / t, "predicted_s": p.predicted_iteration_s,
                           "micro_steps": max(r.num_micro_steps for r in p.ranks),
                           "loss": results[0]["runs"][s]["loss"]}
    pp = row["plans"]
    row["speedup"] = 1.0 if row["same_plan"] else pp["planned"]["samples_per_s"] / pp["even"]["samples_per_s"]
    row["predicted_speedup"] = pp["even"]["predicted_s"] / pp["planned"]["predicted_s"]
    row["max_loss_diff"] = max(abs(a - b) for a, b in zip(pp["even"]["loss"], pp["planned"]["loss"]))
    row["late_step_fraction"] = late_fraction(row["late_steps"], row["padded_steps"])
    row["shard_candidates"] = row_dicts(plans["planned"].choice.shard_candidates)
    row["profile"] = results[0]["profile"]  # to re-plan offline from the JSON
    row["memory"] = [{k: r.get(k) for k in ("device_type", "mbs", "base_bytes", "bytes_per_sample", "shard_bytes")}
                     for r in results[0]["profile"]["ranks"]]
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'cluster':<8}{'ZeRO':>5} {'regime':<8}{'even rows (b,gas,lbs)':<34}{'planned weights':<26}"
            f"{'even/s':>8}{'plan/s':>8}{'x':>6}{'pred x':>7}{'late':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        e, p = r["plans"]["even"], r["plans"]["planned"]
        weights = "same plan" if r["same_plan"] else ",".join(f"{w:.2f}" for w in p["weights"])
        even_rows = " ".join(f"{b},{g},{lb}" for _, b, g, lb in e["rows"])
        lines.append(f"{r['cluster']:<8}{r['stage']:>5} {r['regime']:<8}{even_rows:<34}{weights:<26}"
                     f"{e['samples_per_s']:>8.1f}{p['samples_per_s']:>8.1f}{r['speedup']:>6.2f}"
                     f"{r['predicted_speedup']:>7.2f}{100 * r['late_step_fraction']:>6.1f}%"
                     + ("" if r["valid"] else "  INVALID"))
    return "\n".join(lines)


def emulated_row(spec: ClusterSpec, stage: int, regime: str, args: argparse.Namespace, model_fn: Any, sample_fn: Any,
                 worker: Any, analyse: Any) -> dict[str, Any]:
    """One row: ``spec`` calibrated at ``stage`` so that its smallest card fits ``args.bound_mbs``
    samples at even shards ("bound") or the whole global batch ("unbound"), ``worker`` run on every
    emulated rank and its results ``analyse``d; run again (``args.attempts`` in all) while too many
    micro-steps were late, and marked ``valid`` when the last run held its speed."""
    target = args.bound_mbs if regime == "bound" else args.gbs

    def once(margin: float) -> tuple[dict, float]:
        with cluster_link(spec, "emulated", model_fn) as (link, _):
            pj = ProfileJob(model_fn, llama_loss_fn, sample_fn, default_optimizer, ProfileOptions())
            cal = calibrate(pj.at(Configuration(stage)), spec, link=link, margin=margin, target_min_mbs=target)
            devices = cluster_devices(spec, cal.memory_scale, cal.time_scale, None, link=link)
            print(f"# {spec.name} ZeRO-{stage} {regime}: memory scale {cal.memory_scale:.3g}, "
                  f"time scale {cal.time_scale:.3g}", file=sys.stderr, flush=True)
            job = {"model": f"llama-d{args.dim}x{args.layers}", "model_fn": model_fn, "sample_fn": sample_fn,
                   "stage": stage, "devices": devices, "repeats": args.repeats, "gbs": args.gbs, "seq": args.seq,
                   "warmup": args.warmup, "iterations": args.iterations, "rounds": args.rounds, "precision": None}
            results = spawn(worker, spec.world_size, (job,), timeout_s=3600, collective_timeout_s=900)
        row = analyse(spec.name, stage, regime, results, args.gbs)
        return row, row["late_step_fraction"]

    row, late, _ = until_on_time(f"{spec.name} ZeRO-{stage} {regime}", args.attempts, once)
    row["valid"] = late <= LATE_BUDGET
    return row


def row_arguments(ap: argparse.ArgumentParser, *, iterations: int, gbs: int, repeats: int, attempts: int) -> None:
    """The options of an ``emulated_row``: the regimes' memory, the run's length, the model."""
    ap.add_argument("--bound-mbs", type=int, default=1, help="the smallest card's samples at even shards when bound")
    ap.add_argument("--iterations", type=int, default=iterations, help="measured iterations per plan")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gbs", type=int, default=gbs)
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sample")
    ap.add_argument("--dim", type=int, default=256, help="model width")
    ap.add_argument("--layers", type=int, default=4, help="blocks")
    ap.add_argument("--repeats", type=int, default=repeats, help="profiler measurements per batch size")
    ap.add_argument("--attempts", type=int, default=attempts, help="runs of a row whose micro-steps were late")


def split_row_lists(ap: argparse.ArgumentParser, args: argparse.Namespace, regimes: tuple[str, ...],
                    clusters: Any) -> None:
    """``--stages``, ``--regimes`` and ``--clusters`` as lists, each checked against what the bench has."""
    args.stages = [int(s) for s in args.stages.split(",")]
    args.regimes = args.regimes.split(",")
    args.clusters = args.clusters.split(",")
    if not set(args.stages) <= {1, 2, 3} or not set(args.regimes) <= set(regimes) or not set(args.clusters) <= set(clusters):
        ap.error(f"--stages from 1,2,3; --regimes from {','.join(regimes)}; --clusters from {','.join(clusters)}")


def model_and_sample(args: argparse.Namespace) -> tuple[Any, Any]:
    """The rows' Llama-style model (``--dim``, ``--layers``, ``--seq``) and its sample function."""
    model_fn = functools.partial(LlamaModel, LlamaConfig(vocab_size=512, dim=args.dim, n_layers=args.layers,
                                                         n_heads=4, hidden_dim=4 * args.dim, max_seq_len=args.seq))
    return model_fn, functools.partial(sample, seq=args.seq)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="A,C", help="A and/or C")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--regimes", default="bound,unbound")
    # gbs 192: about one micro-batch of a big card at the bound, so every card takes part; a global
    # batch below one big card's micro-batch leaves the short cards a sample or two whatever their
    # shards
    row_arguments(ap, iterations=12, gbs=192, repeats=3, attempts=3)
    ap.add_argument("--full", action="store_true", help="4 + 4 ranks per cluster instead of 2 + 2")
    ap.add_argument("--json", default=None)
    ap.set_defaults(seq=None)
    args = ap.parse_args(argv)
    split_row_lists(ap, args, REGIMES, FULL)
    if args.seq is None:  # the model's tokens a sample (module doc: the same model on 4 + 4 ranks)
        args.seq = FULL_SEQ if args.full else SEQ
    return args


def run_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (cluster, stage, regime) row, in order, each written to ``args.json`` once measured."""
    t_start = time.perf_counter()
    model_fn, sample_fn = model_and_sample(args)
    rows = []
    for name in args.clusters:
        spec = FULL[name] if args.full else ClusterSpec.resolve(name)
        for stage in args.stages:
            for regime in args.regimes:
                row = emulated_row(spec, stage, regime, args, model_fn, sample_fn, worker, analyse)
                print(f"#   memory: {row['memory']}", file=sys.stderr, flush=True)
                for c in row["shard_candidates"] or []:
                    print(f"#   candidate {c['name']}: weights {[round(w, 2) for w in c['weights']]}, "
                          f"mbs {c.get('mbs')}, predicted {c['predicted_s']}", file=sys.stderr, flush=True)
                rows.append(row)
                if args.json:  # after every row: a long run stopped early keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump({"rows": rows}, f, indent=1)
                print(f"# {spec.name} ZeRO-{stage} {regime}: x{row['speedup']:.2f} "
                      f"({time.perf_counter() - t_start:.0f} s so far)", file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    """The RESULT of measured rows."""
    bound = [r["speedup"] for r in rows if r["regime"] == "bound"]
    unbound = [r["speedup"] for r in rows if r["regime"] == "unbound"]
    return {"memory_bound_speedup": min(bound) if bound else None,
            "min_speedup_unbound": min(unbound) if unbound else None,
            "late_step_fraction": late_fraction(sum(r["late_steps"] for r in rows),
                                                sum(r["padded_steps"] for r in rows)),
            "valid": all(r["valid"] for r in rows),
            "max_loss_diff": max(r["max_loss_diff"] for r in rows),
            "rows": [{k: r[k] for k in ("cluster", "stage", "regime", "speedup", "predicted_speedup", "same_plan")}
                     for r in rows],
            "ranks": "4+4" if args.full else "2+2", "seq": args.seq, "gbs": args.gbs, "iterations": args.iterations,
            "wall_s": round(wall_s, 1), "targets": TARGETS}


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    rows = run_rows(args)
    print(table(rows))
    result = summary(rows, args, time.perf_counter() - t_start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": result, "rows": rows}, f, indent=1)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
