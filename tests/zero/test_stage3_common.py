"""Models, the single-process reference and the shared multi-process run of the ZeRO-3 tests
(no tests here)."""

from __future__ import annotations

import functools
import importlib
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from poplar.process.launch import spawn
from poplar.workloads import ResidualMLP
from tests.toy import DIM, HIDDEN, VOCAB, global_batch, loss_fn, make_optimizer

# One spawn per world size runs the workers of several test files (process start-up dominates
# these tests' time): tests/zero/test_stage3_<part>.py each define ``worker(rank, world)``.
PARTS = {2: ("parity", "errors", "memory"), 3: ("parity", "ledger"), 4: ("memory",)}


class Block(ResidualMLP):
    """The residual MLP block at sizes (13, 29), which divide by neither 2 nor 3."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__(dim, hidden)


class TinyLM(nn.Module):
    """Transformer-shaped: embedding tied to the head, a ModuleList of blocks, a final norm."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class Branches(nn.Module):
    """Three independent blocks whose outputs are summed; ``swap`` runs them in reverse order
    (the same math, another order of the blocks in forward and in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.a = Block()
        self.b = Block()
        self.c = Block()
        self.head = nn.Linear(DIM, VOCAB)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        order = [self.c, self.b, self.a] if self.swap else [self.a, self.b, self.c]
        y = order[0](h)
        for branch in order[1:]:
            y = branch(h) + y
        return self.head(y)


def tiny_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def branches(seed: int = 0) -> Branches:
    torch.manual_seed(seed)
    return Branches()


def reference(make: Callable[[], nn.Module], kind: str, gbs: int, iterations: int, max_grad_norm: float | None
              ) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    """Single-process training on the whole global batch (as ``tests.toy.reference_run``)."""
    model = make()
    opt = make_optimizer(model, kind)
    losses = []
    for it in range(iterations):
        loss = loss_fn(model, global_batch(it, gbs))
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


@contextmanager
def one_thread() -> Iterator[None]:
    """Reference runs in the test process: one thread (many threads on a busy machine are slow)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def stage3_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in PARTS[world]:
        try:
            out[part] = importlib.import_module(f"tests.zero.test_stage3_{part}").worker(rank, world)
        except Exception:  # noqa: BLE001 - reported by that part's test, the other parts still run
            out[part] = RuntimeError(traceback.format_exc())
    return out


@functools.lru_cache(maxsize=None)
def _run(world: int) -> list[dict[str, Any]]:
    return spawn(stage3_worker, world, timeout_s=360)


def part_results(world: int, part: str) -> list[Any]:
    """Each rank's result of ``tests/zero/test_stage3_<part>.py``'s worker on ``world`` gloo ranks."""
    results = [r[part] for r in _run(world)]
    for rank, r in enumerate(results):
        if isinstance(r, RuntimeError):
            raise AssertionError(f"rank {rank} failed in the {part} worker:\n{r}")
    return results
