"""``poplar simulate``: what-if questions on the planner's cost model, answered directly.

    poplar simulate --cluster B --gbs 256 --stage 2                     # poplar vs even vs flops
    poplar simulate --cluster B --gbs 256 --stage 2 --add T4-16G:2      # does adding 2 T4 help?
    poplar simulate --cluster A --gbs 256 --stage auto --model llama-1.1b
    poplar simulate --cluster my_cluster.json --gbs 256 --stage 0 --model path/to/config.json
    poplar simulate --profile profile.json --gbs 256 [--stage auto]
    poplar simulate --cluster C8.json --gbs 256 --stage 3 --nodes 4,4 --intra-gbps 16 --inter-gbps 100gbit

A cluster (built-in name or JSON) is priced from its devices' presets (``poplar.emulation.presets``)
for a model (``--model``: the presets' reference workload by default, a built-in model name or a
Hugging Face config.json, ``poplar.cli.model_specs``). ``--add TYPE:N[,TYPE:N]`` simulates the
cluster with N more devices of each TYPE beside the cluster as it is. ``--stage auto`` shows the
candidate table (ZeRO stage x activation checkpointing: fits, mbs per device type, predicted
iteration, why rejected) and simulates the fastest; from a profile it shows the table auto mode
saved with it. ``--nodes`` groups the cluster's ranks into nodes with their own links and a
link between them, and asks whether the last node is worth adding (``poplar.cli.simulate_nodes``):
flat against hierarchical collectives, with and without it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from poplar.cli.model_specs import PlanningModel, resolve_model
from poplar.cli.plan import add_limits, stage_arg
from poplar.cli.simulate_nodes import add_node_args, rows_json, simulate_nodes
from poplar.emulation.cluster import BUILTIN_CLUSTERS, ClusterSpec
from poplar.emulation.presets import get_preset
from poplar.emulation.what_if import preset_candidates, simulate
from poplar.planner.candidates import CandidateRow, choose, format_table, marked, recorded_candidates
from poplar.planner.planning import STRATEGIES, load_profile
from poplar.planner.simulator import Simulation
from poplar.types.plans import write_text_atomic


def register(subparsers: argparse._SubParsersAction) -> None:
    s = subparsers.add_parser("simulate", help="what-if: strategies, configurations and added devices, predicted",
                              description="Predicted throughput of poplar / even / flops on a cluster or a profile; "
                                          "with --add, beside the cluster grown by some devices; with --stage auto, "
                                          "every ZeRO stage x activation checkpointing candidate; with --nodes, the "
                                          "cluster as nodes with their links, flat against hierarchical "
                                          "collectives, with and without its last node (is adding that node worth "
                                          "it?). Bandwidths are in GB/s, or Gbit/s with a gbit suffix.")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--cluster", help=f"built-in cluster ({', '.join(BUILTIN_CLUSTERS)}) or a cluster JSON file")
    src.add_argument("--profile", help="a measured profile JSON instead of device presets")
    s.add_argument("--gbs", type=int, required=True, help="global batch size")
    s.add_argument("--stage", type=stage_arg, default=None, metavar="{0,1,2,3,auto}",
                   help="ZeRO stage, or auto: the candidate table and the fastest candidate "
                        "(required with --cluster; default: the profile's)")
    s.add_argument("--add", default=None, metavar="TYPE:N[,TYPE:N]",
                   help="also simulate the cluster with N more devices of preset TYPE (e.g. T4-16G:2), side by side")
    s.add_argument("--model", default=None,
                   help="reference (default), a built-in model (llama-0.5b, llama-1.1b, bert-base, bert-large, ...) "
                        "or a Hugging Face config.json (with --cluster)")
    s.add_argument("--seq", type=int, default=None, help="sequence length for --model (default: the model's)")
    s.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all)")
    s.add_argument("--json", default=None, help="write the comparison (with every plan) as JSON here")
    add_limits(s)
    add_node_args(s)
    s.set_defaults(func=_simulate)


def grown(spec: ClusterSpec, add: str) -> ClusterSpec:
    """``spec`` with the devices of ``add`` ("T4-16G:2,A100-80G:1") appended (a type it has: more of it)."""
    devices = [{"type": d.type, "count": d.count} for d in spec.devices]
    added = []
    for item in (x.strip() for x in add.split(",") if x.strip()):
        name, _, count = item.partition(":")
        try:
            n = int(count or "1")
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--add {item!r}: give TYPE:N with N >= 1, e.g. T4-16G:2")
        get_preset(name)  # an unknown type names the known ones
        same = next((d for d in devices if d["type"] == name), None)
        if same:
            same["count"] += n
        else:
            devices.append({"type": name, "count": n})
        added.append(f"{n}x{name}")
    if not added:
        raise ValueError("--add needs TYPE:N, e.g. T4-16G:2")
    return ClusterSpec.from_dict({**spec.to_dict(), "name": f"{spec.name}+{'+'.join(added)}", "devices": devices})


def _strategies(text: str) -> list[str]:
    strategies = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in strategies if x not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    return strategies


def _candidates(spec: ClusterSpec, args: argparse.Namespace, model: PlanningModel,
                limits: dict[str, Any]) -> tuple[list[CandidateRow], str]:
    """The cluster's candidate rows, the fastest chosen, and the first fit's name."""
    rows = preset_candidates(spec, args.gbs, model.plain, model.checkpointed, **limits)
    first = choose(rows, "first_fit").name if any(r.fits and r.predicted_s for r in rows) else "-"
    return marked(rows, "fastest"), first


def _cluster_case(spec: ClusterSpec, args: argparse.Namespace, model: PlanningModel, strategies: list[str],
                  limits: dict[str, Any]) -> dict[str, Any]:
    """One cluster: (auto) its candidate table and chosen configuration, and the simulation there."""
    case: dict[str, Any] = {"cluster": spec.describe(), "ranks": spec.world_size}
    stage, ckpt = args.stage, False
    if stage == "auto":
        rows, first = _candidates(spec, args, model, limits)
        best = next(r for r in rows if r.chosen)
        stage, ckpt = best.stage, best.checkpointing
        case.update(rows=rows, first_fit=first)
    case["config"] = f"ZeRO-{stage}{' +ckpt' if ckpt else ''}"
    case["sim"] = simulate(spec, args.gbs, stage, strategies, model=model.spec(ckpt), **limits)
    return case


def _side_by_side(cases: list[dict[str, Any]], strategies: list[str], add: str) -> str:
    heads = ["", "current"] + [f"with --add {add}"] * (len(cases) - 1)
    lines = [["cluster"] + [c["cluster"] for c in cases],
             ["ranks"] + [str(c["ranks"]) for c in cases],
             ["configuration"] + [c["config"] for c in cases]]
    if "first_fit" in cases[0]:
        lines.append(["first fit"] + [c["first_fit"] for c in cases])
    base = cases[0]["sim"]
    for name in strategies:
        cells = []
        for c in cases:
            r = c["sim"].result(name)
            x = r.samples_per_s / base.result(name).samples_per_s if r.plan and base.result(name).plan else None
            cells.append("-" if not r.plan else f"{r.samples_per_s:.2f}" + (f" ({x:.2f}x)" if c is not cases[0] else ""))
        lines.append([f"{name} samples/s"] + cells)
    widths = [max(len(x) for x in col) for col in zip(heads, *lines)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in [heads, *lines])


def _simulate(args: argparse.Namespace) -> int:
    strategies = _strategies(args.strategies)
    limits = {"require_all_ranks": args.require_all_ranks, "max_micro_steps": args.max_micro_steps}
    if args.profile:
        if args.nodes or args.intra_gbps or args.inter_gbps:
            raise ValueError("--nodes, --intra-gbps and --inter-gbps describe a cluster of presets: use them with "
                             "--cluster (a profile that spans nodes holds its measured links and is planned on them)")
        if args.add or args.model or args.seq:
            raise ValueError("--add, --model and --seq price devices from their presets: use them with --cluster, "
                             "not --profile (a profile holds measured curves of one cluster and model)")
        return _simulate_profile(args, strategies, limits)
    if args.stage is None:
        raise ValueError("simulating a cluster needs --stage (0-3, or auto for the candidate table)")
    model = resolve_model(args.model, args.seq)
    spec = ClusterSpec.resolve(args.cluster)
    if args.nodes:
        return _simulate_nodes(args, spec, model, limits)
    if args.intra_gbps or args.inter_gbps:
        raise ValueError("--intra-gbps and --inter-gbps are the links of --nodes: give the ranks per node too")
    cases = [_cluster_case(spec, args, model, strategies, limits)]
    if args.add:
        cases.append(_cluster_case(grown(spec, args.add), args, model, strategies, limits))
    print(f"model {model.description}; global batch {args.gbs}")
    if len(cases) > 1:
        print(_side_by_side(cases, strategies, args.add))
    for c in cases:
        print()
        if "rows" in c:
            print(f"candidates on {c['cluster']} (predicted from presets; first fit {c['first_fit']}):")
            print(format_table(c["rows"]))
            print()
        print(c["sim"].table())
    if args.json:
        out = [{"config": c["config"], **c["sim"].to_dict(),
                **({"candidates": [r.to_dict() for r in c["rows"]], "first_fit": c["first_fit"]} if "rows" in c else {})}
               for c in cases]
        write_text_atomic(args.json, json.dumps(out[0] if len(out) == 1 else {"current": out[0], "with_add": out[1]},
                                                indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _simulate_nodes(args: argparse.Namespace, spec: ClusterSpec, model: PlanningModel, limits: dict[str, Any]) -> int:
    if args.add:
        raise ValueError("--nodes asks about the cluster's last node; describe the grown cluster in the cluster file "
                         "instead of --add")
    text, rows = simulate_nodes(args, spec, model.plain, limits)
    print(f"model {model.description}; global batch {args.gbs}")
    print(text)
    if args.json:
        write_text_atomic(args.json, json.dumps(rows_json(rows), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _simulate_profile(args: argparse.Namespace, strategies: list[str], limits: dict[str, Any]) -> int:
    profile = load_profile(args.profile)
    rows = None
    if args.stage == "auto":
        rows = recorded_candidates(profile, args.gbs, **limits)
        print(f"candidates auto mode profiled (the profile is the choice's; others are lower bounds from it):\n"
              f"{format_table(rows)}\n")
    sim: Simulation = simulate(profile, args.gbs, None if args.stage == "auto" else args.stage, strategies, **limits)
    print(sim.table())
    if args.json:
        out = sim.to_dict() | ({"candidates": [r.to_dict() for r in rows]} if rows else {})
        write_text_atomic(args.json, json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
