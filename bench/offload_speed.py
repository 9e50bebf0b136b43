"""Speed of auto mode's offload choice against no offload, measured side by side.

The planner prices per-rank CPU offload of the optimizer (``plan(..., offload="auto")``,
``poplar.planner.offload_pricing``): a rank offloads only where that lets the model fit or is
predicted faster. Where nothing needs offload it must keep every optimizer on its device and so
lose nothing; where memory binds it may offload a short card, and its prediction is checked
against the run.

Clusters, emulated as in ``bench/shard_speed.py`` (one gloo rank per GPU, a ``VirtualDevice`` per
rank with its preset's memory, speed curve and nominal host link, collectives on a virtual link
calibrated on this machine): A = A100-80G + A100-40G, C = A800-80G + V100S-32G, B = V100-16G +
T4-16G, 2 ranks each. Model: the Llama-style model of ``bench/shard_speed.py``; AdamW.

Per cluster x ZeRO stage x memory regime (``unbound``: the smallest card fits the whole global
batch at even shards; ``bound``: it fits ``--bound-mbs`` samples), every rank profiles (which
measures what offload costs it: the host link, here the preset's, and the host AdamW step per
element, real CPU work); then ``none`` = ``plan(profile, gbs, stage)`` and ``auto`` =
``plan(..., offload="auto")`` train side by side (interleaved rounds, each plan with its own
engine, the same global batches; an iteration's time is its period averaged over the ranks;
medians). Both run even when they are the same plan, so the ratio shows what a run measures.

``auto_over_none_unbound`` = the smallest auto ÷ none throughput over the unbound rows (target
>= 0.98). Last line ``RESULT {json}``.

    .venv/bin/python bench/offload_speed.py [--clusters A,C,B] [--stages 2] [--regimes unbound,bound]
                                            [--iterations 9] [--rounds 3] [--gbs 24]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from hetero import rows_of, train  # bench/ is on the path of a script run from it
from shard_speed import emulated_row, measured_s, model_and_sample, row_arguments, split_row_lists

from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.speed_padding import late_fraction
from poplar.planner import plan
from poplar.profiler.profile_run import ProfileOptions, default_optimizer, profile_rank
from poplar.types.plan_choice import row_dicts
from poplar.types.plans import Offload, Plan
from poplar.workloads.models import llama_loss_fn

CLUSTERS = {"A": ClusterSpec("A-1+1", [{"type": "A100-80G", "count": 1}, {"type": "A100-40G", "count": 1}]),
            "C": ClusterSpec("C-1+1", [{"type": "A800-80G", "count": 1}, {"type": "V100S-32G", "count": 1}]),
            "B": ClusterSpec("B-1+1", [{"type": "V100-16G", "count": 1}, {"type": "T4-16G", "count": 1}])}
REGIMES = ("unbound", "bound")
TARGETS = {"auto_over_none_unbound": 0.98}


def worker(rank: int, world: int, job: dict) -> dict:
    device, stage = job["devices"][rank], job["stage"]
    padded0, late0 = device.padded_steps, device.late_steps
    options = ProfileOptions(zero_stage=stage, escalate=False, repeats=job["repeats"], model_name=job["model"])
    prof = profile_rank(job["model_fn"], llama_loss_fn, job["sample_fn"], device,
                        optimizer_fn=default_optimizer, options=options, log=lambda m: None)
    plans = {"none": plan(prof, job["gbs"], stage), "auto": plan(prof, job["gbs"], stage, offload="auto")}
    runs = train(job, device, stage, plans, rank)
    out = {"runs": runs, "padded_steps": device.padded_steps - padded0, "late_steps": device.late_steps - late0}
    if rank == 0:
        out["plans"] = {s: p.to_dict() for s, p in plans.items()}
        out["costs"] = [r.offload_cost for r in prof.ranks]
    return out


def analyse(cluster: str, stage: int, regime: str, results: list[dict], gbs: int) -> dict[str, Any]:
    plans = {s: Plan.from_dict(d) for s, d in results[0]["plans"].items()}
    row: dict[str, Any] = {"cluster": cluster, "stage": stage, "regime": regime,
                           "same_plan": plans["none"].to_dict()["ranks"] == plans["auto"].to_dict()["ranks"],
                           "padded_steps": sum(r["padded_steps"] for r in results),
                           "late_steps": sum(r["late_steps"] for r in results), "plans": {}}
    for s, p in plans.items():
        t = measured_s([r["runs"][s] for r in results])
        row["plans"][s] = {"rows": [list(x) for x in rows_of(p)], "offloads": [o.value for o in p.offloads],
                           "measured_s": t, "samples_per_s": gbs / t, "predicted_s": p.predicted_iteration_s,
                           "loss": results[0]["runs"][s]["loss"]}
    pp = row["plans"]
    row["ratio"] = pp["auto"]["samples_per_s"] / pp["none"]["samples_per_s"]
    row["predicted_ratio"] = pp["none"]["predicted_s"] / pp["auto"]["predicted_s"]
    row["late_step_fraction"] = late_fraction(row["late_steps"], row["padded_steps"])
    row["placement_candidates"] = row_dicts(plans["auto"].choice.placement_candidates)
    row["costs"] = [vars(c) if c is not None else None for c in results[0]["costs"]]
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'cluster':<8}{'ZeRO':>5} {'regime':<9}{'none rows (b,gas,lbs)':<24}{'auto offloads':<26}"
            f"{'none/s':>8}{'auto/s':>8}{'x':>6}{'pred x':>7}{'late':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        n, a = r["plans"]["none"], r["plans"]["auto"]
        offl = ",".join("host" if o == Offload.OPTIMIZER.value else "dev" for o in a["offloads"])
        offl += " (same plan)" if r["same_plan"] else ""
        lines.append(f"{r['cluster']:<8}{r['stage']:>5} {r['regime']:<9}"
                     f"{' '.join(f'{b},{g},{lb}' for _, b, g, lb in n['rows']):<24}{offl:<26}"
                     f"{n['samples_per_s']:>8.1f}{a['samples_per_s']:>8.1f}{r['ratio']:>6.2f}"
                     f"{r['predicted_ratio']:>7.2f}{100 * r['late_step_fraction']:>6.1f}%"
                     + ("" if r["valid"] else "  INVALID"))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="A,C,B")
    ap.add_argument("--stages", default="2")
    ap.add_argument("--regimes", default="unbound")
    row_arguments(ap, iterations=9, gbs=24, repeats=2, attempts=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    split_row_lists(ap, args, REGIMES, CLUSTERS)
    return args


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    model_fn, sample_fn = model_and_sample(args)
    rows = []
    for name in args.clusters:
        spec = CLUSTERS[name]
        for stage in args.stages:
            for regime in args.regimes:
                row = emulated_row(spec, stage, regime, args, model_fn, sample_fn, worker, analyse)
                for c in row["placement_candidates"] or []:
                    print(f"#   candidate {c['shards']}/{c.get('offload')}: mbs {c.get('mbs')}, predicted "
                          f"{c['predicted_s']}, offload {c.get('offload_s')}", file=sys.stderr, flush=True)
                print(f"#   offload cost per rank: {row['costs']}", file=sys.stderr, flush=True)
                rows.append(row)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"rows": rows}, f, indent=1)
                print(f"# {spec.name} ZeRO-{stage} {regime}: x{row['ratio']:.3f} "
                      f"({time.perf_counter() - t_start:.0f} s so far)", file=sys.stderr, flush=True)
    print(table(rows))
    unbound = [r["ratio"] for r in rows if r["regime"] == "unbound"]
    result = {"auto_over_none_unbound": min(unbound) if unbound else None,
              "offloaded_unbound": sum(not r["same_plan"] for r in rows if r["regime"] == "unbound"),
              "late_step_fraction": late_fraction(sum(r["late_steps"] for r in rows),
                                                  sum(r["padded_steps"] for r in rows)),
              "valid": all(r["valid"] for r in rows),
              "rows": [{k: r[k] for k in ("cluster", "stage", "regime", "ratio", "predicted_ratio", "same_plan")}
                       for r in rows],
              "gbs": args.gbs, "iterations": args.iterations,
              "wall_s": round(time.perf_counter() - t_start, 1), "targets": TARGETS}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": result, "rows": rows}, f, indent=1)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
