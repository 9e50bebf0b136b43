"""Hugging Face GPT-2, Llama and BERT masked-LM on 3 gloo ranks under uneven plans, trained with
(loss_sum, count) token losses on right-padded variable-length batches, equal single-process
training with loss = Σ sums / Σ counts (SGD with momentum, with and without clipping)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from poplar.process.launch import spawn  # noqa: E402
from poplar.engine import PoplarEngine  # noqa: E402
from tests.toy import plan_of  # noqa: E402
from tests.workloads.hf_tiny import (global_batch, loss_fn_of, make_model, optimizer, rank_part,  # noqa: E402
                                     reference, state_errors)
from poplar.zero.config import ZeroConfig

ITERATIONS, GBS = 3, 10
# n_i = 5, 1, 4 (micro-steps 3, 1, 2) and 4, 0, 6 (a rank with no samples)
PLANS = [plan_of((2, 2, 1), (1, 1, 0), (3, 1, 1)), plan_of((3, 1, 1), (0, 0, 0), (2, 3, 0))]
# every model at stages 0 and 3, every stage on GPT-2; odd stages clip (0.5 is below the norm)
STAGES = {"gpt2": (0, 1, 2, 3), "llama": (0, 3), "bert": (0, 3)}


def max_norm_of(stage: int) -> float | None:
    return 0.5 if stage % 2 else None


def worker(rank: int, world: int) -> dict:
    out = {}
    for kind, stages in STAGES.items():
        for stage in stages:
            plan = PLANS[stage % 2]
            model = make_model(kind)
            engine = PoplarEngine(model, optimizer(model), zero_stage=ZeroConfig(stage, bucket_size_mb=0.001), plan=plan,
                                  max_grad_norm=max_norm_of(stage), loss_fn=loss_fn_of(kind))
            losses = [engine.train_step(rank_part(global_batch(kind, it, GBS), plan, rank))
                      for it in range(ITERATIONS)]
            out[kind, stage] = (losses, engine.full_state_dict(), engine.last_loss_count)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """One 3-rank run trains every (model, stage): starting ranks that import transformers costs
    more than the training."""
    return spawn(worker, 3, timeout_s=300)


@pytest.mark.parametrize("kind", list(STAGES))
@pytest.mark.multiprocess
def test_token_weighted_hf_models_match_single_process(kind: str, results: list[dict]) -> None:
    refs = {}
    for stage in STAGES[kind]:
        norm = max_norm_of(stage)
        if norm not in refs:
            refs[norm] = reference(kind, GBS, ITERATIONS, norm)
        ref_losses, ref_state = refs[norm]
        count = int((global_batch(kind, ITERATIONS - 1, GBS)["labels"][:, 1 if kind != "bert" else 0:] != -100).sum())
        for rank, res in enumerate(results):
            losses, state, last_count = res[kind, stage]
            errors = state_errors(state, ref_state)
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, (kind, stage, rank, worst, errors[worst])
            assert losses == pytest.approx(ref_losses, rel=1e-5), (kind, stage, rank)
            assert last_count == count


@pytest.mark.parametrize("kind", list(STAGES))
def test_reference_moves_and_weights_by_tokens(kind: str) -> None:
    """Guard against vacuous comparisons: training moves every model, and per-sample weighting of
    the same batches would end elsewhere (the sequences hold different numbers of tokens)."""
    import torch

    _, state = reference(kind, GBS, ITERATIONS, None)
    init = make_model(kind).state_dict()
    assert max(state_errors(state, init).values()) > 1e-2
    model = make_model(kind)
    opt = optimizer(model)
    for it in range(ITERATIONS):  # mean over samples of each sample's token mean
        batch = global_batch(kind, it, GBS)
        per_sample = []
        for i in range(GBS):
            total, count = loss_fn_of(kind)(model, {k: v[i:i + 1] for k, v in batch.items()})
            per_sample.append(total / count.clamp_min(1))
        torch.stack(per_sample).mean().backward()
        opt.step()
        opt.zero_grad()
    assert max(state_errors(model.state_dict(), state).values()) > 1e-4
