"""Hierarchical reduce-scatter and all-gather (``poplar.comm.hierarchical``) against the flat ones.

Ranks are declared as nodes (default two of two: ``--nodes 2,2``) holding parts of a flat fp32
buffer in proportion to their shard weights (default 2:1:1:2). In interleaved rounds each rank
runs the flat and the hierarchical reduce-scatter and all-gather, and the all-gather from kept
secondary shards (the in-node step alone). A round's time is the slowest rank's; the table shows
medians, each hierarchical call ÷ its flat one, and the bytes each node sends across nodes (from
the ledger's link tags) ÷ the minimum, (1 - the node's share) of the buffer. On one machine every
"node" shares the loopback, so the times show the decomposition's overhead, not a slow link's
saving. Last line: ``RESULT {json}``.

    python bench/hierarchical_collectives.py [--nodes 2,2] [--weights 2,1,1,2] [--numel 4000000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from poplar.comm import Communicator
from poplar.process.launch import spawn
from poplar.types.route import Collectives, Route
from poplar.types.topology import Link, Topology
from poplar.zero.shard_layout import ShardLayout

FLAT, SECONDARY = Route(), Route(collectives=Collectives.SECONDARY_SHARDS)
CASES = ("reduce_scatter flat", "reduce_scatter hierarchical", "all_gather flat", "all_gather hierarchical",
         "all_gather within nodes")


def _run(comm: Communicator, name: str, flat: torch.Tensor, part: torch.Tensor, keep: torch.Tensor,
         sizes: tuple[int, ...]) -> None:
    comm.configure(FLAT if name.endswith("flat") else SECONDARY)
    if name.startswith("reduce_scatter"):
        comm.reduce_scatter(part, flat, tag=name, sizes=sizes)
    elif name.endswith("within nodes"):
        comm.all_gather_within_nodes(flat, part, keep, tag=name, sizes=sizes)
    elif name.endswith("hierarchical"):
        comm.all_gather_keeping(flat, part, keep, tag=name, sizes=sizes)
    else:
        comm.all_gather(flat, part, tag=name, sizes=sizes)


def worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    topology = Topology.of_sizes(args["nodes"])
    sizes = ShardLayout.of(args["numel"], args["weights"]).sizes
    comm = Communicator(topology=topology)
    flat, part = torch.randn(sum(sizes)), torch.randn(sizes[rank])
    comm.configure(SECONDARY)
    keep = torch.zeros(comm.secondary_numel(sizes, 0, 4))
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for repeat in range(args["repeats"] + 1):
        if repeat == args["repeats"]:
            comm.ledger.clear()  # the bytes of one round
        for name in CASES:
            dist.barrier()
            t0 = time.perf_counter()
            _run(comm, name, flat, part, keep, sizes)
            seconds = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if repeat:  # the first round warms up
                times[name].append(seconds.item())
    crossed = {name: sum(r.bytes for r in comm.ledger.records if r.tag == name and r.link is Link.CROSS)
               for name in CASES}
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "cross_bytes": crossed,
            "sizes": list(sizes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="2,2")
    ap.add_argument("--weights", default="2,1,1,2")
    ap.add_argument("--numel", type=int, default=4_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    nodes, weights = [int(n) for n in a.nodes.split(",")], [float(w) for w in a.weights.split(",")]
    args = {"nodes": nodes, "weights": weights, "numel": a.numel, "repeats": a.repeats}
    outs = spawn(worker, sum(nodes), (args,), timeout_s=900, collective_timeout_s=300)
    med, sizes = outs[0]["median_s"], outs[0]["sizes"]
    topology = Topology.of_sizes(nodes)
    buffer = sum(sizes) * 4
    print(f"gloo, {sum(nodes)} ranks as {topology.describe()}, parts {sizes} fp32, medians of {a.repeats} "
          f"interleaved rounds, load {os.getloadavg()[0]:.1f}")
    print(f"{'collective':<28} {'median ms':>10} {'÷ flat':>8} " + " ".join(f"{'node ' + str(k) + ' ÷ min':>13}"
                                                                         for k in range(len(nodes))))
    result: dict[str, Any] = {"nodes": nodes, "weights": weights, "numel": a.numel}
    worst = 0.0
    for name in CASES:
        op = name.split()[0]
        ratio = med[name] / med[f"{op} flat"]
        cells = []
        for k, node in enumerate(topology.nodes):
            minimum = buffer - sum(sizes[r] for r in node) * 4
            other = [r for r in range(sum(nodes)) if r not in node]  # all-gather: what this node receives
            sent = sum(outs[r]["cross_bytes"][name] for r in (node if op == "reduce_scatter" else other))
            cells.append("-" if name.endswith("flat") or not minimum else f"{sent / minimum:.3f}")
            if name.endswith("hierarchical") and minimum and len(nodes) == 2:
                worst = max(worst, sent / minimum)
        print(f"{name:<28} {1e3 * med[name]:>10.2f} {ratio:>8.2f} " + " ".join(f"{c:>13}" for c in cells))
        if not name.endswith("flat"):
            result[name.replace(" ", "_") + "_vs_flat"] = round(ratio, 3)
    result["cross_node_bytes_vs_minimum"] = round(worst, 4)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
