"""Model-state memory per rank for ZeRO stages 0-2 vs docs/design.md §3 (fp32 AdamW, K = 8 bytes/param),
for a ~7M-parameter model on 2 and 4 gloo ranks. Prints a table and a `RESULT {json}` line."""

from __future__ import annotations

import json

import torch
from torch import nn

from poplar.engine import PoplarEngine
from poplar.process.launch import spawn
from poplar.types.plans import Plan
from poplar.zero.config import ZeroConfig


def worker(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(7)])
    engine = PoplarEngine(model, torch.optim.AdamW(model.parameters()), zero_stage=ZeroConfig(stage, bucket_size_mb=4.0),
                          plan=Plan.even(world, 2 * world, 1))
    engine.train_step(torch.randn(2, 1000), lambda m, b: m(b).pow(2).mean())
    return {**engine.memory_report(), "psi": sum(p.numel() for p in model.parameters())}


def main() -> None:
    rows, worst = [], 0.0
    print(f"{'ranks':>5} {'stage':>5} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'comm buf MB':>11} "
          f"{'design MB':>10} {'ours/design':>11}")
    for world in (2, 4):
        for stage in (0, 1, 2):
            rep = spawn(worker, world, (stage,), timeout_s=300)[0]
            psi = rep["psi"]
            design = 4 * psi + 4 * psi / (world if stage >= 2 else 1) + 8 * psi / (world if stage >= 1 else 1)
            ours = rep["params"] + rep["grads"] + rep["optimizer"]
            worst = max(worst, abs(ours / design - 1))
            rows.append({"ranks": world, "stage": stage, **rep, "design": design})
            print(f"{world:>5} {stage:>5} {rep['params'] / 1e6:>10.2f} {rep['grads'] / 1e6:>9.2f} "
                  f"{rep['optimizer'] / 1e6:>9.2f} {rep['comm_buffers'] / 1e6:>11.2f} {design / 1e6:>10.2f} "
                  f"{ours / design:>11.4f}")
    print("RESULT " + json.dumps({"max_model_state_rel_dev": worst, "rows": rows}))


if __name__ == "__main__":
    main()
