"""memory_report() against docs/design.md §3 for a ~440k-parameter model with AdamW (K = 8 bytes/param), cut
into several communication units (buckets of 0.25 MB)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar.engine import PoplarEngine
from poplar.process.launch import spawn
from poplar.types.plans import Plan
from poplar.zero.config import ZeroConfig

BUCKET_MB = 0.25


def seven_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(250, 250) for _ in range(7)])  # Ψ = 439,250


def memory_worker(rank: int, world: int, stage: int) -> dict:
    model = seven_layers()
    plan = Plan.even(world, 2 * world, 1)
    engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=ZeroConfig(stage, bucket_size_mb=BUCKET_MB), plan=plan)
    x = torch.randn(2, 250)
    engine.train_step(x, lambda m, b: m(b).pow(2).mean())
    report = engine.memory_report()
    report["psi"] = sum(p.numel() for p in model.parameters())
    report["largest_unit_bytes"] = max(u.padded_numel * u.element_size for u in engine.stage.units)
    return report


def expected(stage: int, psi: int, n: int) -> dict[str, float]:
    return {"params": 4 * psi, "grads": 4 * psi / (n if stage >= 2 else 1),
            "optimizer": 8 * psi / (n if stage >= 1 else 1)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.multiprocess
def test_memory_report_matches_design(world: int) -> None:
    for stage in (0, 1, 2):
        reports = spawn(memory_worker, world, (stage,), timeout_s=180)
        for rank, rep in enumerate(reports):
            for key, want in expected(stage, rep["psi"], world).items():
                assert abs(rep[key] - want) <= 0.02 * want, (stage, rank, key, rep[key], want)
            # declared buffers: at most the in-flight buckets plus one being filled, with their shards
            assert rep["comm_buffers"] <= 3 * rep["largest_unit_bytes"] * (1 + 1 / world), (stage, rep)
            if stage == 2:
                assert rep["comm_buffers"] > 0
