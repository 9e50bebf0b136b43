"""``poplar plan``: the planner on the command line (``poplar simulate`` is in ``poplar.cli.simulate``).

    poplar plan --profile profile.json --gbs 256 [--stage 2] [--strategy poplar] [-o plan.json]
    poplar plan --profile auto_profile.json --gbs 256 --stage auto
    poplar plan --profile two_nodes.json --gbs 256 --stage 3 --allow-lossy

``--stage auto`` reads a profile that auto mode saved (``AutoOptions(profile_output=...)``): it
shows the candidate table (ZeRO stage x activation checkpointing: fits, mbs per device type,
predicted iteration at this global batch, why rejected) and plans the chosen configuration.
``--allow-lossy`` lets the plan quantize collectives across nodes where that is predicted faster
than exact by more than the tie (a profile whose links span nodes; ``planner.compression_choice``):
the table says each option's predicted iteration and which was kept.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from poplar.planner.candidates import format_table, recorded_candidates
from poplar.planner.planning import STRATEGIES, CollectivesRequest, load_profile, plan
from poplar.types.plans import shard_weights_problem


def stage_arg(text: str) -> int | str:
    """A ``--stage`` value: 0-3, or "auto"."""
    if text == "auto":
        return text
    if text in ("0", "1", "2", "3"):
        return int(text)
    raise argparse.ArgumentTypeError(f"invalid stage {text!r}: choose 0, 1, 2, 3 or auto")


def shards_arg(text: str) -> str | tuple[float, ...]:
    """A ``--shards`` value: even, auto, or comma-separated weights (one per rank)."""
    if text in ("even", "auto"):
        return text
    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        weights = ()
    if shard_weights_problem(weights) is not None:
        raise argparse.ArgumentTypeError(f"invalid shards {text!r}: choose even, auto or one weight >= 0 per rank, "
                                         "comma-separated (not all 0)")
    return weights


def add_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--require-all-ranks", action="store_true",
                   help="every rank must take at least one sample (default: a rank may sit out)")
    p.add_argument("--max-micro-steps", type=int, default=None, metavar="K",
                   help="at most K micro-steps per rank per iteration (default: unbounded)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="plan per-rank micro-batches from a profile",
                              description="Plan per-rank micro-batch, accumulation steps and last batch.")
    p.add_argument("--profile", required=True, help="profile JSON written by the profiler")
    p.add_argument("--gbs", type=int, required=True, help="global batch size (samples per optimizer step)")
    p.add_argument("--stage", type=stage_arg, default=None, metavar="{0,1,2,3,auto}",
                   help="ZeRO stage (default: the profile's); auto: the candidate table of a profile auto mode "
                        "saved, and the plan of its choice")
    p.add_argument("--strategy", choices=STRATEGIES, default="poplar")
    p.add_argument("--shards", type=shards_arg, default="even", metavar="{even,auto,W0,W1,...}",
                   help="each rank's share of the sharded state: even (default), auto (chosen with the batches "
                        "from the profile's memory) or one weight per rank")
    p.add_argument("--offload", choices=("none", "auto"), default="none",
                   help="where each rank's optimizer lives: none (on its device, default) or auto (in host memory "
                        "where that lets the model fit or is predicted faster, priced from the profile)")
    p.add_argument("--allow-lossy", action="store_true",
                   help="quantized collectives across nodes (int8; lossy) where predicted faster than exact by more "
                        "than the tie (a profile whose links span nodes)")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    add_limits(p)
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    limits = {"require_all_ranks": args.require_all_ranks, "max_micro_steps": args.max_micro_steps}
    stage = args.stage
    rows = None
    if stage == "auto":
        profile = load_profile(args.profile)
        rows = recorded_candidates(profile, args.gbs, **limits)
        print(f"candidates auto mode profiled (the profile is the choice's; others are lower bounds from it):\n"
              f"{format_table(rows)}\n")
        stage = profile.zero_stage
    result = plan(args.profile, args.gbs, stage, args.strategy, shards=args.shards, offload=args.offload,
                  collectives=CollectivesRequest(allow_lossy=args.allow_lossy), **limits)
    if rows is not None:
        result.choice = replace(result.choice, candidates=tuple(rows))
    print(f"strategy {result.strategy}, ZeRO-{result.zero_stage}")
    print(result.table())
    print(f"predicted {result.predicted_samples_per_s:.2f} samples/s, communication "
          f"{result.predicted_comm_s:.4f} s of {result.predicted_iteration_s:.4f} s, "
          f"{result.max_micro_steps} micro-steps")
    record = result.choice.compression_choice
    for row in record.candidates if record is not None else ():
        said = f"{row.predicted_s:.4f} s" if row.predicted_s is not None else f"no plan ({row.reason})"
        print(f"  {row.policy.describe()}: {said}" + (" <- kept" if row.policy == record.chosen else ""))
    if args.output:
        result.save(args.output)
        print(f"wrote {args.output}")
    return 0
