"""Quantized collectives over a slow link: what they cost to convergence and what they save.

The same ZeRO-3 job exact and with int8 weight gathers, int8 gradient reductions, and both, on an
emulated cluster of two nodes, trained side by side on the same data from the same seed.

Cluster: ``--cluster`` (default ``C``: 2 A800-80G on PCIe 4 beside 2 V100S-32G on PCIe 3; ``C-4+4``
is the paper's size, 8 ranks) over ``--network`` (default eth-10g, where the link binds), with the
machinery of ``bench/network.py``: one spawned process per rank, each with a ``VirtualDevice`` of
its preset (memory and time scaled to the model by ``calibrate_stages``), collectives paced on the
cluster's virtual network, engines built with ``ZeroConfig(3, topology=...)``.

Model and data: llama-tiny on the corpus shipped with Poplar (``TextBlocks``, byte tokens, blocks
of ``--seq`` tokens; the last 10 % of the blocks held out). Iteration i's global batch is
``--gbs`` training blocks drawn by (``--seed``, i): the same for every run. AdamW at a constant
``--lr`` (Note: the learning rate).

Runs. Every rank profiles its device with the topology (``ProfileOptions.topology``), then
``exact`` is the plan the planner chooses from that profile (``collectives="auto"``: flat,
hierarchical or secondary shards, whichever it predicts fastest; ``--collectives`` forces one),
with every rank taking part (``participation="all"``: left to itself the planner may leave the
slower node out of the step, and then nothing crosses the link this bench is about).
``weights``, ``gradients`` and ``both`` are that plan with ``compression`` set
(``CommPolicy(weights="int8")``, ``CommPolicy(gradients="int8")``, both): the same rows, the same
collectives, only the bytes quantized. In each of ``--rounds`` rounds every run in turn (a
different one first each round) trains its next share of ``--iterations``; the first ``--warmup``
iterations of each block are trained but not timed. An iteration's time is its period (previous
end to its own, averaged over the ranks); medians over the timed iterations.

Per run:
- training loss: the mean of the global loss over the last ``--tail`` iterations (same batches
  for every run), relative to exact;
- held-out loss: every ``--eval-every`` iterations and after every block, the run's master
  weights (``full_state_dict``) evaluated in one process on the whole held-out set, between paced
  stretches (the iteration after an evaluation is not timed); the last one, relative to exact;
- iteration time relative to exact (exact / run: above 1 is faster);
- cross-node bytes per iteration relative to exact, from the comm ledger: every rank's CROSS
  records (the bytes it sent over the exchange between nodes), and, for a FLAT collective on a
  topology of k nodes (one ring through the node boundaries), k x the ring's bus volume shared
  over the n ranks that record it (the virtual network's port model). Forward, backward and step
  collectives only (not evaluation or state gathers).

Auto mode with lossy communication allowed (``--lossy-auto``): the planner's choice with
``collectives=CollectivesRequest(way, allow_lossy=True)`` (what ``AutoOptions(allow_lossy=True)``
asks) on the profile over the slow network, and on two more profiles over ``--fast-network``
(profiled and planned only): the cluster's own machines, and the same GPUs joined inside each
machine by ``--fast-nodes`` (NVLink by default). On C a flat ring is paced by its slowest hop, the
V100S machine's PCIe 3, whatever the network, so quantizing a ring that crosses nodes saves time
over any network; with NVLink inside the machines the network is the ring's slow hop. The table
says which compression each chose and its predicted saving.

The yardsticks (unless ``--no-yardstick``): ``exact-reordered``, exact again on the other way of
running the same collectives (flat <-> hierarchical), which changes fp32's rounding order and
nothing else (Note: the yardstick at ``YARDSTICK``); and the one-process pair (Note: the
one-process pair at ``ONE_PROCESS``), the same training in this process on the whole global batch,
in fp32 (``one-process``) and under bf16 autocast (``one-process-bf16``), unpaced (no time or bytes).

``--runs`` trains a subset (default all): losses are relative to exact, or to ``one-process``
where exact is not among them, so ``--runs one-process,one-process-bf16 --seed N`` measures what
bf16 moves at seed N in seconds, without the cluster.

RESULT:
- ``max_eval_loss_rel_diff``: max over the quantized runs of |held-out loss / exact's - 1| (target <= 0.01);
- ``yardstick_eval_loss_rel_diff`` / ``yardstick_train_loss_rel_diff``: the same for ``exact-reordered``;
- ``one_process_eval_loss_rel_diff``: |one-process's held-out loss / exact's - 1|;
- ``bf16_eval_loss_rel_diff`` / ``bf16_train_loss_rel_diff``: |one-process-bf16's loss / one-process's - 1|;
- ``speedup_vs_exact_link_bound``: exact's iteration time over both's (target >= 1.3);
- ``cross_node_bytes_ratio``: both's cross-node bytes per iteration over exact's (target <= 0.3);
- ``late_step_fraction``: padded micro-steps whose real compute overshot the curve (<= 0.01);
- ``lossy_auto``: with ``--lossy-auto``, what ``allow_lossy`` chose on each case's links.

    .venv/bin/python bench/compressed.py [--short] [--cluster C] [--network eth-10g] [--iterations 300]
                                         [--rounds 6] [--gbs 32] [--lossy-auto] [--plot loss.png] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from poplar.emulation.presets import PresetError, get_link
from poplar.emulation.emulate import EmulatedCluster, cluster_devices
from poplar.emulation.link_calibration import measure_link
from poplar.emulation.speed_padding import LATE_BUDGET, late_fraction
from poplar.emulation.virtual_link import LinkSpec
from poplar.engine import PoplarEngine
from poplar.planner import CollectivesRequest, plan
from poplar.planner.cost_model import bus_bytes
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, model_size, profile_rank
from poplar.types.compression import CommPolicy
from poplar.types.plans import Plan
from poplar.types.profiles import LinkSpeed
from poplar.types.route import Collectives
from poplar.types.topology import Link, Topology
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks
from poplar.zero.config import ZeroConfig

STAGE = 3
RUNS = {"exact": CommPolicy(), "weights": CommPolicy(weights="int8"), "gradients": CommPolicy(gradients="int8"),
        "both": CommPolicy(weights="int8", gradients="int8")}
# [Note: the yardstick] Exact again on the other way of running the same collectives (flat <->
# hierarchical): the same sums in another order, differing from exact by fp32 rounding alone. How
# far its losses move is how far any perturbation of this size moves this job's trajectory; a
# quantized run's difference is read against it, not against 0.
YARDSTICK = "exact-reordered"
# [Note: the one-process pair] The job as one process trains it on the whole global batch (the
# step Poplar's engine reproduces), in fp32 and under ``torch.autocast(dtype=torch.bfloat16)``: the
# bf16 compute GPU users train in. bf16 rounds every weight, activation and gradient it touches by
# up to 2^-9 of itself; the int8 weight gather moves a parameter by 0.2 % rms (design 3.10.1), the
# same order. How far bf16 moves the losses is how far a precision loss users accept moves them.
ONE_PROCESS = {"one-process": None, "one-process-bf16": torch.bfloat16}
# [Note: the learning rate] Reading a 1 % loss difference needs a job that changes losing nothing
# move by much less. The rate is chosen by that alone, on the one-process pair at ten seeds before
# any quantized run: at a constant 1e-3 fp32 and bf16 end within 0.8 % at every seed; at 3e-3
# (constant or cosine) and 1e-2 training leaves a plateau near loss 3.0 when rounding decides, and
# they differ by up to 9-24 % (docs/experiments.md, 2026-11-28). Default of --lr.
CLUSTER_RUNS = (*RUNS, YARDSTICK)
TARGETS = {"max_eval_loss_rel_diff": 0.01, "speedup_vs_exact_link_bound": 1.3, "cross_node_bytes_ratio": 0.3,
           "late_step_fraction": LATE_BUDGET}
TRAINING_PHASES = ("forward", "backward", "step")  # a ledger record's phase: what an iteration sends


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr)


def profile_sample(b: int, seq: int) -> torch.Tensor:
    """The first ``b`` training blocks: what the profiler measures the device on."""
    train = TextBlocks(seq_len=seq, split="train")
    return torch.stack([train[i % len(train)] for i in range(b)])


def global_batch(train: TextBlocks, iteration: int, gbs: int, seed: int) -> torch.Tensor:
    """Iteration ``iteration``'s global batch: ``gbs`` training blocks drawn by (seed, iteration)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    return torch.stack([train[int(i)] for i in torch.randint(len(train), (gbs,), generator=g)])


