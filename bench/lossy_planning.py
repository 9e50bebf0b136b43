"""What the planner predicts for quantized collectives across nodes, and what pricing them costs.

Cluster C as two nodes of 4 (4 A800-80G + 4 V100S-32G, the paper's sizes), the presets'
reference workload, ZeRO-3, global batch 256, each node's link 16 GB/s (PCIe-class) or 150 GB/s
(NVLink-class), the link between the nodes from 1 to 400 Gbit/s. Per case: the fastest exact plan
(which may leave a node out), each quantized option's fastest plan (int8 weights, int8 gradients,
both; across nodes only), the plan ``allow_lossy`` keeps and its predicted saving. These are the
cost model's predictions, not runs. Beside them, the planning time with ``allow_lossy`` over
without (median of ``--repeats``, side by side in one run): it plans every option in full.

    .venv/bin/python bench/lossy_planning.py [--repeats 5]

The last line is ``RESULT {json}``: ``saving_at_10gbit`` (the predicted saving over exact with
PCIe nodes at 10 Gbit/s), ``exact_kept_at_400gbit_nvlink`` (whether exact is kept where every link
is fast) and ``planning_time_ratio`` (allow_lossy over exact, median over the cases).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.synthetic import REFERENCE_MODEL, synthetic_profile
from poplar.planner import CollectivesRequest, plan
from poplar.types.profiles import Links, LinkSpeed
from poplar.types.topology import Topology

LOSSY = CollectivesRequest(allow_lossy=True)


def timed(fn, repeats: int) -> tuple[float, object]:
    seconds, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    base = synthetic_profile(ClusterSpec.resolve("C-4+4"), 3, REFERENCE_MODEL)
    rows, ratios, result = [], [], {}
    print(f"{'nodes':>8} {'cross':>9} {'exact s':>8} {'w8 s':>8} {'g8 s':>8} {'both s':>8} {'kept':>10} "
          f"{'saving':>7} {'plan x':>7}")
    for intra_gbps, name in ((16, "pcie"), (150, "nvlink")):
        for gbit in (1, 10, 25, 100, 400):
            links = Links.tiered(Topology.of_sizes([4, 4]), [LinkSpeed(intra_gbps * 1e9, 30e-6)] * 2,
                                 LinkSpeed(gbit * 1e9 / 8, 30e-6), "simulated")
            prof = replace(base, comm=replace(base.comm, links=links))
            exact_t, _ = timed(lambda: plan(prof, 256, 3), args.repeats)
            lossy_t, chosen = timed(lambda: plan(prof, 256, 3, collectives=LOSSY), args.repeats)
            record = chosen.choice.compression_choice
            by = {c.policy.describe(): c.predicted_s for c in record.candidates}
            cells = [by.get(k) for k in ("exact", "quantized weights int8 (blocks of 256)",
                                         "quantized gradients int8 (blocks of 256)",
                                         "quantized weights int8 and gradients int8 (blocks of 256)")]
            kept = "exact" if not chosen.compression.lossy else \
                "/".join(x for x, on in (("w8", chosen.compression.weights.bits), ("g8", chosen.compression.gradients.bits))
                         if on)
            ratios.append(lossy_t / exact_t)
            print(f"{name:>8} {gbit:>5}gbit " + " ".join(f"{c:8.4f}" if c is not None else f"{'-':>8}" for c in cells)
                  + f" {kept:>10} {100 * record.saving:6.1f}% {lossy_t / exact_t:6.2f}x")
            rows.append({"nodes": name, "cross_gbit": gbit, "kept": kept, "saving": record.saving})
            if (name, gbit) == ("pcie", 10):
                result["saving_at_10gbit"] = round(record.saving, 4)
            if (name, gbit) == ("nvlink", 400):
                result["exact_kept_at_400gbit_nvlink"] = not chosen.compression.lossy
    result["planning_time_ratio"] = round(statistics.median(ratios), 2)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
