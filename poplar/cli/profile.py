"""`poplar profile`: profile a built-in model on an emulated cluster of preset GPUs (CPU only),
print a summary table and write the Profile JSON.

    poplar profile --cluster B --stage 2 -o profile.json

Progress goes to stderr, the summary to stdout. With ``--config run.json`` (launched as
``poplar train`` is, with torchrun) it is instead the start of that training job up to its plan:
the profile store (``poplar.profiler.store``) is filled for the job's cluster ahead of time, and
the job's own start then profiles nothing.
"""

from __future__ import annotations

import argparse
import sys

from poplar.types.profiles import Profile


def register(subparsers: argparse._SubParsersAction) -> None:
    from poplar.workloads import DEFAULT_WORKLOAD, WORKLOADS

    p = subparsers.add_parser(
        "profile", help="measure each rank's largest micro-batch and speed curve (emulated cluster on CPU)",
        description="Profile a built-in model on an emulated cluster: one process per rank, each with a "
                    "virtual device made from its preset (memory and speed scaled to the CPU model).")
    p.add_argument("--cluster", default=None, help="built-in cluster name (A, B, C, C-1:3, D) or a cluster JSON file")
    p.add_argument("--config", default=None,
                   help="a `poplar train` config: profile its job (every rank, launched with torchrun) into the "
                        "profile store and stop before training")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage (raised automatically if batch 1 does not fit on some rank)")
    p.add_argument("--model", choices=list(WORKLOADS), default=DEFAULT_WORKLOAD,
                   help=f"built-in workload (default {DEFAULT_WORKLOAD}): "
                        + "; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values()))
    p.add_argument("-o", "--output", default=None, help="write the profile JSON here")
    p.add_argument("--memory-scale", default="auto",
                   help="preset memory x this (default auto: the smallest device fits a batch of ~8)")
    p.add_argument("--time-scale", default="auto",
                   help="preset step time x this (default auto: above the CPU's real compute)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per timed batch size")
    p.add_argument("--max-batch", type=int, default=4096, help="stop the capacity search here")
    p.add_argument("--no-escalate", action="store_true", help="fail instead of raising the ZeRO stage")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_profile)


def _scale(value: str, name: str) -> float | str:
    if value == "auto":
        return value
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"--{name} must be a positive number or 'auto', got {value!r}") from None
    if not x > 0:
        raise ValueError(f"--{name} must be > 0, got {value}")
    return x


def _profile(args: argparse.Namespace) -> int:
    import time

    from poplar.emulation import Scales, profile_cluster
    from poplar.profiler import ProfileOptions
    from poplar.workloads import get_workload

    started = time.perf_counter()
    if args.config is not None:
        from poplar.cli import train

        args.plan_only, args.iterations = True, None
        return train._main(args)
    if args.cluster is None:
        raise ValueError("give --cluster (a built-in cluster or a cluster file) or --config (a training job's config)")
    if args.repeats < 1 or args.max_batch < 1:
        raise ValueError("--repeats and --max-batch must be >= 1")
    w = get_workload(args.model)
    options = ProfileOptions(zero_stage=args.stage, escalate=not args.no_escalate, max_batch=args.max_batch,
                             repeats=args.repeats, model_name=w.name, progress=not args.quiet)
    scales = Scales(_scale(args.memory_scale, "memory-scale"), _scale(args.time_scale, "time-scale"))
    result = profile_cluster(w.model_fn, w.loss_fn, w.sample_fn, cluster=args.cluster, options=options,
                             scales=scales, output=args.output)
    print(summary(result))
    if not args.quiet:  # the command's wall time: calibration and process start-up included
        print(f"[poplar profile] command done in {time.perf_counter() - started:.1f} s (profiling in the ranks "
              f"{result.measurement.seconds:.1f} s)", file=sys.stderr)
    if args.output:
        print(f"profile written to {args.output}", file=sys.stderr)
    return 0


def summary(profile: Profile) -> str:
    """A readable table: one row per rank."""
    lines = [f"model {profile.model_name or '?'}: {profile.param_count:,} parameters; ZeRO-{profile.zero_stage}"
             + (f" (asked {asked})" if (asked := profile.measurement.requested_stage) not in (None, profile.zero_stage)
                else "")]
    head = (f"{'rank':>4} {'device':>12} {'capacity MB':>11} {'MB/sample':>9} {'mbs':>5} {'trials':>6} "
            f"{'t(1) ms':>8} {'t(mbs) ms':>9} {'peak samples/s':>14}")
    lines += [head, "-" * len(head)]
    for r in profile.ranks:
        pts = {p.batch: p.compute_s for p in r.points}
        peak = max(p.batch / p.compute_s for p in r.points)
        lines.append(f"{r.rank:>4} {r.device_type:>12} {(r.capacity_bytes or 0) / 1e6:>11.3f} "
                     f"{(r.bytes_per_sample or 0) / 1e6:>9.4f} {r.mbs:>5} {r.trial_steps:>6} "
                     f"{pts.get(1, float('nan')) * 1e3:>8.2f} {pts.get(r.mbs, float('nan')) * 1e3:>9.2f} {peak:>14.1f}")
    lines += profile.comm.links.describe()
    return "\n".join(lines)
