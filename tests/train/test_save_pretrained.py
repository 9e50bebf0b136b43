"""``Trainer.save_pretrained(dir, tokenizer)``: the Python door to the Hugging Face folder that
``poplar train`` writes at the end of a run. After training at ZeRO-3 on two ranks, the folder
holds the trained weights (gathered from the shards) and the tokenizer, and loads with
``from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.train import FitConfig, ReplanOptions, ReportOptions, Trainer
from poplar.workloads.hf import causal_lm_loss_fn
from tests.cli.test_finetune_cli import DOCS, save_tiny_gpt2
from tests.toy import global_batch, loss_fn, make_model, plan_of

PLAN = plan_of((2, 1, 0), (2, 1, 0))


def train_and_save(rank: int, world: int, pretrained: str, out: str) -> dict[str, torch.Tensor]:
    import transformers

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained)
    ids = [torch.tensor(tokenizer(d)["input_ids"][:16]) for d in DOCS]
    data = [{"input_ids": t, "labels": t} for t in ids]
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), zero_stage=3,
                          plan=PLAN, loss_fn=causal_lm_loss_fn)
    with Trainer(engine, data, FitConfig(report=ReportOptions(progress=False), replan=ReplanOptions(enabled=False))) as trainer:
        trainer.fit(2)
        trainer.save_pretrained(out, tokenizer)
    return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}


@pytest.mark.multiprocess
def test_save_pretrained_writes_a_folder_from_pretrained_and_auto_tokenizer_load(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    save_tiny_gpt2(tmp_path / "pretrained")
    assert min(len(transformers.AutoTokenizer.from_pretrained(tmp_path / "pretrained")(d)["input_ids"])
               for d in DOCS) >= 16
    trained = spawn(train_and_save, 2, (str(tmp_path / "pretrained"), str(tmp_path / "out")), timeout_s=180)[0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    before = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained").state_dict()
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)  # the trained weights, not the shards
    assert not torch.equal(loaded["transformer.h.0.mlp.c_fc.weight"], before["transformer.h.0.mlp.c_fc.weight"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    own = transformers.AutoTokenizer.from_pretrained(tmp_path / "pretrained")
    assert tokenizer(DOCS[5])["input_ids"] == own(DOCS[5])["input_ids"]


def test_save_pretrained_needs_a_transformers_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = make_model(2)
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), zero_stage=1,
                          plan=plan_of((4, 1, 0)), loss_fn=loss_fn)
    with Trainer(engine, list(global_batch(0, 4)), FitConfig(report=ReportOptions(progress=False), replan=ReplanOptions(enabled=False))) as trainer:
        with pytest.raises(TypeError, match=r"needs a transformers model.*save a checkpoint instead"):
            trainer.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
