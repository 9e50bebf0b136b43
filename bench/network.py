"""Clusters that span machines: today's flat collectives against auto mode with the topology, on
emulated clusters of two nodes, over an inter-node link where it binds and one where it hardly
matters.

Clusters (``poplar.emulation.cluster``): A-4+4 (a node of 4 A100-80G on NVLink beside a node of
4 A100-40G on PCIe 4) and C-4+4 (4 A800-80G on PCIe 4 beside 4 V100S-32G on PCIe 3), one spawned
process per rank, each with a ``VirtualDevice`` of its preset (memory and time scaled to the model
by ``calibrate_stages``, its compute padded to the preset's curve). The collectives ride the
cluster's virtual network (``poplar.emulation.virtual_network``): each node its own intra-node
link, both nodes' ports into one switch, at the declared speeds scaled to the model as the compute
is (``cluster_network``), no faster than this machine's gloo (the floor). The inter-node link is
``--networks`` (default eth-10g, where it binds, and ib-200g, where it hardly matters).

Per cluster x network x ZeRO stage (2 and 3): every rank profiles with the topology
(``ProfileOptions.topology``: the flat ring, each node's link and the cross-node one measured on
the emulated network), then two plans from that profile: ``flat`` (``collectives="flat"``: every
collective one ring over the 8 ranks, what Poplar did before it knew the nodes) and ``auto`` (the
planner's choice among flat, hierarchical and, at ZeRO-3, secondary shards; what auto mode runs);
with ``--forced`` also ``forced``, the hierarchical way (secondary shards at ZeRO-3) whatever its price.
Both train side by side on engines built with ``ZeroConfig(topology=...)``: in each of
``--rounds`` rounds each plan in turn (a different one first each round) runs ``--warmup`` entry
iterations and its share of ``--iterations`` measured ones on the same global batches. An
iteration's time is its period (previous end to its own, averaged over the ranks); medians over
the measured iterations. A pair whose plans are the same (auto chose flat with the same rows) is
one program: run once, ratio 1.00.

The machine sets every link's latency floor: a real gloo collective of 8 processes on 2 shared
cores takes 25-250 ms (the load decides), where a real link takes microseconds. Each extra step
of a hierarchical collective pays it, so at the calibrated time scale a small model's collectives
are latency-bound and flat is the faster way. ``--slowdown F`` runs the emulated cluster F times
slower than calibrated, compute and declared links alike (its ratios kept), so the bytes weigh F
times more against that floor, as they do on a real cluster.

Which GPUs take part (``subset_vs_best``; ``--subsets`` runs it alone). On C-4+4 at ZeRO-3 (each
network) every subset the planner considers (``planner.participation``: every GPU, each node
left out, each device type left out; each planned as the planner plans it, its own collectives
chosen) trains beside the others in the same rounds, and auto mode's choice is compared with the
best one measured. Over the slow link a node may be worth leaving out; over the fast one auto mode
must keep every GPU. A subset's iteration is timed on the ranks in its step. ``--subsets`` trains
auto mode's plan and the candidates only (no flat plan: no ``speedup_*``).

RESULT:
- ``speedup_link_bound``: min over the slow-network rows of flat time / auto time (target >= 1.5);
- ``speedup_link_free``: min over the fast-network rows (target >= 0.98);
- ``cross_node_bytes_vs_minimum``: the largest, over hierarchical rows and nodes, of a node's
  cross-node bytes per iteration from the ledger's CROSS records (summed over the node's ranks)
  over the minimum (1 - the node's share) x the buffer: every pass of the flat parameter space
  (each distinct (op, phase, micro-step) with a cross-node step) moves the model's parameter bytes
  once (target <= 1.05);
- ``subset_vs_best``: over the slow-network rows with subsets, the least of the best measured
  candidate's time / auto mode's time (auto's choice at that fraction of the best throughput;
  target >= 0.97); ``subset_keeps_all_fast``: auto mode kept every GPU in every fast-network row;
- ``median_prediction_err``: median over every row and plan of |predicted / measured - 1| (<= 0.10);
- ``late_step_fraction``: padded micro-steps whose real compute overshot the curve (<= 0.01),
  and ``late_collective_fraction`` likewise for the paced collectives.

    .venv/bin/python bench/network.py [--short] [--clusters A-4+4,C-4+4] [--networks eth-10g,ib-200g]
                                      [--stages 2,3] [--iterations 8] [--rounds 2] [--gbs 64] [--json PATH]
    .venv/bin/python bench/network.py --subsets [--short]     # subset_vs_best alone: C-4+4, ZeRO-3
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from poplar.process.launch import spawn
from poplar.emulation.calibration import calibrate_stages
from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.emulate import EmulatedCluster, cluster_devices
from poplar.emulation.link_calibration import measure_link
from poplar.emulation.speed_padding import LATE_BUDGET, late_fraction
from poplar.emulation.virtual_link import LinkSpec
from poplar.engine import PoplarEngine
from poplar.planner import participation, plan
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer, model_size, profile_rank
from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import LinkSpeed
from poplar.types.route import Collectives
from poplar.types.topology import Link, Topology
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.zero.config import ZeroConfig

VOCAB = 260  # the byte vocabulary of the small Llama sizes
TARGETS = {"speedup_link_bound": 1.5, "speedup_link_free": 0.98, "subset_vs_best": 0.97,
           "cross_node_bytes_vs_minimum": 1.05, "median_prediction_err": 0.10, "late_step_fraction": LATE_BUDGET}
SUBSETS_CLUSTER, SUBSETS_STAGE = "C-4+4", 3  # where the issue measures which GPUs take part
SUBSET = "subset: "  # the prefix of a candidate's name among a row's plans


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def sample(batch: int, seq: int) -> torch.Tensor:
    return tokens(batch, seq, 0)


def way(p: Plan) -> str:
    return "secondary" if p.collectives is Collectives.SECONDARY_SHARDS else p.collectives.value


def same_program(a: Plan, b: Plan) -> bool:
    rows = lambda p: [(r.micro_batch_size, r.accum_steps, r.last_batch_size, r.shard_weight)  # noqa: E731
                      for r in p.ranks]
    return way(a) == way(b) and rows(a) == rows(b)


def in_step(p: Plan) -> list[int]:
    """The ranks in the step (a rank left out has no samples)."""
    return [i for i, r in enumerate(p.ranks) if r.num_samples > 0]


def subset_plans(prof: Any, gbs: int, stage: int) -> dict[str, Plan]:
    """Every subset of ranks the planner considers for auto mode (``participation.subsets``),
    planned as it plans them: every GPU on the whole profile, a subset on the profile of its
    ranks (``on_ranks``), each choosing its own collectives, widened to every rank. A subset the
    planner cannot plan (its row in ``Plan.choice.participation_candidates`` says why) is left out."""
    out = {}
    for subset in participation.subsets(prof):
        try:
            if len(subset.keep) == prof.world_size:
                p = plan(prof, gbs, stage, participation="all")
            else:
                sub = plan(participation.on_ranks(prof, subset.keep), gbs, stage, participation="all")
                p = participation.widened(sub, subset.keep, prof)
        except PlanError:
            continue
        out[SUBSET + subset.name] = p
    return out


def cross_bytes(engine: PoplarEngine, iteration: int) -> tuple[int, int]:
    """This rank's cross-node bytes in ``iteration`` and the passes over the parameters that had
    a cross-node step (distinct op, phase and micro-step)."""
    records = [r for r in engine.comm_ledger.of(iteration=iteration) if r.link is Link.CROSS]
    return sum(r.bytes for r in records), len({(r.op, r.phase, r.micro_step) for r in records})


def train(job: dict, device: Any, stage: int, plans: dict[str, Plan], rank: int) -> dict[str, Any]:
    """Interleaved blocks of each plan (module doc); per iteration this rank's end time."""
    engines, out = {}, {}
    for name, p in plans.items():
        model = job["model_fn"]()
        engines[name] = PoplarEngine(model, default_optimizer(model), plan=p,
                                     zero_stage=ZeroConfig(stage, topology=job["topology"]))
        out[name] = {"end": [], "measured": [], "late": 0, "padded": 0, "cross": []}
    names = list(plans)
    per = -(-job["iterations"] // job["rounds"])
    for r in range(job["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            p, engine, rec = plans[name], engines[name], out[name]
            first = p.sample_offsets()[rank]
            batches = [tokens(job["gbs"], job["seq"], 1000 + len(rec["end"]) + i)[first:first + p.ranks[rank].num_samples]
                       for i in range(job["warmup"] + per)]
            late, padded = device.late_steps, device.padded_steps
            say = rank == in_step(p)[0]  # the plan's first rank in the step reports its progress
            with device.attach(engine):
                dist.barrier()
                for i, batch in enumerate(batches):
                    t0 = time.perf_counter()
                    engine.train_step(batch, llama_loss_fn)
                    rec["end"].append(time.perf_counter())
                    rec["measured"].append(i >= job["warmup"])
                    if say:
                        print(f"      round {r} {name}: iteration {i} {rec['end'][-1] - t0:.2f} s", file=sys.stderr,
                              flush=True)
            rec["late"] += device.late_steps - late
            rec["padded"] += device.padded_steps - padded
            rec["cross"].append(cross_bytes(engine, engine.iteration - 1))
    for engine in engines.values():
        engine.close()
    return out


def worker(rank: int, world: int, job: dict) -> dict:
    torch.set_num_threads(1)
    device = job["devices"][rank]
    out = {}
    for stage in job["stages"]:
        t0 = time.perf_counter()
        paced, late_c = device.link.paced_collectives, device.link.late_collectives
        options = ProfileOptions(zero_stage=stage, escalate=False, repeats=job["repeats"], model_name=job["model"],
                                 topology=job["topology"], max_batch=job["max_batch"],
                                 comm_sizes=(2 ** 12, 2 ** 14, 2 ** 16, job["param_bytes"]))  # up to the model's
        prof = profile_rank(job["model_fn"], llama_loss_fn, job["sample_fn"], device,
                            optimizer_fn=default_optimizer, options=options, log=lambda m: None)
        plans = {} if job["subsets_only"] else {"flat": plan(prof, job["gbs"], stage, collectives="flat")}
        plans["auto"] = plan(prof, job["gbs"], stage)
        if stage in job["subset_stages"]:
            plans.update(subset_plans(prof, job["gbs"], stage))
        if job.get("forced"):  # the hierarchical way whatever its price: its bytes and its time beside flat
            plans["forced"] = plan(prof, job["gbs"], stage, collectives="secondary_shards" if stage == 3 else "hierarchical")
        t1 = time.perf_counter()
        alias = {}  # a plan that is the same program as one before it is run once
        for k, p in plans.items():
            alias[k] = next((u for u in alias if alias[u] == u and same_program(plans[u], p)), k)
        if rank == 0:
            print(f"    ZeRO-{stage}: profile {t1 - t0:.0f} s; plans " + ", ".join(
                f"{k} ({way(p)}, rows {[(r.micro_batch_size, r.accum_steps, r.last_batch_size, r.shard_weight) for r in p.ranks]}, predicted "
                f"{p.predicted_iteration_s:.3f} s)" for k, p in plans.items() if alias[k] == k), file=sys.stderr, flush=True)
        runs = train(job, device, stage, {k: p for k, p in plans.items() if alias[k] == k}, rank)
        if rank == 0:
            print(f"    ZeRO-{stage}: profile {t1 - t0:.0f} s, training {time.perf_counter() - t1:.0f} s",
                  file=sys.stderr, flush=True)
        out[stage] = {"runs": {k: runs[alias[k]] for k in plans}, "alias": alias,
                      "paced_collectives": device.link.paced_collectives - paced,
                      "late_collectives": device.link.late_collectives - late_c,
                      "plans": {k: p.to_dict() for k, p in plans.items()},
                      "links": prof.comm.links.describe()}
    return out


def median_period(runs: list[dict], ranks: list[int]) -> float:
    """Median over the measured iterations of the period, averaged over ``ranks`` (those in the step)."""
    periods = []
    for i in range(1, len(runs[0]["end"])):
        if runs[0]["measured"][i]:
            periods.append(statistics.mean(runs[r]["end"][i] - runs[r]["end"][i - 1] for r in ranks))
    return statistics.median(periods)


def bytes_ratio(p: Plan, runs: list[dict], topology: Topology, param_bytes: int) -> float | None:
    """The largest over nodes of a node's cross-node bytes per iteration over its minimum."""
    if not p.collectives.hierarchical:
        return None
    weights = [r.shard_weight for r in p.ranks]
    worst = 0.0
    for node in topology.nodes:
        share = sum(weights[r] for r in node) / sum(weights)
        for block in range(len(runs[0]["cross"])):
            sent = sum(runs[r]["cross"][block][0] for r in node)
            passes = runs[node[0]]["cross"][block][1]
            if passes:
                worst = max(worst, sent / ((1 - share) * param_bytes * passes))
    return worst


def analyse(name: str, net: str, stage: int, results: list[dict], job: dict) -> dict:
    per = [res[stage] for res in results]
    plans = {k: Plan.from_dict(v) for k, v in per[0]["plans"].items()}
    row: dict[str, Any] = {"cluster": name, "network": net, "stage": stage, "links": per[0]["links"],
                           "alias": per[0]["alias"]}
    for k, p in plans.items():
        runs = [x["runs"][k] for x in per]
        measured = median_period(runs, in_step(p))
        row[k] = {"way": way(p), "left_out": [i for i in range(len(p.ranks)) if i not in in_step(p)],
                  "measured_s": measured, "predicted_s": p.predicted_iteration_s,
                  "err": abs(p.predicted_iteration_s / measured - 1), "samples_s": p.global_batch_size / measured,
                  "bytes_ratio": bytes_ratio(p, runs, job["topology"], job["param_bytes"]),
                  "late": sum(r["late"] for r in runs), "padded": sum(r["padded"] for r in runs)}
    if "flat" in plans:
        row["ratio"] = row["flat"]["measured_s"] / row["auto"]["measured_s"]
        row["same_plan"] = same_program(plans["auto"], plans["flat"])
    if "forced" in row and "flat" in row:
        row["forced"]["ratio"] = row["flat"]["measured_s"] / row["forced"]["measured_s"]
    subsets = [k for k in plans if k.startswith(SUBSET)]
    if subsets:
        best = min(row[k]["measured_s"] for k in subsets)
        for k in subsets:
            row[k]["vs_best"] = best / row[k]["measured_s"]
            row[k]["chosen"] = same_program(plans[k], plans["auto"])
        row["subset_vs_best"] = best / row["auto"]["measured_s"]
        row["keeps_all"] = not row["auto"]["left_out"]
    row["paced_collectives"] = sum(x["paced_collectives"] for x in per)
    row["late_collectives"] = sum(x["late_collectives"] for x in per)
    return row


def subset_table(rows: list[dict]) -> str:
    """Each subset the planner considered, measured side by side: time and throughput against the best."""
    head = ("| cluster | network | ZeRO | subset | left out | way | predicted (s) | measured (s) | best / this | "
            "auto's choice |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        for k in (k for k in r if k.startswith(SUBSET)):
            c = r[k]
            lines.append(f"| {r['cluster']} | {r['network']} | {r['stage']} | {k[len(SUBSET):]} | "
                         f"{','.join(map(str, c['left_out'])) or '-'} | {c['way']} | {c['predicted_s']:.3f} | "
                         f"{c['measured_s']:.3f} | {c['vs_best']:.3f} | {'yes' if c['chosen'] else ''} |")
        if "subset_vs_best" in r:
            lines.append(f"| | | | auto mode | {','.join(map(str, r['auto']['left_out'])) or '-'} | {r['auto']['way']} | "
                         f"{r['auto']['predicted_s']:.3f} | {r['auto']['measured_s']:.3f} | "
                         f"{r['subset_vs_best']:.3f} | |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    rows = [r for r in rows if "flat" in r]
    if not rows:
        return ""
    head = ("| cluster | network | ZeRO | flat iter (s) | auto: way | auto iter (s) | flat/auto | "
            "pred err flat / auto | cross bytes / min |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        f, a = r["flat"], r["auto"]
        ratio = "same plan" if r["same_plan"] else f"{r['ratio']:.2f}"
        br = f"{a['bytes_ratio']:.3f}" if a["bytes_ratio"] is not None else "-"
        lines.append(f"| {r['cluster']} | {r['network']} | {r['stage']} | {f['measured_s']:.3f} | {a['way']} | "
                     f"{a['measured_s']:.3f} | {ratio} | {f['err']:.3f} / {a['err']:.3f} | {br} |")
        if "forced" in r:
            h = r["forced"]
            lines.append(f"| | | | forced: | {h['way']} | {h['measured_s']:.3f} | {h['ratio']:.2f} | "
                         f"- / {h['err']:.3f} | {h['bytes_ratio']:.3f} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="A-4+4,C-4+4")
    ap.add_argument("--networks", default="eth-10g,ib-200g", help="slow (binding) first, then fast")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--iterations", type=int, default=12, help="measured iterations per plan")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gbs", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="profiler measurements per batch size")
    ap.add_argument("--max-batch", type=int, default=32, help="the capacity search stops here")
    ap.add_argument("--short", action="store_true", help="fewer iterations, rounds and repeats (8 ranks on 2 cores)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="run the emulated cluster this many times slower than calibrated (compute and links "
                         "alike): the machine's collective latency, the floor of every link, then weighs less")
    ap.add_argument("--collective-timeout", type=float, default=900.0, help="seconds a rank waits in a collective")
    ap.add_argument("--subsets", action="store_true",
                    help=f"only which GPUs take part: {SUBSETS_CLUSTER} at ZeRO-{SUBSETS_STAGE}, auto mode against every "
                         "subset the planner considers (no flat plan)")
    ap.add_argument("--no-subsets", action="store_true",
                    help=f"leave the subset candidates out of the {SUBSETS_CLUSTER} ZeRO-{SUBSETS_STAGE} rows")
    ap.add_argument("--forced", action="store_true",
                    help="also run the hierarchical way (secondary shards at ZeRO-3) whatever the planner chose")
    args = ap.parse_args()
    if args.short:
        args.iterations, args.rounds, args.repeats = 4, 2, 1
    if args.subsets:
        if args.no_subsets:
            ap.error("--subsets and --no-subsets exclude each other")
        args.stages = str(SUBSETS_STAGE)  # on --clusters given (default C-4+4: the measurement)
        args.clusters = args.clusters if args.clusters != ap.get_default("clusters") else SUBSETS_CLUSTER
    args.stages = [int(s) for s in args.stages.split(",")]
    args.networks = args.networks.split(",")
    if len(args.networks) != 2:
        ap.error("--networks takes two links: the slow one where the link binds, then the fast one")
    return args


def run_cluster(name: str, args: argparse.Namespace, model_fn: Any, sample_fn: Any) -> list[dict]:
    spec = ClusterSpec.resolve(name)
    param_bytes = model_size(model_fn())[1]
    fit = measure_link(spec.world_size, param_bytes)
    floor = LinkSpeed(fit["bandwidth_bytes_per_s"], fit["latency_s"])
    flat_link = LinkSpec.create(fit["latency_s"], fit["bandwidth_bytes_per_s"], spec.world_size)
    try:
        job = ProfileJob(model_fn, llama_loss_fn, sample_fn, default_optimizer, ProfileOptions(max_batch=args.max_batch))
        cal = calibrate_stages(job, spec, args.stages, link=flat_link)
    finally:
        flat_link.remove()
    rows = []
    time_scale = cal.time_scale * args.slowdown
    for net in args.networks:
        emulated = EmulatedCluster(spec.with_network(net), cal.memory_scale, time_scale)
        network = emulated.network(param_bytes, floor)
        print(f"# {name} over {net}: memory scale {cal.memory_scale:.3g}, time scale {time_scale:.3g}; "
              f"{network.describe()}", file=sys.stderr, flush=True)
        try:
            devices = cluster_devices(emulated.spec, cal.memory_scale, time_scale, link=network)
            job_d = {"model": "llama-tiny", "model_fn": model_fn, "sample_fn": sample_fn, "stages": args.stages,
                     "devices": devices, "repeats": args.repeats, "gbs": args.gbs, "seq": args.seq,
                     "warmup": args.warmup, "iterations": args.iterations, "rounds": args.rounds,
                     "topology": emulated.topology, "forced": args.forced, "max_batch": args.max_batch,
                     "param_bytes": param_bytes, "subsets_only": args.subsets,
                     "subset_stages": [SUBSETS_STAGE] if args.subsets or (name == SUBSETS_CLUSTER and not args.no_subsets)
                     else []}
            results = spawn(worker, spec.world_size, (job_d,), timeout_s=3600, collective_timeout_s=args.collective_timeout)
        finally:
            network.remove()
        if args.json:  # the ranks' raw measurements, kept before they are analysed
            with open(f"{args.json}.{name}.{net}.raw", "w") as f:
                json.dump(results, f)
        rows += [analyse(name, net, stage, results, job_d) for stage in args.stages]
    return rows


def plan_names(row: dict) -> list[str]:
    """The row's plans that were trained (flat, auto, forced, subsets), aliases included."""
    return [k for k in row if k in ("flat", "auto", "forced") or k.startswith(SUBSET)]


def summary(rows: list[dict], slow: str, fast: str) -> dict[str, Any]:
    ratios = [row[k]["bytes_ratio"] for row in rows for k in plan_names(row) if row[k]["bytes_ratio"] is not None]
    ran = [(row, k) for row in rows for k in plan_names(row) if row["alias"].get(k, k) == k]  # each run once
    late = sum(row[k]["late"] for row, k in ran)
    padded = sum(row[k]["padded"] for row, k in ran)
    least = lambda key, net: min((r[key] for r in rows if r["network"] == net and key in r), default=None)  # noqa: E731
    return {"speedup_link_bound": least("ratio", slow), "speedup_link_free": least("ratio", fast),
            "subset_vs_best": least("subset_vs_best", slow),
            "subset_keeps_all_fast": all(r["keeps_all"] for r in rows if r["network"] == fast and "keeps_all" in r)
            if any("keeps_all" in r for r in rows if r["network"] == fast) else None,
            "cross_node_bytes_vs_minimum": max(ratios) if ratios else None,
            "median_prediction_err": statistics.median(row[k]["err"] for row in rows for k in ("flat", "auto")
                                                       if k in row),
            "late_step_fraction": late_fraction(late, padded),
            "late_collective_fraction": late_fraction(sum(r["late_collectives"] for r in rows),
                                                      sum(r["paced_collectives"] for r in rows))}


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    model_fn = functools.partial(create_model, "llama-tiny", max_seq_len=args.seq)
    sample_fn = functools.partial(sample, seq=args.seq)
    rows = []
    for name in args.clusters.split(","):
        rows += run_cluster(name, args, model_fn, sample_fn)
        print(table(rows) + "\n" + subset_table(rows), file=sys.stderr, flush=True)
    result = summary(rows, *args.networks)
    result.update({"targets": TARGETS, "short": args.short, "wall_s": round(time.perf_counter() - t0, 1),
                   "rows": [{k: v for k, v in r.items() if k != "links"} for r in rows]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "result": result}, f, indent=1)
    print(table(rows))
    if any("subset_vs_best" in r for r in rows):
        print(subset_table(rows))
    for row in rows:
        print(f"# {row['cluster']} {row['network']} ZeRO-{row['stage']} links: " + "; ".join(row["links"]))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
