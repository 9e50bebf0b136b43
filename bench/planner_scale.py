"""Planning time at scale: 8, 1,000 and 10,000 ranks over (up to) 16 device types, ZeRO-0..3.

The 16 types are the 8 device presets and a perturbed copy of each (speed x0.8-1.2, memory
x0.75-1.25, half-batch x0.5-1.5, fixed seed). Ranks are spread over the types round-robin and
the global batch is 32 samples per rank. Each cell is the median wall time of ``poplar.plan``
on a ready ``Profile`` (curves built from the profile's points included). The last line is
``RESULT {json}``; ``seconds_10000`` is the slowest stage at 10,000 ranks (target < 1 s).

    .venv/bin/python bench/planner_scale.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from poplar.planner import plan
from poplar.emulation.synthetic import profile_from_presets
from poplar.emulation.presets import PRESETS


def device_types(seed: int = 0) -> list:
    rng = random.Random(seed)
    out = list(PRESETS.values())
    for p in PRESETS.values():
        out.append(dataclasses.replace(
            p, name=f"{p.name}-v2", relative_speed=p.relative_speed * rng.uniform(0.8, 1.2),
            memory_gb=p.memory_gb * rng.uniform(0.75, 1.25), half_batch=p.half_batch * rng.uniform(0.5, 1.5)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="8,1000,10000")
    args = ap.parse_args()
    types = device_types()
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict[int, dict[int, float]] = {}
    print(f"{'ranks':>6} {'types':>5} {'gbs':>7} " + " ".join(f"{'ZeRO-' + str(s) + ' s':>10}" for s in range(4)))
    for n in sizes:
        presets = [types[i % len(types)] for i in range(n)]
        gbs = 32 * n
        row = {}
        for stage in range(4):
            profile = profile_from_presets(presets, stage)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                p = plan(profile, gbs, stage)
                times.append(time.perf_counter() - t0)
                assert p.global_batch_size == gbs
            row[stage] = statistics.median(times)
        results[n] = row
        print(f"{n:>6} {min(n, len(types)):>5} {gbs:>7} " + " ".join(f"{row[s]:>10.4f}" for s in range(4)))
    out = {f"seconds_{n}": max(results[n].values()) for n in sizes}
    out.update({f"seconds_{n}_stage{s}": results[n][s] for n in sizes for s in range(4)})
    out["device_types"] = len(types)
    out["repeats"] = args.repeats
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
