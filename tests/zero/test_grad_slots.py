"""ZeRO-0/1 gradient slots are written, not zeroed (poplar.zero.replicated, Note: gradient slots
are written, not zeroed): a parameter that backward reaches in one iteration and not in the next
steps on a zero gradient there (not on the last one's), and gradients of several micro-steps add
up; the parameters equal plain torch on the whole batch with SGD and momentum."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar.engine import PoplarEngine
from poplar.types.plans import Plan, RankPlan
from poplar.zero.config import ZeroConfig

ITERATIONS = 4


class Branchy(nn.Module):
    """``b`` is used on even iterations only (``use_b``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.head(torch.tanh(self.b(h)) if self.use_b else h)


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def batch(it: int) -> torch.Tensor:
    return torch.randn(6, 6, generator=torch.Generator().manual_seed(it))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_parameter_unused_in_an_iteration_steps_on_zero(stage: int) -> None:
    torch.set_num_threads(1)
    model = Branchy()
    engine = PoplarEngine(model, optimizer(model), zero_stage=ZeroConfig(stage, bucket_size_mb=0.0001),
                          plan=Plan([RankPlan(2, 3, 0)]))  # 3 micro-steps of 2 samples
    reference = Branchy()
    ref_opt = optimizer(reference)
    for it in range(ITERATIONS):
        model.use_b = reference.use_b = it % 2 == 0
        engine.train_step(batch(it), loss_fn)
        ref_opt.zero_grad(set_to_none=False)  # an unused parameter's gradient is zero, as the engine's
        loss_fn(reference, batch(it)).backward()
        ref_opt.step()
    got = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=name)
