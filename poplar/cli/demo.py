"""`poplar demo`: the main job on one CPU machine. It spawns an emulated heterogeneous cluster
(default: the paper's cluster B shape, 2 x V100-16G + 2 x T4-16G, one process per GPU, each a
``VirtualDevice`` with that GPU's memory and speed scaled to a CPU-sized model), and every rank
runs auto mode: profile, plan, train a small Llama-style model on the text shipped with Poplar.
Then the same engine trains as many iterations under the ``even`` plan (equal shares, the
micro-batch of the smallest GPU: what DeepSpeed runs), and the demo prints measured throughput
of both plans and predicted vs measured iteration time. Reports go to ``--report-dir``.
``--precision bf16|fp16`` trains (and profiles) in mixed precision; the emulated GPUs then run at
their presets' bf16 / fp16 speed. Cluster B's V100 and T4 have no bf16: there bf16 is refused
with the reason, and fp16 works.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from poplar.process.launch import spawn
from poplar.emulation.speed_padding import LATE_BUDGET, late_fraction


def _rank_main(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    from poplar.auto import AutoOptions
    from poplar.emulation import cluster_device
    from poplar.engine import PoplarEngine
    from poplar.train import ReportOptions, fit
    from poplar.workloads.models import create_model, llama_loss_fn
    from poplar.planner import plan as make_plan
    from poplar.workloads.text import TextBlocks

    torch.manual_seed(args["seed"])
    data = TextBlocks(seq_len=args["seq_len"])
    model = create_model(args["model"], seed=args["seed"], max_seq_len=args["seq_len"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args["lr"])
    t0 = time.perf_counter()
    device = cluster_device(args["cluster"], rank)  # this rank's GPU of the cluster, emulated
    engine = PoplarEngine(model, optimizer, zero_stage=zero_config(args["cluster"], args["stage"]),
                          global_batch_size=args["gbs"],
                          loss_fn=llama_loss_fn, max_grad_norm=1.0, mixed_precision=args["precision"],
                          auto=AutoOptions(profile_data=data, device=device, repeats=2))
    setup_s = time.perf_counter() - t0
    report = args["report_dir"]
    results = {"setup_s": setup_s, "profile": engine.profile.to_dict()}
    for i, strategy in enumerate(("poplar", "even")):
        if strategy != "poplar":
            engine.set_plan(make_plan(engine.profile, args["gbs"], engine.zero_stage, strategy))
            if rank == 0:
                print(f"\n[poplar] switching to the {strategy} plan for comparison:\n{engine.plan.table()}",
                      file=sys.stderr, flush=True)
        late0, padded0 = device.late_steps, device.padded_steps
        result = fit(engine, data, (i + 1) * args["iterations"],
                     report=ReportOptions(f"{report}/{strategy}" if report else None, log_every=args["log_every"]))
        late, padded = device.late_steps, device.padded_steps
        results[strategy] = {"plan": engine.plan.to_dict(), "fit": result.to_dict(),
                             "late_steps": late - late0, "padded_steps": padded - padded0}
    engine.close()
    return results


def zero_config(cluster: Any, stage: int) -> Any:
    """The engine's ZeRO config on an emulated cluster (a ``ClusterSpec``): at ``stage``, with the
    cluster's machines where it spans several, so the profiler measures each link and the planner
    may choose hierarchical collectives (the devices' collectives ride the cluster's network:
    ``ClusterDevice``)."""
    from poplar.zero.config import ZeroConfig

    nodes = cluster.topology()
    return ZeroConfig(stage, topology=nodes if nodes.spans_nodes else None)


def run(cluster: str = "B", stage: int = 2, gbs: int = 64, iterations: int = 30, model: str = "llama-tiny",
        seq_len: int = 64, report_dir: str | None = "runs/demo", log_every: int = 10,
        precision: str = "fp32") -> dict[str, Any]:
    from poplar.emulation.cluster import ClusterSpec
    from poplar.types.precision import precision_of

    spec = ClusterSpec.resolve(cluster)
    precision = str(precision_of(precision))
    spec.check_precision(precision)  # bf16 on cluster B's V100 / T4: the reason, before any process starts
    print(f"Poplar demo: {spec.describe()} emulated on this CPU ({spec.world_size} processes, gloo), "
          f"{model}, ZeRO-{stage}, {precision}, global batch {gbs}, {iterations} iterations per plan\n", flush=True)
    t0 = time.perf_counter()
    args = {"cluster": spec, "stage": stage, "gbs": gbs, "iterations": iterations, "model": model,
            "seq_len": seq_len, "lr": 3e-3, "seed": 0, "report_dir": report_dir, "log_every": log_every,
            "precision": precision}
    everyone = spawn(_rank_main, spec.world_size, (args,), timeout_s=1200, collective_timeout_s=300)
    out = everyone[0]
    for strategy in ("poplar", "even"):  # every rank's devices: did the emulation hold its speed?
        out[strategy]["late_steps"] = sum(o[strategy]["late_steps"] for o in everyone)
        out[strategy]["padded_steps"] = sum(o[strategy]["padded_steps"] for o in everyone)
    print(summary(out))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s (profiling and planning {out['setup_s']:.0f} s)"
          + (f"; reports (plan, profile, metrics, Perfetto trace, curves) in {report_dir}/" if report_dir else ""))
    return out


def summary(out: dict[str, Any]) -> str:
    rows = []
    head = f"{'plan':<8} {'samples/s':>10} {'iteration s':>12} {'predicted s':>12} {'error':>7}   per rank: b x gas + lbs"
    rows += [head, "-" * len(head)]
    for strategy in ("poplar", "even"):
        fit, plan = out[strategy]["fit"], out[strategy]["plan"]
        shape = ", ".join(f"{r['micro_batch_size']}x{r['accum_steps']}+{r['last_batch_size']}" for r in plan["ranks"])
        err = fit["prediction_error"]
        rows.append(f"{strategy:<8} {fit['samples_per_s']:>10.1f} {fit['median_iteration_s']:>12.4f} "
                    f"{fit['predicted_iteration_s']:>12.4f} {err:>+7.1%}   {shape}")
    speedup = out["poplar"]["fit"]["samples_per_s"] / out["even"]["fit"]["samples_per_s"]
    losses = out["poplar"]["fit"]["losses"] + out["even"]["fit"]["losses"]
    late = {s: late_fraction(out[s].get("late_steps", 0), out[s].get("padded_steps", 0)) for s in ("poplar", "even")}
    if max(late.values()) > LATE_BUDGET:
        worst = max(late, key=late.get)
        rows.append(f"\nthe emulation did NOT hold its speed: {100 * late[worst]:.1f}% of the {worst} run's micro-steps "
                    f"were late (their real CPU compute overran the emulated GPU time; budget "
                    f"{100 * LATE_BUDGET:.0f}%), so the ratio below and the prediction errors above measure this "
                    f"machine's load, not the plans; run again on a quieter machine")
    rows.append(f"\nthroughput poplar / even: {speedup:.2f}x (measured side by side, medians after warm-up)"
                + ("" if max(late.values()) <= LATE_BUDGET else " -- NOT VALID, see above")
                + f"; late micro-steps: poplar {100 * late['poplar']:.1f}%, even {100 * late['even']:.1f}%")
    rows.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} iterations")
    prof = out["profile"]
    rows.append(f"profiled at {prof['precision']}: mbs per rank "
                + ", ".join(f"{r['device_type']} {r['mbs']}" for r in prof["ranks"]))
    return "\n".join(rows)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="profile, plan and train on an emulated heterogeneous cluster (CPU)",
                       description=__doc__.split("\n\n")[0].replace("`", "") if __doc__ else None)
    p.add_argument("--cluster", default="B", help="built-in cluster (A, B, C, C-1:3, D) or a cluster JSON file")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--gbs", type=int, default=64, help="global batch size")
    p.add_argument("--iterations", type=int, default=30, help="iterations per plan")
    p.add_argument("--model", default="llama-tiny", help="llama-tiny, llama-small, ...")
    p.add_argument("--report-dir", default="runs/demo", help="where reports go ('' for none)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="compute precision (bf16/fp16: mixed precision with fp32 master weights; cluster B's "
                        "V100 and T4 have no bf16)")
    p.set_defaults(func=lambda a: 0 if run(a.cluster, a.stage, a.gbs, a.iterations, a.model,
                                           report_dir=a.report_dir or None, precision=a.precision) else 1)
