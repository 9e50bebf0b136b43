"""Auto mode's choice of configuration (ZeRO stage x activation checkpointing) against every
candidate measured, on emulated clusters where memory binds.

Per cluster row, in one run on the same virtual devices:
1. a single-stage profile (the paper: ZeRO-0, escalating until batch 1 fits): its seconds are the
   yardstick of profiling cost, and its configuration is the first-fit choice;
2. auto mode's own choice (``AutoOptions(choose="fastest")``), with its profiling seconds;
3. every candidate that fits: timed (its own profile), planned, and trained for ``--iterations``
   iterations on that plan; the measured iteration is the median.
Prints the candidate table (predicted and measured side by side), the auto and first-fit
choices, and a last line ``RESULT {json}`` with min_choice_vs_best_measured (best measured
iteration / auto choice's measured, per row, the minimum), max_speedup_vs_first_fit (first
fit's measured / auto choice's measured, the maximum; the minimum is reported too),
profiling_cost_vs_single_stage (auto mode's profiling seconds / the first fit's single-stage
profile's, the maximum over rows), profiling_cost_vs_choice_alone (/ a single-stage profile of
the chosen configuration's, what profiling costs when the answer is known) and late_step_fraction.

A row is ``CLUSTER`` (memory scaled as auto mode does: the smallest device fits about 8 samples
at ZeRO-0) or ``CLUSTER:N`` (memory scaled so that it fits about N: memory binds, and larger
micro-batches from a higher stage or checkpointing pay). Profiling cost compares the seconds of
profiling proper (capacity searches, timing rounds, collectives) on the same emulated devices;
the calibration of the emulation, paid once by either, is left out of both.

    .venv/bin/python bench/auto_config.py            # short: rows B, A:2 and A:1, llama-tiny
    .venv/bin/python bench/auto_config.py --full     # more iterations and repeats
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poplar.auto import AutoOptions, auto_plan  # noqa: E402
from poplar.comm import Communicator  # noqa: E402
from poplar.process.launch import spawn  # noqa: E402
from poplar.engine import PoplarEngine  # noqa: E402
from poplar.planner.candidates import CandidateRow, format_table, mbs_by_type, predict  # noqa: E402
from poplar.emulation import Scales, cluster_device  # noqa: E402
from poplar.emulation.calibration import pick_memory_scale, prepare  # noqa: E402
from poplar.profiler.configurations import CandidateProfiler  # noqa: E402
from poplar.types.configuration import Configuration  # noqa: E402
from poplar.profiler.profile_run import (ProfileJob, ProfileOptions, RankPhases, default_optimizer,  # noqa: E402
                                         profile_rank)
from poplar.emulation.cluster import ClusterSpec  # noqa: E402
from poplar.emulation.presets import get_preset  # noqa: E402
from poplar.workloads.models import create_model, llama_loss_fn  # noqa: E402
from poplar.workloads.text import TextBlocks  # noqa: E402

SEQ = 32


def model_fn():
    return create_model("llama-tiny", seed=0, max_seq_len=SEQ)


def sample_fn(b: int):
    data = TextBlocks(seq_len=SEQ)
    return torch.stack([data[i % len(data)] for i in range(b)])


def memory_scale(cluster: str, fits: int | None) -> float | str:
    """"auto", or the memory scale at which the cluster's smallest device fits about ``fits``
    samples of the model at ZeRO-0 (one process, batch 1-8 trial steps)."""
    if fits is None:
        return "auto"
    prep = prepare(ProfileJob(model_fn, llama_loss_fn, sample_fn), cluster, scales=Scales(time=1.0))
    presets = [get_preset(t) for t in dict.fromkeys(ClusterSpec.resolve(cluster).rank_types())]
    return pick_memory_scale(prep.passes[0], presets, fits)


def rank_main(rank: int, world: int, cluster: str, gbs: int, iterations: int, repeats: int,
              scale: float | str) -> dict:
    torch.set_num_threads(1)
    comm = Communicator(None, torch.device("cpu"))
    model = model_fn()
    opt = default_optimizer(model)
    device = cluster_device(cluster, rank, scales=Scales(memory=scale))
    quiet = AutoOptions(profile_data=sample_fn, device=device, repeats=repeats, progress=False, max_batch=1024)
    # auto mode: its choice and profiling seconds (the device it emulates is reused below)
    auto = auto_plan(comm, model, opt, global_batch_size=gbs, zero_stage="auto", loss_fn=llama_loss_fn, options=quiet)
    auto_s = sum(auto.plan.choice.profiling_s.values())  # capacity searches, timing rounds, collectives
    device = auto.device
    # the paper's single-stage profile (ZeRO-0, escalating): the yardstick and the first fit
    t0 = time.perf_counter()
    single = profile_rank(model_fn, llama_loss_fn, sample_fn, device, optimizer_fn=default_optimizer,
                          options=ProfileOptions(zero_stage=0, repeats=repeats, progress=False, max_batch=1024),
                          log=lambda m: None)
    single_s = time.perf_counter() - t0
    first_fit = f"ZeRO-{single.zero_stage}"
    # a single-stage profile of the configuration auto mode chose (what profiling costs when the
    # answer is known in advance)
    t0 = time.perf_counter()
    profile_rank(model_fn, llama_loss_fn, sample_fn, device, optimizer_fn=default_optimizer,
                 options=ProfileOptions(zero_stage=auto.plan.zero_stage, escalate=False, repeats=repeats,
                                        progress=False, max_batch=1024,
                                        activation_checkpointing=auto.activation_checkpointing),
                 log=lambda m: None)
    chosen_single_s = time.perf_counter() - t0
    # every candidate: timed, planned, trained
    job = ProfileJob(model_fn, llama_loss_fn, sample_fn, default_optimizer,
                     ProfileOptions(repeats=repeats, progress=False, max_batch=1024))
    prof = CandidateProfiler(RankPhases(job, device, log=lambda m: None))
    types = comm.all_gather_object(device.device_type)
    caps = prof.capacities([Configuration(s, c) for c in (None, True) for s in range(4)])
    rows, measured = [], {}
    for cap in caps:
        row = CandidateRow(cap.config.stage, cap.config.checkpointed, cap.fits, mbs_by_type(types, cap.mbs))
        if not cap.fits:
            rows.append(replace(row, reason="batch 1 does not fit"))
            continue
        plan, reason = predict(prof.time(cap), gbs, cap.config.stage)
        row = replace(row, reason=reason) if plan is None else \
            replace(row, reason=reason, predicted_s=plan.predicted_iteration_s, timed=True)
        rows.append(row)
        if plan is None:
            continue
        m = model_fn()
        engine = PoplarEngine(m, default_optimizer(m), zero_stage=cap.config.stage, plan=plan,
                              activation_checkpointing=cap.config.checkpointing, loss_fn=llama_loss_fn)
        with device.attach(engine):
            batch = sample_fn(gbs)
            start = plan.sample_offsets()[rank]
            mine = batch[start:start + plan.ranks[rank].num_samples]
            times = []
            for _ in range(iterations + 1):
                comm.all_gather_object(0)  # start together
                t0 = time.perf_counter()
                engine.train_step(mine)
                times.append(time.perf_counter() - t0)
        slowest = comm.all_gather_object(times[1:])
        measured[row.name] = statistics.median(max(col) for col in zip(*slowest))
    chosen = next(r for r in auto.candidates if r.chosen).name if auto.candidates else f"ZeRO-{auto.plan.zero_stage}"
    late = device.late_steps, device.padded_steps
    return {"rows": [r.to_dict() for r in rows], "measured": measured, "auto": chosen, "first_fit": first_fit,
            "auto_profiling_s": auto_s, "single_profile_s": single_s, "chosen_single_s": chosen_single_s,
            "auto_split": auto.plan.choice.profiling_s,
            "single_split": single.measurement.ranks[rank].phase_seconds,
            "rounds": (auto.profile.auto_choice.timing_rounds, single.measurement.timing_rounds),
            "auto_table": format_table(auto.candidates or []),
            "late": late}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--rows", default="B,A:2,A:1", help="CLUSTER or CLUSTER:N (the smallest device fits ~N at ZeRO-0)")
    ap.add_argument("--gbs", type=int, default=64)
    args = ap.parse_args()
    iterations, repeats = (7, 3) if args.full else (3, 1)
    out_rows, late_steps, padded = [], 0, 0
    t_start = time.perf_counter()
    for row_name in args.rows.split(","):
        name, _, fits = row_name.partition(":")
        world = ClusterSpec.resolve(name).world_size
        scale = memory_scale(name, int(fits) if fits else None)
        res = spawn(rank_main, world, (name, args.gbs, iterations, repeats, scale), timeout_s=3000,
                    collective_timeout_s=600)
        r0 = res[0]
        rows = [CandidateRow.from_dict(d) for d in r0["rows"]]
        measured = r0["measured"]
        print(f"\n== row {row_name}: cluster {name} ({world} ranks), memory scale "
              f"{scale if isinstance(scale, str) else f'{scale:.3g}'}, gbs {args.gbs}: every candidate, "
              "predicted vs measured")
        print(format_table(rows, measured))
        print(f"auto mode's own table:\n{r0['auto_table']}")
        best = min(measured.values())
        auto_m = measured.get(r0["auto"], float("nan"))
        ff_m = measured.get(r0["first_fit"], float("nan"))
        cost = r0["auto_profiling_s"] / r0["single_profile_s"]
        cost_chosen = r0["auto_profiling_s"] / r0["chosen_single_s"]
        print(f"auto choice {r0['auto']} measured {auto_m:.4f} s; first fit {r0['first_fit']} {ff_m:.4f} s; "
              f"best measured {best:.4f} s; profiling {r0['auto_profiling_s']:.1f} s vs single-stage "
              f"{r0['single_profile_s']:.1f} s ({cost:.2f}x); a single-stage profile of the choice alone "
              f"{r0['chosen_single_s']:.1f} s ({cost_chosen:.2f}x)")
        print(f"profiling split, auto: {r0['auto_split']} ({r0['rounds'][0]} timing rounds); single-stage: "
              f"{r0['single_split']} ({r0['rounds'][1]} rounds)")
        out_rows.append({"row": row_name, "choice_vs_best": best / auto_m, "speedup_vs_first_fit": ff_m / auto_m,
                         "profiling_cost": cost, "profiling_cost_vs_choice_alone": cost_chosen,
                         "auto_profiling_split_s": r0["auto_split"],
                         "timing_rounds_auto_vs_single": list(r0["rounds"])})
        for r in res:
            late_steps, padded = late_steps + r["late"][0], padded + r["late"][1]
    result = {"min_choice_vs_best_measured": round(min(r["choice_vs_best"] for r in out_rows), 4),
              "max_speedup_vs_first_fit": round(max(r["speedup_vs_first_fit"] for r in out_rows), 4),
              "min_speedup_vs_first_fit": round(min(r["speedup_vs_first_fit"] for r in out_rows), 4),
              "profiling_cost_vs_single_stage": round(max(r["profiling_cost"] for r in out_rows), 3),
              "profiling_cost_vs_choice_alone": round(max(r["profiling_cost_vs_choice_alone"] for r in out_rows), 3),
              "late_step_fraction": round(late_steps / padded, 4) if padded else None, "rows": out_rows}
    print(f"\nbench took {time.perf_counter() - t_start:.0f} s")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
