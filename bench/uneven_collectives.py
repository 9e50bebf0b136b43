"""The uneven all-gather and reduce-scatter (``poplar.comm.uneven``), method against method.

Every rank holds a part of a flat fp32 buffer in proportion to its shard weight (default 5:1:2
on 3 ranks) and runs, in interleaved rounds (A, B, C, A, B, C, ...): each uneven method that the
backend runs, and the even collective of the same buffer as the yardstick. A round's time is
the slowest rank's; the table shows medians and each method ÷ the even collective, and the
bytes each method puts on the wire. Last line: ``RESULT {json}``.

    python bench/uneven_collectives.py [--weights 5,1,2] [--numel 4000000] [--repeats 9]
    python bench/uneven_collectives.py --device cuda   # NCCL, a world of one per GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from poplar.comm import Communicator
from poplar.comm import uneven
from poplar.process.launch import spawn
from poplar.zero.shard_layout import ShardLayout

METHODS = {"all_gather": [uneven.UnevenMethod.LISTED, uneven.UnevenMethod.BROADCASTS, uneven.UnevenMethod.PADDED],
           "reduce_scatter": [uneven.UnevenMethod.LISTED, uneven.UnevenMethod.PADDED]}


def _runs(op: str, method: uneven.UnevenMethod, rank: int, sizes: tuple[int, ...], device: torch.device) -> bool:
    """Whether ``method`` runs ``op`` on this backend (one small trial, every rank together)."""
    flat, part = torch.zeros(sum(sizes), device=device), torch.ones(sizes[rank], device=device)
    try:
        call = (uneven.all_gather(flat, part, sizes, rank, None, method) if op == "all_gather"
                else uneven.reduce_scatter(part, flat, sizes, rank, None, method))
        call.run(False)
        if call.finish is not None:
            call.finish()
        ok = 1.0
    except RuntimeError:
        ok = 0.0
    verdict = torch.tensor([ok])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return verdict.item() == 1.0


def worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    device = torch.device("cuda", rank) if args["device"] == "cuda" else torch.device("cpu")
    layout = ShardLayout.of(args["numel"], args["weights"])
    sizes = layout.sizes
    even = ShardLayout.of(args["numel"], [1.0] * world)
    small_sizes = ShardLayout.of(4096, args["weights"]).sizes
    flat = torch.randn(layout.padded_numel, device=device)
    part = torch.randn(sizes[rank], device=device)
    even_flat = torch.randn(even.padded_numel, device=device)
    even_part = torch.randn(even.size(rank), device=device)
    comm = Communicator(device=device)

    cases: dict[str, Any] = {}
    for op, methods in METHODS.items():
        for method in methods:
            if not _runs(op, method, rank, small_sizes, device):
                continue
            if op == "all_gather":
                cases[f"{op} {method.value}"] = (lambda m=method: uneven.all_gather(flat, part, sizes, rank, None, m))
            else:
                cases[f"{op} {method.value}"] = (lambda m=method: uneven.reduce_scatter(part, flat, sizes, rank, None, m))
        cases[f"{op} even"] = None
    times: dict[str, list[float]] = {name: [] for name in cases}
    wire: dict[str, int] = {}
    for repeat in range(args["repeats"] + 1):
        for name, make in cases.items():
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if make is None:
                if name.startswith("all_gather"):
                    comm.all_gather(even_flat, even_part)
                else:
                    comm.reduce_scatter(even_part, even_flat)
                wire[name] = even.padded_numel * 4
            else:
                call = make()
                call.run(False)
                if call.finish is not None:
                    call.finish()
                wire[name] = call.wire_bytes
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if repeat:  # the first round warms up
                times[name].append(seconds.item())
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "wire_bytes": wire,
            "sizes": list(sizes), "backend": dist.get_backend()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="5,1,2")
    ap.add_argument("--numel", type=int, default=4_000_000)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args()
    weights = [float(w) for w in a.weights.split(",")]
    args = {"weights": weights, "numel": a.numel, "repeats": a.repeats, "device": a.device}
    backend = "nccl" if a.device == "cuda" else "gloo"
    out = spawn(worker, len(weights), (args,), timeout_s=900, backend=backend, collective_timeout_s=300)[0]
    med, wire = out["median_s"], out["wire_bytes"]
    print(f"{out['backend']}, {len(weights)} ranks, parts {out['sizes']} of {a.numel} fp32 elements "
          f"(weights {a.weights}), medians of {a.repeats} interleaved rounds")
    print(f"{'collective':<28} {'median ms':>10} {'÷ even':>8} {'wire MB':>9}")
    result: dict[str, Any] = {"backend": out["backend"], "weights": weights, "numel": a.numel}
    for name, seconds in med.items():
        op = name.split()[0]
        ratio = seconds / med[f"{op} even"]
        print(f"{name:<28} {1e3 * seconds:>10.2f} {ratio:>8.2f} {wire[name] / 2**20:>9.1f}")
        if not name.endswith("even"):
            result[name.replace(" ", "_") + "_vs_even"] = round(ratio, 3)
    for op in METHODS:
        options = {k: v for k, v in med.items() if k.startswith(op) and not k.endswith("even")}
        result[f"fastest_{op}"] = min(options, key=options.get).split()[1]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
