"""Activation checkpointing at stages 0-3 on 3 gloo ranks under uneven plans equals single-process
training without it (SGD-momentum): the toy model (every wrapped block, and a policy naming
classes), a transformer-shaped model, and a HF GPT-2 of a tiny config. Also: the modules really
run twice, state_dict keys do not change, ZeRO-3 issues the same collectives as without
checkpointing, and bad policies fail on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poplar.comm import DistributedError
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, plan_of, rank_slice, with_shards
from tests.zero.test_stage3_common import Block, tiny_lm
from poplar.zero.config import ZeroConfig

ITERATIONS = 2
GBS = 14
# the second with shards 5:1:2 (ZeRO-1/2/3 hold state by weight; the math is the same)
PLANS = [plan_of((3, 2, 1), (2, 1, 0), (2, 2, 1)), with_shards(plan_of((3, 3, 1), (0, 0, 0), (2, 2, 0)), (5, 1, 2))]


def gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=37, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def gpt2_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits  # the KV cache as built (on): checkpointing turns it off
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# name -> (model factory, loss, activation_checkpointing, wrap_policy, stages, plans)
CASES = {
    "toy-all": (make_model, loss_fn, True, None, (0, 1, 2, 3), 2),
    "toy-linear": (make_model, loss_fn, {nn.Linear}, {nn.Linear, nn.LayerNorm}, (0, 3), 1),
    "lm-blocks": (tiny_lm, loss_fn, True, None, (0, 1, 2, 3), 1),
    "lm-inner": (tiny_lm, loss_fn, {"Linear"}, None, (3,), 1),
    "gpt2": (gpt2, gpt2_loss, True, None, (0, 1, 2, 3), 1),
}


def reference(make, loss, iterations: int = ITERATIONS) -> dict[str, torch.Tensor]:
    model = make()
    opt = make_optimizer(model, "sgd")
    for it in range(iterations):
        loss(model, global_batch(it, GBS)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(rank: int, make, loss, setting, policy, stage: int, plan) -> tuple[dict, list, int]:
    model = make()
    keys = list(model.state_dict())
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=ZeroConfig(stage, bucket_size_mb=0.001, wrap_policy=policy), plan=plan, activation_checkpointing=setting)
    assert list(model.state_dict()) == keys
    calls = [0]
    first = engine.activation_checkpointing.names[0] if engine.activation_checkpointing.enabled else ""
    if first:
        model.get_submodule(first).register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    for it in range(ITERATIONS):
        engine.train_step(rank_slice(global_batch(it, GBS), plan, rank), loss)
    # the ledger lists an async collective when it is waited on: compare per micro-step, sorted
    ops = sorted((r.iteration, r.micro_step, r.op, r.bytes, r.tag) for r in engine.comm_ledger.of()
                 if r.phase in ("forward", "backward"))
    return engine.full_state_dict(), ops, calls[0]


def worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for name, (make, loss, setting, policy, stages, plans) in CASES.items():
        for stage in stages:
            for pi, plan in enumerate(PLANS[:plans]):
                out[(name, stage, pi)] = run(rank, make, loss, setting, policy, stage, plan)
    # ZeRO-3 without checkpointing: the same collectives, in the same order
    out["lm-plain"] = run(rank, tiny_lm, loss_fn, None, None, 3, PLANS[0])
    errors = {}
    for key, setting, policy, stage in [("none", {nn.GRU}, None, 0), ("outer", {"TinyLM"}, None, 0),
                                        ("contains", {"ModuleList"}, {Block}, 3),
                                        ("bad", 3.5, None, 1)]:
        try:
            model = tiny_lm()
            PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=ZeroConfig(stage, wrap_policy=policy), plan=PLANS[0],
                         activation_checkpointing=setting)
        except DistributedError as e:
            errors[key] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(worker, 3, (), timeout_s=240)


@pytest.mark.multiprocess
def test_parity_with_single_process(results: list[dict]) -> None:
    for name, (make, loss, _, _, stages, plans) in CASES.items():
        ref = reference(make, loss)
        for stage in stages:
            for pi in range(plans):
                for rank, res in enumerate(results):
                    state, _, calls = res[(name, stage, pi)]
                    assert max_rel_err(state, ref) <= 1e-5, (name, stage, pi, rank)
                    micro_steps = PLANS[pi].ranks[rank].accum_steps + (PLANS[pi].ranks[rank].last_batch_size > 0)
                    # forward and recomputation: each micro-step runs the first checkpointed module twice
                    assert calls == 2 * micro_steps * ITERATIONS, (name, stage, pi, rank, calls)


def test_reference_moves() -> None:
    init = gpt2().state_dict()
    assert max_rel_err(reference(gpt2, gpt2_loss), init) > 1e-3


@pytest.mark.multiprocess
def test_stage3_collectives_unchanged(results: list[dict]) -> None:
    plain = [res["lm-plain"][1] for res in results]
    assert plain[0] and all(p == plain[0] for p in plain)
    for res in results:
        assert res[("lm-blocks", 3, 0)][1] == plain[0]


@pytest.mark.multiprocess
def test_bad_policies_fail_on_every_rank(results: list[dict]) -> None:
    for res in results:
        errors = res["errors"]
        assert set(errors) == {"none", "outer", "contains", "bad"}
        assert "matches no module" in errors["none"]
        assert "whole model" in errors["outer"]
        assert "contains the ZeRO-3 block" in errors["contains"]
        assert "activation_checkpointing" in errors["bad"]