def held_out_loss(model_fn: Any, state: dict[str, torch.Tensor], held_out: torch.Tensor) -> float:
    """The mean next-token loss of ``state`` on every held-out block, in one process."""
    model = model_fn()
    model.load_state_dict(state)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for chunk in held_out.split(64):
            total += float(llama_loss_fn(model, chunk)) * len(chunk)
    return total / len(held_out)


def block_ends(iterations: int, rounds: int) -> list[int]:
    """The iteration each round's block of a run ends at."""
    return [round(iterations * (r + 1) / rounds) for r in range(rounds)]


def eval_points(iterations: int, rounds: int, every: int) -> list[int]:
    """The iterations after which ``train`` evaluates: every ``every``-th and each block's end."""
    return sorted(set(block_ends(iterations, rounds)) | set(range(every, iterations + 1, every)))


def one_process(job: dict, dtype: torch.dtype | None) -> dict[str, Any]:
    """The job trained in this process on the whole global batch (Note: the one-process pair),
    under bf16 autocast where ``dtype`` is set; evaluated in fp32 where ``train`` evaluates."""
    model = job["model_fn"]()
    optimizer = job["optimizer_fn"](model)
    points = set(eval_points(job["iterations"], job["rounds"], job["eval_every"]))
    rec: dict[str, Any] = {"loss": [], "eval": []}
    for i in range(job["iterations"]):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = llama_loss_fn(model, global_batch(job["train"], i, job["gbs"], job["seed"]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        rec["loss"].append(loss.item())
        if i + 1 in points:
            rec["eval"].append((i + 1, held_out_loss(job["model_fn"], model.state_dict(), job["held_out"])))
    return rec


def cross_node_bytes(engine: PoplarEngine, iteration: int, topology: Topology) -> float:
    """This rank's cross-node bytes in ``iteration`` (module doc: CROSS records, and a FLAT ring's
    share of its k boundary hops). Read from the newest records back, right after the iteration:
    the ledger keeps a window of records, and a long block would outrun it."""
    k, world = topology.node_count, engine.world_size
    sent = 0.0
    for r in reversed(engine.comm_ledger.records):
        if r.iteration < iteration:
            break
        if r.iteration != iteration or r.phase not in TRAINING_PHASES or not r.bytes:
            continue
        if r.link is Link.CROSS:
            sent += r.bytes
        elif r.link is Link.FLAT and k > 1:
            sent += k * bus_bytes(r.op, r.bytes, world) / world
    return sent


def train_block(job: dict, device: Any, engine: PoplarEngine, p: Plan, rec: dict, rank: int, n: int) -> None:
    """``n`` more iterations of one run, paced on the emulated device and network; the first
    ``job["warmup"]`` are not timed (the engine's first after another's, or after an evaluation)."""
    first = p.sample_offsets()[rank]
    mine = p.ranks[rank].num_samples
    start = len(rec["loss"])
    batches = [global_batch(job["train"], start + i, job["gbs"], job["seed"])[first:first + mine] for i in range(n)]
    late, padded = device.late_steps, device.padded_steps
    with device.attach(engine):
        dist.barrier()
        for i, batch in enumerate(batches):
            rec["loss"].append(engine.train_step(batch, llama_loss_fn))
            rec["end"].append(time.perf_counter())
            rec["timed"].append(i >= job["warmup"])
            rec["cross"].append(cross_node_bytes(engine, engine.iteration - 1, job["topology"]))
    rec["late"] += device.late_steps - late
    rec["padded"] += device.padded_steps - padded


def train(job: dict, device: Any, plans: dict[str, Plan], rank: int) -> dict[str, Any]:
    """Every run in interleaved blocks (module doc), with a held-out loss every ``eval_every``
    iterations and after each block."""
    engines, out = {}, {}
    for name, p in plans.items():
        model = job["model_fn"]()
        engines[name] = PoplarEngine(model, job["optimizer_fn"](model), plan=p,
                                     zero_stage=ZeroConfig(STAGE, topology=job["topology"]))
        out[name] = {"loss": [], "end": [], "timed": [], "late": 0, "padded": 0, "cross": [], "eval": []}
    names, bounds, every = list(plans), block_ends(job["iterations"], job["rounds"]), job["eval_every"]
    for r in range(job["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rec = out[name]
            while len(rec["loss"]) < bounds[r]:  # up to the next evaluation or the block's end
                done = len(rec["loss"])
                train_block(job, device, engines[name], plans[name], rec, rank,
                            min(bounds[r], (done // every + 1) * every) - done)
                state = engines[name].full_state_dict()  # collective: every rank
                if rank == 0:
                    rec["eval"].append((len(rec["loss"]), held_out_loss(job["model_fn"], state, job["held_out"])))
    for engine in engines.values():
        engine.close()
    return out


def lossy_choice(prof: Any, job: dict) -> Plan:
    """The planner's choice with lossy communication allowed (what ``AutoOptions(allow_lossy=True)`` asks)."""
    request = CollectivesRequest(job["collectives"], allow_lossy=True)
    return plan(prof, job["gbs"], STAGE, collectives=request, participation=job["participation"])


def profile(job: dict, device: Any) -> Any:
    options = ProfileOptions(zero_stage=STAGE, escalate=False, repeats=job["repeats"], model_name="llama-tiny",
                             topology=job["topology"], max_batch=job["max_batch"],
                             comm_sizes=(2 ** 12, 2 ** 14, 2 ** 16, job["param_bytes"]))  # up to the model's
    return profile_rank(job["model_fn"], llama_loss_fn, job["sample_fn"], device,
                        optimizer_fn=job["optimizer_fn"], options=options, log=lambda m: None)


def worker(rank: int, world: int, job: dict) -> dict:
    """Profile, plan, and (unless ``job["train"]`` is None: a profile over the fast network only)
    train the four runs."""
    torch.set_num_threads(1)
    device = job["devices"][rank]
    t0 = time.perf_counter()
    paced, late_c = device.link.paced_collectives, device.link.late_collectives
    prof = profile(job, device)
    exact = plan(prof, job["gbs"], STAGE, collectives=job["collectives"], participation=job["participation"])
    lossy = lossy_choice(prof, job) if job["lossy_auto"] else None
    out: dict[str, Any] = {"plans": {"exact": exact.to_dict()}, "links": prof.comm.links.describe(),
                           "lossy_auto": lossy.to_dict() if lossy is not None else None}
    if job["train"] is None:
        return out
    plans = {name: dataclasses.replace(exact, compression=policy) for name, policy in RUNS.items()}
    # exact again with the other way's sums: only fp32's rounding order differs
    other = Collectives.FLAT if exact.collectives.hierarchical else Collectives.HIERARCHICAL
    plans[YARDSTICK] = dataclasses.replace(exact, collectives=other)
    plans = {name: plans[name] for name in job["runs"] if name in plans}
    t1 = time.perf_counter()
    out["runs"] = train(job, device, plans, rank)
    if rank == 0:
        print(f"    profile {t1 - t0:.0f} s, training {time.perf_counter() - t1:.0f} s", file=sys.stderr, flush=True)
    out["plans"] = {k: p.to_dict() for k, p in plans.items()}
    out["paced_collectives"] = device.link.paced_collectives - paced
    out["late_collectives"] = device.link.late_collectives - late_c
    return out


def median_period(runs: list[dict]) -> float:
    """Median over the timed iterations of the period, averaged over the ranks."""
    periods = [statistics.mean(r["end"][i] - r["end"][i - 1] for r in runs)
               for i in range(1, len(runs[0]["end"])) if runs[0]["timed"][i]]
    return statistics.median(periods)


def way(p: Plan) -> str:
    return "secondary" if p.collectives is Collectives.SECONDARY_SHARDS else p.collectives.value


def baseline(rows: dict[str, Any]) -> str:
    """The run the others are read against: exact, or one-process where exact did not run."""
    return "exact" if "exact" in rows else "one-process"


def analyse(results: list[dict], local: dict[str, dict], tail: int, initial_eval: float) -> dict[str, Any]:
    """Per run: losses, time and bytes, each beside the baseline's (module doc); ``local``: the
    one-process runs (no time or bytes); ``initial_eval`` is the held-out loss of the initial
    weights (the same for every run)."""
    rows: dict[str, Any] = {}
    for name in results[0]["runs"] if results else ():
        runs = [res["runs"][name] for res in results]
        per_iteration = [sum(r["cross"][i] for r in runs) for i in range(len(runs[0]["cross"]))]
        rows[name] = {"compression": Plan.from_dict(results[0]["plans"][name]).compression.describe(),
                      "train_loss": statistics.mean(runs[0]["loss"][-tail:]),
                      "eval_loss": runs[0]["eval"][-1][1], "iter_s": median_period(runs),
                      "cross_bytes": statistics.median(per_iteration),
                      "late": sum(r["late"] for r in runs), "padded": sum(r["padded"] for r in runs),
                      "loss_curve": runs[0]["loss"], "eval_curve": [(0, initial_eval)] + runs[0]["eval"]}
    for name, run in local.items():
        rows[name] = {"compression": "none, " + ("bf16 autocast" if ONE_PROCESS[name] else "fp32") + ", one process",
                      "train_loss": statistics.mean(run["loss"][-tail:]), "eval_loss": run["eval"][-1][1],
                      "iter_s": None, "cross_bytes": None, "late": 0, "padded": 0, "loss_curve": run["loss"],
                      "eval_curve": [(0, initial_eval)] + run["eval"]}
    base = rows[baseline(rows)]
    for row in rows.values():
        row["train_rel"] = row["train_loss"] / base["train_loss"] - 1
        row["eval_rel"] = row["eval_loss"] / base["eval_loss"] - 1
        row["speedup"] = base["iter_s"] / row["iter_s"] if base["iter_s"] and row["iter_s"] else None
        row["bytes_ratio"] = row["cross_bytes"] / base["cross_bytes"] if base["cross_bytes"] and \
            row["cross_bytes"] is not None else None
    return rows


def number(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def table(rows: dict[str, Any]) -> str:
    base = baseline(rows)
    lines = [f"| run | compression | train loss | vs {base} | held-out loss | vs {base} | iter (s) | {base}/run | "
             f"cross-node KB/iter | vs {base} |", "|" + "---|" * 10]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['compression']} | {r['train_loss']:.4f} | {r['train_rel']:+.4f} | "
                     f"{r['eval_loss']:.4f} | {r['eval_rel']:+.4f} | {number(r['iter_s'], '.3f')} | "
                     f"{number(r['speedup'], '.2f')} | {number(r['cross_bytes'], '.1f', 1e-3)} | "
                     f"{number(r['bytes_ratio'], '.3f')} |")
    return "\n".join(lines)


def lossy_table(choices: dict[str, Any]) -> str:
    lines = ["| links | exact plan: way, predicted (s) | allow_lossy: compression | predicted (s) | vs exact |",
             "|---|---|---|---|---|"]
    for case, (exact, lossy) in choices.items():
        e, q = Plan.from_dict(exact), Plan.from_dict(lossy)
        lines.append(f"| {case} | {way(e)}, {e.predicted_iteration_s:.3f} | {q.compression.describe()} ({way(q)}) | "
                     f"{q.predicted_iteration_s:.3f} | {e.predicted_iteration_s / q.predicted_iteration_s:.2f} |")
        why = q.choice.compression_choice
        if why is not None:
            lines.append(f"| | {why.describe()} | | | |")
    return "\n".join(lines)


def running_mean(y: list[float], n: int = 10) -> list[float]:
    return [statistics.mean(y[max(0, i - n + 1):i + 1]) for i in range(len(y))]


def plot(rows: dict[str, Any], path: str, title: str) -> str | None:
    """Left: every run's training-loss curve (a running mean over 10 iterations) and held-out
    points; right: each run's losses relative to the baseline's."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (the 'plot' extra): the curves are in the JSON only"
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(11, 4.2))
    base = baseline(rows)
    exact = running_mean(rows[base]["loss_curve"])
    exact_eval = dict(rows[base]["eval_curve"])
    for name, r in rows.items():
        smooth = running_mean(r["loss_curve"])
        line, = ax.plot(range(1, len(smooth) + 1), smooth, label=f"{name}: train (mean of 10)", lw=1.2)
        xs, ys = zip(*r["eval_curve"])
        ax.plot(xs, ys, "o--", color=line.get_color(), ms=4, lw=0.8, label=f"{name}: held-out")
        if name != base:
            rel.plot(range(1, len(smooth) + 1), [a / b - 1 for a, b in zip(smooth, exact)], color=line.get_color(),
                     lw=1.2, label=f"{name}: train")
            rel.plot(xs, [y / exact_eval[x] - 1 for x, y in zip(xs, ys)], "o--", color=line.get_color(), ms=4,
                     lw=0.8, label=f"{name}: held-out")
    ax.set(xlabel="iteration", ylabel="loss")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    rel.axhline(0.0, color="grey", lw=0.6)
    rel.set(xlabel="iteration", ylabel=f"loss / {base}'s - 1")
    rel.set_title(f"relative to {base}", fontsize=9)
    rel.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="C", help="a two-node cluster: C (2 + 2) or C-4+4 (the paper's size)")
    ap.add_argument("--network", default="eth-10g", help="the inter-node link (slow: where it binds)")
    ap.add_argument("--fast-network", default="ib-400g", help="the fast link of --lossy-auto")
    ap.add_argument("--fast-nodes", default="nvlink-a100",
                    help="--lossy-auto's last case: the same GPUs joined inside each machine by this link preset, "
                         "over --fast-network ('' leaves it out)")
    ap.add_argument("--collectives", default="auto", help="the exact plan's collectives (auto: the planner's choice)")
    ap.add_argument("--participation", default="all",
                    help="the planner's participation: all (default; a plan that leaves a node out sends nothing "
                         "across the link this bench measures) or auto")
    ap.add_argument("--iterations", type=int, default=300, help="iterations per run")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations at the start of each block")
    ap.add_argument("--eval-every", type=int, default=20, help="iterations between held-out evaluations")
    ap.add_argument("--tail", type=int, default=10, help="iterations the final training loss averages")
    ap.add_argument("--gbs", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's constant rate (Note: the learning rate)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="profiler measurements per batch size")
    ap.add_argument("--max-batch", type=int, default=16, help="the capacity search stops here")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="run the emulated cluster this many times slower than calibrated (compute and links "
                         "alike), so the bytes weigh more against the machine's collective latency")
    ap.add_argument("--lossy-auto", action="store_true",
                    help="also show the planner's choice with allow_lossy=True over --network and --fast-network")
    ap.add_argument("--short", action="store_true", help="a smoke run: 12 iterations in 2 rounds, 1 profiler repeat")
    ap.add_argument("--no-yardstick", action="store_true",
                    help="leave out the yardsticks: exact on the other way of the collectives and the one-process "
                         "pair (Note: the yardstick)")
    every = [*CLUSTER_RUNS, *ONE_PROCESS]
    ap.add_argument("--runs", default=",".join(every),
                    help=f"the runs to train, comma-separated, among {','.join(every)} (default all); exact or "
                         "one-process must be among them")
    ap.add_argument("--plot", default="loss.png", help="where the loss curves go ('' for none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.runs = [name.strip() for name in args.runs.split(",") if name.strip()]
    unknown = [name for name in args.runs if name not in every]
    if unknown or not {"exact", "one-process"} & set(args.runs):
        ap.error(f"--runs {','.join(args.runs)}: " + (f"no run named {', '.join(unknown)}" if unknown else
                 "nothing to read the others against") + f"; give exact or one-process and any of {','.join(every)}")
    if args.no_yardstick:
        args.runs = [name for name in args.runs if name != YARDSTICK and name not in ONE_PROCESS]
        if "exact" not in args.runs:
            ap.error("--no-yardstick leaves neither exact nor one-process among --runs: add exact")
    if args.short:
        args.iterations, args.rounds, args.repeats, args.tail, args.eval_every = 12, 2, 1, 3, 3
    if args.eval_every < args.warmup + 2:
        ap.error(f"--eval-every {args.eval_every} leaves fewer than 2 timed iterations between evaluations: give "
                 f"at least {args.warmup + 2}")
    if args.iterations < args.rounds * (args.warmup + 2):
        ap.error(f"--iterations {args.iterations} leaves fewer than 2 timed iterations per block: give at least "
                 f"{args.rounds * (args.warmup + 2)} or fewer --rounds")
    for name in filter(None, (args.network, args.fast_network, args.fast_nodes)):  # before any training
        try:
            get_link(name)
        except PresetError as e:
            ap.error(str(e))
    if ClusterSpec.resolve(args.cluster).topology().node_count < 2:
        ap.error(f"cluster {args.cluster} is one node: give a cluster of two nodes (C, C-4+4, A, A-4+4)")
    return args


def emulate(args: argparse.Namespace, spec: ClusterSpec, model_fn: Any, job: dict) -> tuple[Any, float]:
    """Calibrate the cluster's scales to the model on this machine: (calibration, time scale)."""
    fit = measure_link(spec.world_size, job["param_bytes"])
    job["floor"] = LinkSpeed(fit["bandwidth_bytes_per_s"], fit["latency_s"])
    flat_link = LinkSpec.create(fit["latency_s"], fit["bandwidth_bytes_per_s"], spec.world_size)
    try:
        pj = ProfileJob(model_fn, llama_loss_fn, job["sample_fn"], job["optimizer_fn"],
                        ProfileOptions(max_batch=args.max_batch))
        cal = calibrate_stages(pj, spec, [STAGE], link=flat_link)
    finally:
        flat_link.remove()
    return cal, cal.time_scale * args.slowdown


def links(spec: ClusterSpec) -> str:
    """``spec``'s links in a line: its nodes' own, and the network between them."""
    return f"{'/'.join(link.name for link in spec.node_links())} nodes over {spec.network.name}"


def run_network(spec: ClusterSpec, cal: Any, time_scale: float, job: dict) -> list[dict]:
    """The worker on every rank of ``spec`` (its nodes and network) at the calibrated scales."""
    emulated = EmulatedCluster(spec, cal.memory_scale, time_scale)
    network = emulated.network(job["param_bytes"], job["floor"])
    print(f"# {spec.name}, {links(spec)}: memory scale {cal.memory_scale:.3g}, time scale {time_scale:.3g}; "
          f"{network.describe()}", file=sys.stderr, flush=True)
    try:
        devices = cluster_devices(emulated.spec, cal.memory_scale, time_scale, link=network)
        job = dict(job, devices=devices, topology=emulated.topology)
        return spawn(worker, spec.world_size, (job,), timeout_s=4 * 3600, collective_timeout_s=900)
    finally:
        network.remove()


def fast_cases(args: argparse.Namespace, spec: ClusterSpec) -> dict[str, ClusterSpec]:
    """``--lossy-auto``'s fast cases, by label: the cluster over ``--fast-network``, and the same
    GPUs with ``--fast-nodes`` inside each machine over it (unless ``--fast-nodes`` is '')."""
    fast = spec.with_network(args.fast_network)
    cases = [fast]
    if args.fast_nodes:
        cases.append(dataclasses.replace(fast, nodes=[dataclasses.replace(n, link=get_link(args.fast_nodes))
                                                     for n in spec.nodes]))
    return {links(case): case for case in cases}


def on_cluster(args: argparse.Namespace, spec: ClusterSpec, model_fn: Any, job: dict) -> tuple[list, dict, float]:
    """The runs on the emulated cluster, and auto mode's lossy choices: (per-rank results, choices,
    time scale); nothing where ``--runs`` names none of them."""
    if not set(args.runs) & set(CLUSTER_RUNS):
        return [], {}, 0.0
    job["lossy_auto"] = args.lossy_auto
    cal, time_scale = emulate(args, spec, model_fn, job)
    slow = spec.with_network(args.network)
    results = run_network(slow, cal, time_scale, job)
    choices = {}
    if args.lossy_auto:  # the fast cases profile and plan only
        choices[links(slow)] = (results[0]["plans"]["exact"], results[0]["lossy_auto"])
        for label, case in fast_cases(args, spec).items():
            res = run_network(case, cal, time_scale, dict(job, train=None))
            choices[label] = (res[0]["plans"]["exact"], res[0]["lossy_auto"])
    return results, choices, time_scale


def summary(rows: dict[str, Any], results: list[dict]) -> dict[str, Any]:
    """RESULT's measured keys (module doc)."""
    def rel(name: str, loss: str, against: str | None = None) -> float | None:
        """|name's loss / against's - 1| (against: the baseline), None where either did not run."""
        against = against or baseline(rows)
        if name not in rows or against not in rows:
            return None
        return abs(rows[name][f"{loss}_loss"] / rows[against][f"{loss}_loss"] - 1)
    quantized = [abs(rows[k]["eval_rel"]) for k in RUNS if k != "exact" and k in rows]
    both = rows.get("both", {})
    return {"max_eval_loss_rel_diff": max(quantized) if quantized else None,
            "yardstick_eval_loss_rel_diff": rel(YARDSTICK, "eval"),
            "yardstick_train_loss_rel_diff": rel(YARDSTICK, "train"),
            "one_process_eval_loss_rel_diff": rel("one-process", "eval", "exact"),
            "bf16_eval_loss_rel_diff": rel("one-process-bf16", "eval", "one-process"),
            "bf16_train_loss_rel_diff": rel("one-process-bf16", "train", "one-process"),
            "speedup_vs_exact_link_bound": both.get("speedup"), "cross_node_bytes_ratio": both.get("bytes_ratio"),
            "late_step_fraction": late_fraction(*(sum(r[k] for r in rows.values()) for k in ("late", "padded"))),
            "late_collective_fraction": late_fraction(sum(r["late_collectives"] for r in results),
                                                      sum(r["paced_collectives"] for r in results))}


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    spec = ClusterSpec.resolve(args.cluster)
    model_fn = functools.partial(create_model, "llama-tiny", max_seq_len=args.seq, seed=args.seed)
    held_out = torch.stack([b for b in TextBlocks(seq_len=args.seq, split="val")])
    job = {"model_fn": model_fn, "sample_fn": functools.partial(profile_sample, seq=args.seq),
           "optimizer_fn": functools.partial(adamw, lr=args.lr), "param_bytes": model_size(model_fn())[1],
           "repeats": args.repeats, "max_batch": args.max_batch, "gbs": args.gbs, "seed": args.seed,
           "collectives": args.collectives, "participation": args.participation, "warmup": args.warmup,
           "eval_every": args.eval_every, "iterations": args.iterations, "rounds": args.rounds,
           "train": TextBlocks(seq_len=args.seq, split="train"), "held_out": held_out, "runs": args.runs}
    results, choices, time_scale = on_cluster(args, spec, model_fn, job)
    local = {name: one_process(job, dtype) for name, dtype in ONE_PROCESS.items() if name in args.runs}
    rows = analyse(results, local, args.tail, held_out_loss(model_fn, model_fn().state_dict(), held_out))
    exact = Plan.from_dict(results[0]["plans"]["exact"]) if results else None
    result = {**summary(rows, results), "targets": TARGETS, "short": args.short, "cluster": args.cluster,
              "network": args.network, "exact_way": way(exact) if exact else None, "iterations": args.iterations,
              "seed": args.seed, "lr": args.lr, "time_scale": time_scale, "wall_s": round(time.perf_counter() - t0, 1),
              "lossy_auto": {case: Plan.from_dict(lossy).compression.describe() for case, (_, lossy) in choices.items()}}
    title = (f"llama-tiny, {args.cluster} over {args.network}, ZeRO-3 ({way(exact) if exact else 'one process'}), "
             f"gbs {args.gbs}, lr {args.lr:g}, {args.iterations} iterations, seed {args.seed}")
    missing = plot(rows, args.plot, title) if args.plot else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": 1, "rows": rows, "result": result, "links": results[0]["links"] if results else [],
                       "plans": results[0]["plans"] if results else {}, "lossy_auto": choices}, f, indent=1)
    if exact:
        print(f"# exact plan: {way(exact)}, rows (mbs x accum) "
              + ", ".join(f"{r.micro_batch_size}x{r.accum_steps}" for r in exact.ranks)
              + f", predicted {exact.predicted_iteration_s:.3f} s per iteration")
        print(f"# links: {'; '.join(results[0]['links'])}")
    print(table(rows))
    if choices:
        print(lossy_table(choices))
    if missing:
        print(f"# {missing}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
