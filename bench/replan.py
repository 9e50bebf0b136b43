"""Re-planning when a GPU drifts: one rank of an emulated cluster slows down mid-run; how fast
and how well ``fit(..., replan=...)`` recovers, and whether it stays quiet without drift.

Per cluster (built-in B = 2 V100-16G + 2 T4-16G, C = 2 A800-80G + 2 V100S-32G; 4 ranks, one
process each with a ``VirtualDevice`` of its preset, scales calibrated as in bench/hetero.py):
profile every rank once (``profile_rank``), then, with rank ``--slow-rank`` slowed
``--factor``x from iteration ``--slow-at`` (``poplar.emulation.faults.FaultSchedule``), train
three runs of ``--iterations`` iterations from the same initial model on the same data, one
after the other in the same processes, in ``--rounds`` rounds (2; odd rounds in reverse order,
medians pooled over the rounds, so a machine whose speed wanders favours none of them):

- fixed:  the plan made at start-up, re-planning off;
- replan: the same with ``replan=ReplanOptions()`` (10 % threshold, K = 3, 5 % margin);
- ideal:  re-planning off, but switched at exactly ``--slow-at`` to the plan the planner makes
  from the profile with the slowed rank's curve multiplied by the true factor (the new ideal:
  what an oracle that knew the drift would run).

Reported: median iteration seconds (slowest rank's wall time; drift detection reads the stats
the step's status reduction already shares, so it adds no collective) of each run after the switch; ``recovery_iterations`` = the
first iteration on the re-planned plan minus ``--slow-at``; ``fraction_of_new_ideal`` = ideal
median / replan median over the iterations from that switch on; the largest relative
difference between the parameters of the replan and fixed runs (SGD with momentum: the math
must not change); and, in a last run of
``--quiet-iterations`` without any fault while a busy process loads the machine, the number
of re-plans (false ones: there is no drift to follow). Medians over the iterations; one line
per cluster; the last line is ``RESULT {json}``. ``late_step_fraction`` counts the fixed, replan
and ideal runs, whose medians make the ratios; the quiet run, loaded on purpose, is counted apart
(``late_step_fraction_loaded_quiet_run``).

    .venv/bin/python bench/replan.py [--clusters B,C] [--iterations 40] [--slow-at 10] [--factor 2]
                                     [--quiet-iterations 100] [--stage 1] [--gbs 48] [--short]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from poplar.auto import AutoOptions
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.planner import plan as make_plan
from poplar.emulation.calibration import calibrate
from poplar.emulation.emulate import cluster_devices
from poplar.emulation.faults import FaultSchedule
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer, profile_rank
from poplar.train import FitConfig, ReportOptions, fit
from poplar.train.replan import ReplanOptions
from poplar.emulation.cluster import ClusterSpec
from poplar.types.profiles import Profile
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.zero.observers import StepObserver

VOCAB = 260
TARGETS = {"fraction_of_new_ideal": 0.95, "recovery_iterations": 5, "false_replans": 0,
           "max_param_diff_vs_no_replan": 1e-5}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, seq + 1), generator=torch.Generator().manual_seed(11))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def sample(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(batch))


class MicroSteps(StepObserver):
    """Counts micro-steps (the denominator of the late-step fraction)."""

    def __init__(self) -> None:
        self.count = 0

    def micro_step_end(self, step: Any) -> None:
        self.count += 1


def slowed(profile: Profile, rank: int, factor: float) -> Profile:
    """The profile with ``rank``'s curve ``factor`` x slower, as a device type of its own."""
    d = profile.to_dict()
    row = d["ranks"][rank]
    row["device_type"] += f"@rank{rank}"
    row["points"] = [{**p, "compute_s": p["compute_s"] * factor} for p in row["points"]]
    return Profile.from_dict(d)


