"""Profiling accuracy: the speed curve the planner builds from a measured profile vs the device's
true curve, on emulated clusters of preset GPUs, ZeRO-0..3.

Each cluster runs as one process per rank with a ``VirtualDevice`` made from its preset (memory
and time scaled to the CPU model by ``poplar.emulation.calibration.calibrate_stages``: the time
scale covers the highest stage profiled), whose compute is
padded to the preset's curve: the truth is known. Per stage, the profiler runs on every rank
(capacity search, lock-step timing with real collectives); then for every rank the planner's
``SpeedCurve.from_points`` (cubic spline over the measured points) is compared with the true
speed b / t_true(b) at every b in 1..mbs. Per stage the median and max relative speed error
over all ranks and batches are printed; the last line is ``RESULT {json}`` with the worst
stage's ``median_rel_err`` and ``max_rel_err`` (fractions; targets 0.02 and 0.05), and
``late_step_fraction``: the share of padded micro-steps whose real CPU compute overran the curve.
A cluster above 1 % is re-calibrated with more headroom and profiled again (``--attempts``);
still above, ``valid`` is false: its errors measure the machine's load, not the profiler.

Precision axis (``--precisions``, default fp32 and fp16): each precision profiles under its
mixed-precision policy, on devices padding to their preset's curve at that precision (fp16 is
faster by the preset's dtype factor), so the truth is the preset curve at that precision. One
calibration per cluster (under the low precision, whose scales cover fp32 too) serves every
precision. The worst over stages and precisions is the RESULT.

    .venv/bin/python bench/profile_accuracy.py [--clusters mixed3,B] [--stages 0,1,2,3] [--model token-mlp]
                                               [--precisions fp32,fp16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from poplar.emulation.cluster import ClusterSpec
from poplar.process.launch import spawn
from poplar.planner.curves import SpeedCurve
from poplar.emulation.calibration import calibrate_stages
from poplar.emulation.emulate import cluster_devices
from poplar.emulation.runs import until_on_time
from poplar.emulation.speed_padding import LATE_BUDGET, late_fraction
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer, profile_rank
from poplar.types.precision import precision_of
from poplar.types.profiles import Profile
from poplar.workloads import WORKLOADS, get_workload

CLUSTERS = {
    # three generations, three memory sizes: the fast card also has the most memory
    "mixed3": ClusterSpec("mixed3", [{"type": "A100-80G", "count": 1}, {"type": "V100-16G", "count": 1},
                                     {"type": "T4-16G", "count": 1}]),
}


def resolve(name: str) -> ClusterSpec:
    return CLUSTERS[name] if name in CLUSTERS else ClusterSpec.resolve(name)


def worker(rank: int, world: int, job: dict) -> dict:
    w = get_workload(job["model"])
    out = {}
    for stage in job["stages"]:
        device = job["devices"][rank]
        options = ProfileOptions(zero_stage=stage, repeats=job["repeats"], escalate=False, model_name=w.name,
                                 mixed_precision=job["precision"])
        t0 = time.perf_counter()
        padded0, late0 = device.padded_steps, device.late_steps
        prof = profile_rank(w.model_fn, w.loss_fn, w.sample_fn, device, optimizer_fn=default_optimizer,
                            options=options, log=(lambda m: None) if rank else
                            (lambda m: print(f"  [stage {stage}] {m}", file=sys.stderr, flush=True)))
        out[stage] = {"profile": prof.to_dict(), "seconds": time.perf_counter() - t0,
                      "padded_steps": device.padded_steps - padded0, "late_steps": device.late_steps - late0}
    return out


def errors(profile: Profile, devices: list) -> tuple[list[float], list[dict]]:
    """Relative speed errors over every rank and b in 1..mbs; and a per-rank summary."""
    all_errs, rows = [], []
    for rp, dev in zip(profile.ranks, devices):
        curve = SpeedCurve.from_points(rp.device_type, rp.mbs, [(p.batch, p.compute_s) for p in rp.points])
        b = np.arange(1, rp.mbs + 1)
        true_speed = b / np.array([dev.time_s(int(x)) for x in b])
        err = np.abs(curve.speeds / true_speed - 1)
        point_err = [abs(p.compute_s / dev.time_s(p.batch) - 1) for p in rp.points]
        all_errs.extend(err.tolist())
        rows.append({"rank": rp.rank, "device": rp.device_type, "mbs": rp.mbs, "trial_steps": rp.trial_steps,
                     "points": len(rp.points), "median_rel_err": float(np.median(err)),
                     "max_rel_err": float(err.max()), "max_point_err": max(point_err)})
    return all_errs, rows


def run_cluster(name: str, args: argparse.Namespace, stages: list[int], precisions: list[str]) -> list[dict]:
    """Every precision x stage on one cluster: one calibration, one spawned run per precision;
    rows (with their errors) for the report. A run whose late micro-steps exceed the budget is
    re-calibrated with a smaller margin and run again (up to ``--attempts``); still late, its
    rows are marked invalid."""
    def once(margin: float) -> tuple[list[dict], float]:
        report = _run_cluster_once(name, args, stages, precisions, margin)
        return report, late_fraction(sum(r["late_steps"] for r in report), sum(r["padded_steps"] for r in report))

    report, late, attempts = until_on_time(name, args.attempts, once)
    for r in report:
        r["valid"], r["attempts"] = late <= LATE_BUDGET, attempts
    return report


def _run_cluster_once(name: str, args: argparse.Namespace, stages: list[int], precisions: list[str],
                      margin: float) -> list[dict]:
    spec = resolve(name)
    w = get_workload(args.model)
    low = next((p for p in precisions if p != "fp32"), None)
    job = ProfileJob(w.model_fn, w.loss_fn, w.sample_fn, default_optimizer, ProfileOptions(mixed_precision=low))
    cal = calibrate_stages(job, spec, stages, margin=margin)
    print(f"# {spec.describe()}: memory scale {cal.memory_scale:.3g}, time scale {cal.time_scale:.3g} "
          f"(margin {margin:.2f})", file=sys.stderr, flush=True)
    report = []
    for precision in precisions:
        devices = cluster_devices(spec, cal.memory_scale, cal.time_scale, precision)
        job = {"model": args.model, "stages": stages, "devices": devices, "repeats": args.repeats,
               "precision": None if precision == "fp32" else precision}
        t0 = time.perf_counter()
        results = spawn(worker, spec.world_size, (job,), timeout_s=1800, collective_timeout_s=900)
        for stage in stages:
            prof = Profile.from_dict(results[0][stage]["profile"])
            errs, rows = errors(prof, devices)
            for r in rows:
                print(f"{name:>8} {precision:>5} {stage:>5} {r['rank']:>4} {r['device']:>12} {r['mbs']:>4} "
                      f"{r['trial_steps']:>6} {r['points']:>6} {r['median_rel_err']:>10.4f} "
                      f"{r['max_rel_err']:>8.4f} {r['max_point_err']:>10.4f}")
            report.append({"cluster": name, "precision": precision, "stage": stage, "ranks": rows, "errors": errs,
                           "late_steps": sum(res[stage]["late_steps"] for res in results),
                           "padded_steps": sum(res[stage]["padded_steps"] for res in results)})
        print(f"# {name} {precision}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return report


def summarize(report: list[dict], precisions: list[str], stages: list[int]) -> dict:
    """Median and max errors per precision x stage (printed), and the worst of them: overall, per
    stage and per precision (the RESULT's numbers)."""
    summary = {}
    for key in [(p, s) for p in precisions for s in stages]:
        rows = [r for r in report if (r["precision"], r["stage"]) == key]
        errs = [e for r in rows for e in r["errors"]]
        summary[key] = {"median_rel_err": float(statistics.median(errs)), "max_rel_err": float(max(errs)),
                        "late_steps": sum(r["late_steps"] for r in rows),
                        "late_step_fraction": late_fraction(sum(r["late_steps"] for r in rows),
                                                            sum(r["padded_steps"] for r in rows))}
    for (p, s), v in summary.items():
        print(f"{p} stage {s}: median {v['median_rel_err']:.4f}, max {v['max_rel_err']:.4f} "
              f"(late micro-steps, real CPU compute over the curve: {v['late_steps']}, "
              f"{100 * v['late_step_fraction']:.2f}%)")

    def worst(key: str, precision: str | None = None, stage: int | None = None) -> float:
        return max(v[key] for (q, t), v in summary.items() if precision in (None, q) and stage in (None, t))

    return {"median_rel_err": worst("median_rel_err"), "max_rel_err": worst("max_rel_err"),
            "late_step_fraction": late_fraction(sum(r["late_steps"] for r in report),
                                                sum(r["padded_steps"] for r in report)),
            "valid": all(r["valid"] for r in report),
            "per_stage": {str(s): {"median_rel_err": worst("median_rel_err", stage=s),
                                   "max_rel_err": worst("max_rel_err", stage=s),
                                   "late_steps": sum(v["late_steps"] for (_, t), v in summary.items() if t == s)}
                          for s in stages},
            "per_precision": {p: {"median_rel_err": worst("median_rel_err", p),
                                  "max_rel_err": worst("max_rel_err", p)} for p in precisions},
            "precisions": precisions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="mixed3,B")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--model", default="token-mlp", choices=list(WORKLOADS),
                    help="built-in workload (poplar.workloads); the default is the fastest")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attempts", type=int, default=2,
                    help="runs of a cluster whose late micro-steps exceed 1%% (each re-calibrated)")
    ap.add_argument("--precisions", default="fp32,fp16",
                    help="fp32 and/or one low precision (fp16 runs on every preset; bf16 not on V100 / T4)")
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    try:
        precisions = list(dict.fromkeys(str(precision_of(p)) for p in args.precisions.split(",")))
    except ValueError as e:
        ap.error(str(e))
    if len([p for p in precisions if p != "fp32"]) > 1:
        ap.error("--precisions: fp32 and at most one of bf16 / fp16")
    print(f"{'cluster':>8} {'prec':>5} {'stage':>5} {'rank':>4} {'device':>12} {'mbs':>4} {'trials':>6} "
          f"{'points':>6} {'median err':>10} {'max err':>8} {'max pt err':>10}")
    report = [row for name in args.clusters.split(",") for row in run_cluster(name, args, stages, precisions)]
    result = summarize(report, precisions, stages)
    result.update(clusters=args.clusters.split(","), model=args.model,
                  targets={"median_rel_err": 0.02, "max_rel_err": 0.05})
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
