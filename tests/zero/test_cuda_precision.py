"""bf16 and fp16 on a GPU: the runtime as a world of one on CUDA, against fp32 on the same GPU.

Skipped without a GPU (CI has none); written to run as is on one.
"""

from __future__ import annotations

import pytest
import torch

from poplar.engine import PoplarEngine
from poplar.types.plans import Plan
from poplar.workloads.models import create_model, llama_loss_fn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PLAN = Plan.even(1, 8, 4)  # two micro-steps of 4 samples
SEQ = 32


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 260, (8, SEQ + 1), generator=g).cuda() for _ in range(n)]


def losses(stage: int, precision: str | None, steps: int = 6, loss_fn=llama_loss_fn) -> tuple[list[float], PoplarEngine]:
    model = create_model("llama-tiny", seed=0, max_seq_len=SEQ).cuda()
    engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=3e-3), zero_stage=stage, plan=PLAN,
                          mixed_precision=precision)
    return [engine.train_step(b, loss_fn) for b in batches(steps)], engine


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_follows_fp32_on_the_gpu(stage: int) -> None:
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    ref, _ = losses(stage, None)
    got, engine = losses(stage, "bf16")
    assert all(abs(a - b) <= 0.01 * abs(a) for a, b in zip(ref, got)), (ref, got)
    assert {v.dtype for v in engine.full_state_dict().values()} == {torch.float32}


def test_fp16_skips_overflows_and_backs_the_scale_off() -> None:
    calls = []

    def overflow_once(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        loss = llama_loss_fn(model, tokens)
        return loss * float("inf") if 3 <= len(calls) <= 6 else loss  # iterations 1 and 2 (hysteresis 2)

    got, engine = losses(2, "fp16", steps=8, loss_fn=overflow_once)
    assert engine.skipped_steps >= 2 and engine.loss_scale < 2.0 ** 16, (engine.skipped_steps, engine.loss_scale)
    finite = [x for x in got if x == x and abs(x) != float("inf")]
    assert len(finite) >= 4 and finite[-1] < finite[0], got