# ---------------------------------------------------------------------- on every rank
def run(job: dict, rank: int, device: Any, profile: Profile, name: str, data: Tokens) -> dict[str, Any]:
    torch.manual_seed(0)
    model = job["model_fn"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    device.faults = job["faults"] if name != "quiet" and rank == job["slow_rank"] else None
    engine = PoplarEngine(model, opt, zero_stage=job["stage"], global_batch_size=job["gbs"], loss_fn=llama_loss_fn,
                          auto=AutoOptions(device=device, profile=profile, progress=False))
    counter = MicroSteps()
    handle = engine.add_observer(counter)
    late = device.late_steps
    common = {"report": ReportOptions(log_every=0, progress=False), "config": FitConfig(warmup=0)}
    total = job["quiet"] if name == "quiet" else job["iterations"]
    if name == "ideal":
        first = fit(engine, data, job["slow_at"], replan=False, **common)
        engine.set_plan(make_plan(slowed(profile, job["slow_rank"], job["factor"]), job["gbs"], job["stage"]))
        second = fit(engine, data, total, replan=False, **common)
        records, replans = first.iterations + second.iterations, []
    else:
        result = fit(engine, data, total, replan=name != "fixed" and ReplanOptions(), **common)
        records, replans = result.iterations, result.replans
    out = {"walls": [r["wall_s"] for r in records], "replans": replans, "late": device.late_steps - late,
           "micro_steps": counter.count}
    if engine.rank == 0 and name in ("fixed", "replan"):
        out["state"] = engine.full_state_dict()
    handle.remove()
    engine.close()
    return out


def worker(rank: int, world: int, job: dict) -> dict:
    device = job["devices"][rank]
    options = ProfileOptions(zero_stage=job["stage"], escalate=False, repeats=job["repeats"], model_name=job["model"])
    profile = profile_rank(job["model_fn"], llama_loss_fn, job["sample_fn"], device, optimizer_fn=default_optimizer,
                           options=options, log=lambda m: None)
    data = Tokens(job["gbs"] * 4, job["seq"])
    names = ("fixed", "replan", "ideal")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for k in range(job["rounds"]):  # odd rounds in reverse order: a machine that drifts favours no run
        for name in (names if k % 2 == 0 else names[::-1]):
            runs[name].append(run(job, rank, device, profile, name, data))
    out: dict[str, Any] = {name: merged(rs) for name, rs in runs.items()}
    load = None
    if rank == 0 and job["load"]:  # a co-tenant busy on the machine during the quiet run
        load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        out["quiet"] = merged([run(job, rank, device, profile, "quiet", data)])
    finally:
        if load is not None:
            load.kill()
            load.wait()
    if rank == 0:
        ideal = make_plan(slowed(profile, job["slow_rank"], job["factor"]), job["gbs"], job["stage"])
        out["plans"] = {"start": make_plan(profile, job["gbs"], job["stage"]).to_dict(),
                        "ideal": [[r.micro_batch_size, r.accum_steps, r.last_batch_size] for r in ideal.ranks],
                        "ideal_predicted_s": ideal.predicted_iteration_s}
    return out


def merged(rounds: list[dict]) -> dict[str, Any]:
    """One run's rounds: walls and decisions per round, late and micro-step counts summed."""
    first = rounds[0]
    return {**first, "walls": [r["walls"] for r in rounds], "replans": [r["replans"] for r in rounds],
            "late": sum(r["late"] for r in rounds), "micro_steps": sum(r["micro_steps"] for r in rounds)}


# ---------------------------------------------------------------------- in the parent
def analyse(name: str, results: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    r0 = results[0]
    names = ("fixed", "replan", "ideal")
    switches, early = [], 0  # per round: the first iteration on the re-planned plan
    # where the slowed rank does not become the critical one, the new ideal is the running plan:
    # keeping it is the right answer, reached at once
    kept = r0["plans"]["ideal"] == [[r["micro_batch_size"], r["accum_steps"], r["last_batch_size"]]
                                    for r in r0["plans"]["start"]["ranks"]]
    for events in r0["replan"]["replans"]:
        applied = [e for e in events if e["applied"] and e["iteration"] > args.slow_at]
        early += sum(e["applied"] and e["iteration"] <= args.slow_at for e in events)
        switches.append(applied[0]["iteration"] if applied else args.slow_at if kept else None)
    switch = None if None in switches else max(switches)
    starts = [s if s is not None else args.iterations for s in switches]
    med = {k: median_or_nan([x for w, a in zip(r0[k]["walls"], starts) for x in w[a:]]) for k in names}
    before = {k: statistics.median([x for w in r0[k]["walls"] for x in w[1:args.slow_at]]) for k in names}
    state_f, state_r = r0["fixed"]["state"], r0["replan"]["state"]
    diff = max(float((state_r[k] - state_f[k]).norm() / state_f[k].norm().clamp_min(1e-12)) for k in state_f)
    # the timed runs, whose medians make the ratios, apart from the quiet run, which a busy
    # co-tenant loads on purpose (it counts false re-plans, not speed)
    late = sum(r[k]["late"] for r in results for k in ("fixed", "replan", "ideal"))
    steps = sum(r[k]["micro_steps"] for r in results for k in ("fixed", "replan", "ideal"))
    return {"cluster": name, "switch_iteration": switch,
            "recovery_iterations": (switch - args.slow_at) if switch is not None else None,
            "median_s_before": before, "median_s_after": med,
            "fraction_of_new_ideal": med["ideal"] / med["replan"] if switch is not None else 0.0,
            "speedup_vs_fixed": med["fixed"] / med["replan"] if switch is not None else 1.0,
            "param_diff": diff, "false_replans": early + sum(e["applied"] for e in r0["quiet"]["replans"][0]),
            "drift_notes_quiet": len(r0["quiet"]["replans"][0]), "replans": r0["replan"]["replans"][0],
            "switches": switches,
            "ideal_rows": r0["plans"]["ideal"], "ideal_predicted_s": r0["plans"]["ideal_predicted_s"],
            "late_steps": late, "micro_steps": steps,
            "late_steps_quiet": sum(r["quiet"]["late"] for r in results),
            "micro_steps_quiet": sum(r["quiet"]["micro_steps"] for r in results)}


def median_or_nan(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(rows: list[dict]) -> str:
    head = (f"{'cluster':>7} {'fixed s':>8} {'replan s':>8} {'ideal s':>8} {'x ideal':>7} {'vs fixed':>8} "
            f"{'switch':>6} {'n':>3} {'param diff':>10} {'false':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        m = r["median_s_after"]
        lines.append(f"{r['cluster']:>7} {m['fixed']:>8.4f} {m['replan']:>8.4f} {m['ideal']:>8.4f} "
                     f"{r['fraction_of_new_ideal']:>7.3f} {r['speedup_vs_fixed']:>7.2f}x {str(r['switch_iteration']):>6} "
                     f"{str(r['recovery_iterations']):>3} {r['param_diff']:>10.2e} {r['false_replans']:>5}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="B,C")
    ap.add_argument("--stage", type=int, default=1, choices=[0, 1, 2, 3])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--slow-at", type=int, default=10)
    ap.add_argument("--slow-rank", type=int, default=0)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--quiet-iterations", type=int, default=100)
    ap.add_argument("--no-load", action="store_true", help="no busy co-tenant during the quiet run")
    ap.add_argument("--gbs", type=int, default=24)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--repeats", type=int, default=2, help="profiler measurements per batch size")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of the fixed / replan / ideal runs (odd rounds in reverse order); medians pool them")
    ap.add_argument("--short", action="store_true", help="20 iterations, slowdown at 6, 30 quiet ones")
    args = ap.parse_args()
    if args.short:
        args.iterations, args.slow_at, args.quiet_iterations, args.repeats, args.rounds = 20, 6, 30, 1, 1
    if not 1 < args.slow_at < args.iterations:
        ap.error("--slow-at must be between 2 and --iterations - 1")
    return args


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    model_fn = functools.partial(create_model, args.model)
    sample_fn = functools.partial(sample, seq=args.seq)
    rows = []
    for name in args.clusters.split(","):
        spec = ClusterSpec.resolve(name)
        cal = calibrate(ProfileJob(model_fn, llama_loss_fn, sample_fn, default_optimizer,
                                   ProfileOptions(zero_stage=args.stage)), spec)
        devices = cluster_devices(spec, cal.memory_scale, cal.time_scale)
        print(f"# {spec.describe()}: memory scale {cal.memory_scale:.3g}, time scale {cal.time_scale:.3g}",
              file=sys.stderr, flush=True)
        job = {"model": args.model, "model_fn": model_fn, "sample_fn": sample_fn, "devices": devices,
               "stage": args.stage, "gbs": args.gbs, "seq": args.seq, "iterations": args.iterations,
               "slow_at": args.slow_at, "slow_rank": args.slow_rank, "factor": args.factor,
               "faults": FaultSchedule(slow_factor=args.factor, slow_from=args.slow_at), "quiet": args.quiet_iterations,
               "load": not args.no_load, "repeats": args.repeats, "rounds": args.rounds}
        results = spawn(worker, spec.world_size, (job,), timeout_s=3600, collective_timeout_s=900)
        rows.append(analyse(spec.name, results, args))
    print(table(rows))
    for r in rows:
        for e in r["replans"]:
            print(f"note: {r['cluster']}: {'re-plan' if e['applied'] else 'drift noted'} at iteration "
                  f"{e['iteration']} ({e['kind']}, ranks {e['ranks']}, correction "
                  f"{ {k: round(v, 3) for k, v in e['correction'].items()} }): predicted "
                  f"{e['predicted_before_s']:.4f} s -> {e['predicted_after_s']:.4f} s, rows {e['plan']}")
        print(f"note: {r['cluster']}: the new ideal's rows {r['ideal_rows']}, predicted {r['ideal_predicted_s']:.4f} s")
    recov = [r["recovery_iterations"] for r in rows]
    late, steps = sum(r["late_steps"] for r in rows), sum(r["micro_steps"] for r in rows)
    late_q, steps_q = sum(r["late_steps_quiet"] for r in rows), sum(r["micro_steps_quiet"] for r in rows)
    result = {"fraction_of_new_ideal": min(r["fraction_of_new_ideal"] for r in rows),
              "recovery_iterations": None if None in recov else max(recov),
              "false_replans": sum(r["false_replans"] for r in rows),
              "max_param_diff_vs_no_replan": max(r["param_diff"] for r in rows),
              "late_step_fraction": late / steps if steps else 0.0,
              "late_step_fraction_loaded_quiet_run": late_q / steps_q if steps_q else 0.0,
              "speedup_vs_fixed": min(r["speedup_vs_fixed"] for r in rows),
              "drift_notes_quiet": sum(r["drift_notes_quiet"] for r in rows),
              "iterations": args.iterations, "slow_at": args.slow_at, "factor": args.factor,
              "quiet_iterations": args.quiet_iterations, "rounds": args.rounds, "load": not args.no_load, "stage": args.stage,
              "gbs": args.gbs, "clusters": [r["cluster"] for r in rows], "targets": TARGETS,
              "wall_s": round(time.perf_counter() - t_start, 1)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
