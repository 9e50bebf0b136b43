"""``poplar plan`` and ``poplar simulate``: the planner and the simulator on the command line.

    poplar plan --profile profile.json --gbs 256 [--stage 2] [--strategy poplar] [-o plan.json]
    poplar simulate --cluster B --gbs 256 --stage 2 [--json sim.json]
    poplar simulate --cluster my_cluster.json --gbs 256 --stage 0
    poplar simulate --profile profile.json --gbs 256
"""

from __future__ import annotations

import argparse

from poplar.types.cluster import BUILTIN_CLUSTERS
from poplar.planner.planning import STRATEGIES, load_profile, plan
from poplar.planner.simulator import simulate


def _limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--require-all-ranks", action="store_true",
                   help="every rank must take at least one sample (default: a rank may sit out)")
    p.add_argument("--max-micro-steps", type=int, default=None, metavar="K",
                   help="at most K micro-steps per rank per iteration (default: unbounded)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="plan per-rank micro-batches from a profile",
                              description="Plan per-rank micro-batch, accumulation steps and last batch.")
    p.add_argument("--profile", required=True, help="profile JSON written by the profiler")
    p.add_argument("--gbs", type=int, required=True, help="global batch size (samples per optimizer step)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage (default: the profile's)")
    p.add_argument("--strategy", choices=STRATEGIES, default="poplar")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    _limits(p)
    p.set_defaults(func=_plan)

    s = subparsers.add_parser("simulate", help="compare strategies on a cluster or a profile",
                              description="Predicted throughput of poplar / even / flops on a cluster.")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--cluster", help=f"built-in cluster ({', '.join(BUILTIN_CLUSTERS)}) or a cluster JSON file")
    src.add_argument("--profile", help="a measured profile JSON instead of device presets")
    s.add_argument("--gbs", type=int, required=True, help="global batch size")
    s.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage (required with --cluster; default: the profile's)")
    s.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all)")
    s.add_argument("--json", default=None, help="write the comparison (with every plan) as JSON here")
    _limits(s)
    s.set_defaults(func=_simulate)


def _plan(args: argparse.Namespace) -> int:
    result = plan(args.profile, args.gbs, args.stage, args.strategy, require_all_ranks=args.require_all_ranks,
                  max_micro_steps=args.max_micro_steps)
    print(f"strategy {result.strategy}, ZeRO-{result.zero_stage}")
    print(result.table())
    print(f"predicted {result.meta['predicted_samples_per_s']:.2f} samples/s, communication "
          f"{result.predicted_comm_s:.4f} s of {result.predicted_iteration_s:.4f} s, "
          f"{result.max_micro_steps} micro-steps")
    if args.output:
        result.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    strategies = [x.strip() for x in args.strategies.split(",") if x.strip()]
    unknown = [x for x in strategies if x not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    source = args.cluster if args.cluster else load_profile(args.profile)
    sim = simulate(source, args.gbs, args.stage, strategies,
                   require_all_ranks=args.require_all_ranks, max_micro_steps=args.max_micro_steps)
    print(sim.table())
    if args.json:
        sim.save(args.json)
        print(f"wrote {args.json}")
    return 0
