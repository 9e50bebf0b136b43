"""The reference models: shapes, causality, deterministic init, sizes, losses that learn."""

from __future__ import annotations

import pytest
import torch

from poplar.train.data import LoaderOptions, PlanLoader
from poplar.workloads.models import (BERT_SIZES, LLAMA_SIZES, MODEL_NAMES, BertBlock, BertConfig, BertModel, LlamaBlock,
                           LlamaConfig, LlamaModel, bert_loss_fn, count_params, create_model, llama_loss_fn,
                           loss_fn_for)
from poplar.types.plans import Plan, RankPlan
from poplar.workloads.text import IGNORE_INDEX, MaskedTextBlocks, TextBlocks


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_llama_shapes_and_blocks() -> None:
    model = create_model("llama-tiny")
    tokens = torch.randint(0, 260, (3, 17))
    assert model(tokens).shape == (3, 17, 260)
    assert sum(isinstance(m, LlamaBlock) for m in model.modules()) == 3 and model.block_class is LlamaBlock
    assert "rope_cos" not in model.state_dict()  # derived buffers are not state
    assert model.head.weight is model.embed.weight  # tied by default
    assert set(model.state_dict()) >= {"embed.weight", "head.weight"}


def test_llama_is_causal() -> None:
    model = create_model("llama-tiny")
    a = torch.randint(0, 260, (1, 12))
    b = a.clone()
    b[0, 7:] = (b[0, 7:] + 1) % 260
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.allclose(la[:, :7], lb[:, :7], atol=1e-6) and not torch.allclose(la[:, 7:], lb[:, 7:])


def test_bert_shapes_bidirectional_and_padding() -> None:
    model = create_model("bert-tiny")
    ids = torch.randint(0, 260, (2, 10))
    assert model(ids).shape == (2, 10, 260)
    assert sum(isinstance(m, BertBlock) for m in model.modules()) == 3 and model.block_class is BertBlock
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 260
    with torch.no_grad():
        assert not torch.allclose(model(ids)[:, 0], model(changed)[:, 0])  # sees the future
        mask = torch.ones(2, 10, dtype=torch.long)
        mask[:, -1] = 0  # the last token is padding: nothing else may depend on it
        assert torch.allclose(model(ids, mask)[:, :-1], model(changed, mask)[:, :-1], atol=1e-6)


def test_deterministic_init_and_global_rng_untouched() -> None:
    for name in ("llama-tiny", "bert-tiny"):
        torch.manual_seed(123)
        before = torch.get_rng_state()
        a, b, c = create_model(name, seed=4), create_model(name, seed=4), create_model(name, seed=5)
        assert torch.equal(torch.get_rng_state(), before)
        sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert not torch.equal(sa["embed.weight"], sc["embed.weight"])
        assert abs(float(sa["embed.weight"].std()) - 0.02) < 0.002


def test_sizes_and_param_counts() -> None:
    for name in MODEL_NAMES:
        family, _, size = name.partition("-")
        config = (LLAMA_SIZES if family == "llama" else BERT_SIZES)[size]
        if count_params(config) < 5_000_000:
            assert n_params(create_model(name)) == count_params(config), name
    assert 80_000 < count_params(LLAMA_SIZES["tiny"]) < 120_000
    assert 1_000_000 < count_params(LLAMA_SIZES["small"]) < 5_000_000
    assert 1_000_000 < count_params(BERT_SIZES["small"]) < 5_000_000
    assert 0.45e9 < count_params(LLAMA_SIZES["0.5b"]) < 0.6e9
    assert 1.0e9 < count_params(LLAMA_SIZES["1.1b"]) < 1.2e9
    assert 1.0e9 < count_params(BERT_SIZES["1.1b"]) < 1.2e9
    assert 105e6 < count_params(BERT_SIZES["base"]) < 115e6


def test_config_options() -> None:
    untied = LlamaModel(LlamaConfig.named("tiny", tie_embeddings=False))
    assert untied.head.weight is not untied.embed.weight
    assert n_params(untied) == count_params(untied.config) == count_params(LLAMA_SIZES["tiny"]) + 260 * 48
    gqa = LlamaModel(LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, n_layers=1, hidden_dim=64))
    assert gqa(torch.randint(0, 260, (2, 5))).shape == (2, 5, 260) and n_params(gqa) == count_params(gqa.config)
    bert = BertModel(BertConfig.named("tiny", tie_embeddings=False))
    assert n_params(bert) == count_params(bert.config)
    with pytest.raises(ValueError, match="n_heads"):
        LlamaConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="unknown llama size"):
        LlamaConfig.named("huge")
    with pytest.raises(ValueError, match="unknown model"):
        create_model("gpt-tiny")
    with pytest.raises(ValueError, match="max_seq_len"):
        create_model("llama-tiny", max_seq_len=8)(torch.zeros(1, 9, dtype=torch.long))
    assert loss_fn_for(create_model("bert-tiny")) is bert_loss_fn and loss_fn_for(untied) is llama_loss_fn


def test_bert_loss_is_a_per_sample_mean() -> None:
    """Samples with different numbers of masked tokens weigh the same: the batch loss is the mean
    of the one-sample losses, which the engine's scaling by samples needs."""
    model = create_model("bert-tiny")
    ds = MaskedTextBlocks(seq_len=32)
    items = [ds[i] for i in range(4)]
    counts = {int((it["labels"] != IGNORE_INDEX).sum()) for it in items}
    assert len(counts) > 1
    batch = torch.utils.data.default_collate(items)
    single = [bert_loss_fn(model, torch.utils.data.default_collate([it])) for it in items]
    assert torch.allclose(bert_loss_fn(model, batch), torch.stack(single).mean(), atol=1e-6)


def _train(model: torch.nn.Module, dataset, loss_fn, steps: int, lr: float) -> list[float]:
    plan = Plan([RankPlan(8, 1, 0)])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _, batch in zip(range(steps), PlanLoader(dataset, plan, 0, LoaderOptions(seed=0))):
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_llama_learns_the_corpus() -> None:
    torch.manual_seed(0)
    losses = _train(create_model("llama-tiny"), TextBlocks(seq_len=32), llama_loss_fn, steps=12, lr=3e-3)
    assert abs(losses[0] - torch.log(torch.tensor(260.0)).item()) < 0.1  # starts near uniform
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


def test_bert_learns_the_corpus() -> None:
    torch.manual_seed(0)
    losses = _train(create_model("bert-tiny"), MaskedTextBlocks(seq_len=32), bert_loss_fn, steps=12, lr=3e-3)
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
