"""`poplar demo`: three emulated ranks on one CPU machine train a small model under an uneven
plan, and the result is checked against single-process training on the whole global batch."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from poplar.engine import PoplarEngine
from poplar.launch import spawn
from poplar.plans import Plan, RankPlan

# n_i = 7, 2, 5 samples per iteration from three differently shaped rows
DEMO_PLAN = Plan([RankPlan(3, 2, 1), RankPlan(2, 1, 0), RankPlan(2, 2, 1)])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


def _data(iteration: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(iteration)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :10].argmax(dim=1))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _rank_main(rank: int, world: int, stage: int, iterations: int) -> dict[str, Any]:
    model = _model()
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                          zero_stage=stage, plan=DEMO_PLAN)
    start, n = DEMO_PLAN.sample_offsets()[rank], DEMO_PLAN.ranks[rank].num_samples
    losses = []
    t0 = time.perf_counter()
    for it in range(iterations):
        x, y = _data(it, DEMO_PLAN.global_batch_size)
        losses.append(engine.train_step((x[start:start + n], y[start:start + n]), _loss))
    return {"losses": losses, "state": engine.full_state_dict(), "seconds": time.perf_counter() - t0,
            "comm": engine.comm_ledger.summary()}


def _reference(iterations: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for it in range(iterations):
        loss = _loss(model, _data(it, DEMO_PLAN.global_batch_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def run(stage: int = 2, iterations: int = 20) -> float:
    print(f"Poplar demo: 3 gloo ranks on CPU, ZeRO-{stage}, uneven plan, {iterations} iterations\n")
    print(DEMO_PLAN.table() + "\n")
    results = spawn(_rank_main, DEMO_PLAN.world_size, (stage, iterations), timeout_s=300)
    ref_losses, ref_state = _reference(iterations)
    worst = 0.0
    for rank, res in enumerate(results):
        err = max(float((res["state"][k] - v).norm() / v.norm()) for k, v in ref_state.items())
        worst = max(worst, err)
        comm = ", ".join(f"{op} x{int(s['count'])}" for op, s in sorted(res["comm"].items()))
        print(f"rank {rank}: {DEMO_PLAN.ranks[rank].num_samples} samples/iteration, "
              f"{res['seconds']:.2f} s, collectives: {comm}")
    print(f"\nloss: {results[0]['losses'][0]:.4f} -> {results[0]['losses'][-1]:.4f} "
          f"(single process: {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f})")
    print(f"largest relative difference from single-process training: {worst:.2e}")
    print("agreement: OK" if worst <= 1e-5 else "agreement: FAILED")
    return worst


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train on an emulated 3-rank CPU cluster under an uneven plan")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--iterations", type=int, default=20)
    p.set_defaults(func=lambda a: 0 if run(a.stage, a.iterations) <= 1e-5 else 1)
