"""ZeRO-3 memory for a ~7M-parameter model with AdamW: model states ≈ 16Ψ/N per rank, and the
gathered parameters live during forward never exceed the largest block plus one prefetched block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar.engine import PoplarEngine
from tests.zero.test_stage3_common import part_results
from poplar.types.plans import Plan


def seven_million() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(7)])  # Ψ = 7,007,000; one block per Linear


def worker(rank: int, world: int) -> dict:
    model = seven_million()
    psi = sum(p.numel() for p in model.parameters())  # before the engine: then each rank holds only shards
    engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=3,
                          plan=Plan.even(world, 2 * world, 1))
    stage = engine.stage
    seen: list[tuple[int, int]] = []  # (iteration, gathered bytes) when each block's forward starts
    for layer in model:  # registered after the engine's hooks: runs once the block is gathered
        layer.register_forward_pre_hook(lambda m, a: seen.append((engine.iteration, stage.gathered_bytes)))
    for _ in range(3):
        engine.train_step(torch.randn(2, 1000), lambda m, b: m(b).pow(2).mean())
    return {**engine.memory_report(), "psi": psi, "seen": seen,
            "blocks": sorted((b.gathered_nbytes for b in stage.blocks), reverse=True),
            "root": stage.root is not None, "gathered_now": stage.gathered_bytes}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.multiprocess
def test_stage3_memory(world: int) -> None:
    for rep in part_results(world, "memory"):
        psi, n = rep["psi"], world
        for key, want in {"params": 4 * psi / n, "grads": 4 * psi / n, "optimizer": 8 * psi / n}.items():
            assert abs(rep[key] - want) <= 0.01 * want, (key, rep[key], want)
        largest, second = rep["blocks"][:2]
        assert not rep["root"] and len(rep["blocks"]) == 7
        fwd = [b for _, b in rep["seen"]]
        assert max(fwd) <= largest + second  # the block itself plus one prefetched block
        assert {b for it, b in rep["seen"] if it == 0} == {largest}  # no prefetch before the order is known
        assert max(b for it, b in rep["seen"] if it > 0) == largest + second  # prefetch is on afterwards
        assert rep["gathered_params"] <= largest + second  # backward too
        assert rep["gathered_now"] == 0  # everything released between iterations
        # transient gradient buffers: a few blocks' full gradients and their reduced shards
        assert rep["comm_buffers"] <= 3 * largest * (1 + 1 / n)
