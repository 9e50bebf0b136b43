"""``torch.compile`` with the engine at ZeRO-0..3 on 2 gloo ranks: per-block compile (each block's
``module.compile()``, as FSDP2 and torchtitan use it) and whole-model compile (``model.compile()``)
train exactly as eager does, and the graph breaks dynamo meets are counted, so that a hook of
Poplar's that dynamo starts tracing shows up here (poplar.zero.eager_hooks).

The backend is ``aot_eager``: dynamo and AOTAutograd are the parts that meet Poplar's hooks, the
autograd graph and the parameters' storage; inductor only generates the kernels, and takes far
longer to compile on a CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.zero.config import ZeroConfig
from tests.toy import max_rel_err, plan_of, rank_slice, train_reference

VOCAB, DIM = 37, 13
PLAN = plan_of((2, 1, 1), (1, 2, 0))  # micro-batches of 2 and 1, and 1 and 1: a global batch of 5
ITERATIONS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 29), nn.Linear(29, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class BlockNet(nn.Module):
    """Two blocks between an embedding and the head tied to it; sizes divide by neither 2 nor 3."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_model() -> BlockNet:
    torch.manual_seed(0)
    return BlockNet()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def global_batch(iteration: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (PLAN.global_batch_size, 7), generator=torch.Generator().manual_seed(iteration))


def graph_breaks() -> int:
    """What dynamo could not trace since the last reset: graph breaks, and calls whose frame it
    gave up on (both cut the compiled graph)."""
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())


def train(rank: int, stage: int, mode: str) -> dict[str, Any]:
    """Train ITERATIONS steps at ``stage``, eager or compiled as ``mode`` says."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # a fresh cache: no recompile limit carried over from an earlier run
    graphs = CompileCounterWithBackend("aot_eager")
    model = make_model()
    if mode == "block":  # before the engine, as a model is prepared
        for block in model.layers:
            block.compile(backend=graphs)
    engine = PoplarEngine(model, make_optimizer(model), plan=PLAN,
                          zero_stage=ZeroConfig(stage, wrap_policy={Block} if stage == 3 else None))
    if mode == "whole":  # after it: the engine's hooks are on the model already
        model.compile(backend=graphs)
    losses = [engine.train_step(rank_slice(global_batch(it), PLAN, rank), loss_fn) for it in range(ITERATIONS)]
    return {"losses": losses, "state": engine.full_state_dict(), "breaks": graph_breaks(),
            "graphs": graphs.frame_count}


def compile_worker(rank: int, world: int, mode: str) -> dict[int, dict[str, Any]]:
    out = {}
    for stage in (0, 1, 2, 3):
        eager, compiled = train(rank, stage, "eager"), train(rank, stage, mode)
        out[stage] = {"eager": eager, "compiled": compiled}
    return out


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    return train_reference(model, make_optimizer(model), lambda it: loss_fn(model, global_batch(it)), ITERATIONS,
                           None)


# The graph breaks dynamo meets, per stage. Per-block compile traces each block's call, hooks
# included: every hook of Poplar's on a block runs eagerly at the edge of the compiled call, so
# there is no break. Whole-model compile at stages 0-2 traces the whole forward, with the
# engine's hooks at its edges. At ZeRO-3 the blocks' gather hooks are inside the model's forward:
# dynamo meets the first one (counted twice: it tries the frame, then again without the failed
# inlining), gives up on the model's own frame, which runs eagerly, and compiles each block's
# call on its own, as per-block compile does.
BREAKS = {"block": {0: 0, 1: 0, 2: 0, 3: 0}, "whole": {0: 0, 1: 0, 2: 0, 3: 2}}


def graphs_expected(rank: int) -> int:
    """One graph (both blocks share it under per-block compile) per micro-batch size of the rank:
    dynamo specialises a batch of 1, so a rank with micro-batches of 2 and 1 compiles two."""
    return len(set(PLAN.ranks[rank].micro_batch_sizes()))


@pytest.mark.parametrize("mode", ["block", "whole"])
@pytest.mark.multiprocess
def test_compiled_training_equals_eager_with_the_graph_breaks_counted(mode: str) -> None:
    results = spawn(compile_worker, 2, (mode,), timeout_s=240)
    ref_losses, ref_state = reference()
    for rank, by_stage in enumerate(results):
        for stage, runs in by_stage.items():
            eager, compiled = runs["eager"], runs["compiled"]
            assert eager["graphs"] == 0 and eager["breaks"] == 0  # the eager run compiled nothing
            assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5), (rank, stage)
            assert max_rel_err(compiled["state"], eager["state"]) <= 1e-5, (rank, stage)
            assert compiled["losses"] == pytest.approx(ref_losses, rel=1e-5), (rank, stage)
            assert max_rel_err(compiled["state"], ref_state) <= 1e-5, (rank, stage)
            assert compiled["breaks"] == BREAKS[mode][stage], (rank, stage)
            assert compiled["graphs"] == graphs_expected(rank), (rank, stage)


@pytest.mark.parametrize("when", ["before", "after", "never"])
def test_a_cpu_run_that_compiles_says_what_it_costs_once(when: str) -> None:
    """A run on a CPU with compiled modules says once what compiling costs there (a 10-step CPU
    run took minutes compiled against seconds eager), whether the model was compiled before the
    engine was built (per block) or after it (whole model); an eager run says nothing. The
    compiled calls run eagerly here (``set_stance("force_eager")``): the note is about the
    model, and the test pays no compile."""
    import logging

    from tests.log_lines import Lines

    lines, logger = Lines(), logging.getLogger("poplar")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    one = plan_of((2, 1, 1))
    try:
        with torch.compiler.set_stance("force_eager"):
            model = make_model()
            if when == "before":
                for block in model.layers:
                    block.compile(backend="eager")
            engine = PoplarEngine(model, make_optimizer(model), plan=one)
            if when == "after":
                model.compile(backend="eager")
            for it in range(2):
                engine.train_step(global_batch(it)[:one.global_batch_size], loss_fn)
            engine.close()
    finally:
        logger.removeHandler(lines)
        logger.level = level
    said = [line for line in lines.lines if line.startswith("torch.compile on CPU")]
    if when == "never":
        assert said == []
        return
    assert len(said) == 1, lines.lines
    named = "2 compiled modules (layers.0, layers.1)" if when == "before" else "1 compiled module (the model)"
    assert said[0].startswith(f"torch.compile on CPU: {named}; each compiles at its first call") and \
        "dominates a short run" in said[0]
