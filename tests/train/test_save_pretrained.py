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


def test_a_byte_level_run_saves_a_tokenizer_auto_tokenizer_loads_with_the_pipelines_ids(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's byte-level GPT-2 run, shortened to one process and 2 iterations: its folder's
    tokenizer (AutoTokenizer) encodes text to the ids the data pipeline trained on and decodes
    them back; a temporary a killed write left is gone, and the folder has the umask's mode."""
    import json
    import os

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from poplar.cli import main
    from poplar.workloads.tokenized import TextTokenizer, TokenizedText

    corpus = (Path(__import__("poplar.workloads").workloads.__file__).parent / "data" / "corpus.txt").read_text()
    text = corpus[:3000] + "\nnon-ASCII: héllo wörld — 中文 🙂, tabs\tand literal </s> <s> <pad>\n"
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    (tmp_path / "gpt2-config.json").write_text(json.dumps(
        {"model_type": "gpt2", "vocab_size": 260, "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2,
         "bos_token_id": 257, "eos_token_id": 258}))
    (tmp_path / "run.json").write_text(json.dumps(
        {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
         "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
         "poplar": {"iterations": 2, "model": {"hf_config": "gpt2-config.json"},
                    "data": {"path": "corpus.txt", "seq_len": 32, "eval_fraction": 0}, "report_dir": "runs"}}))
    killed = tmp_path / "runs" / ".model.tmp-k1ll3d00"
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half a file")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    old = os.umask(0o027)
    try:
        assert main(["train", "--config", "run.json"]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "runs" / "model"
    assert (out / "model.safetensors").is_file() and not killed.exists()
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []
    assert (out.stat().st_mode & 0o777) == 0o750  # 0o777 less the umask, not mkdtemp's 0o700

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    pipeline = TextTokenizer(None)
    assert len(tokenizer) == pipeline.vocab_size == 260
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id) == \
        (256, 257, 258, 259)
    ids = tokenizer(text)["input_ids"]
    assert ids == pipeline.encode(text) and tokenizer.decode(ids) == text
    # the ids of a training sample (packed: the document, then EOS) read back as its text
    sample = TokenizedText("corpus.txt", seq_len=32, tokenizer=pipeline)[0]["input_ids"].tolist()
    assert sample == ids[:32] and tokenizer.decode(sample) == text.encode()[:32].decode("utf-8", errors="replace")


def test_no_tokenizer_is_saved_for_ids_tokenized_elsewhere(tmp_path: Path) -> None:
    """A ``datasets`` directory's ``input_ids`` came from a tokenizer the run never saw: the byte
    tokenizer would be wrong for them, so none is saved (and the folder's line says so); its text
    column is tokenized byte-level, and the byte tokenizer is saved."""
    import json

    pytest.importorskip("transformers")
    from poplar.train.config import TrainConfig
    from poplar.train.hf_output import run_tokenizer

    def config(features: dict) -> TrainConfig:
        (tmp_path / "set").mkdir(exist_ok=True)
        (tmp_path / "set" / "dataset_info.json").write_text(json.dumps({"features": features}))
        (tmp_path / "set" / "state.json").write_text("{}")
        return TrainConfig.from_dict({"poplar": {"model": {"hf_config": "c.json"},
                                                 "data": {"path": str(tmp_path / "set")}}})

    assert run_tokenizer(config({"input_ids": {"_type": "Sequence"}, "text": {"_type": "Value"}})) is None
    assert run_tokenizer(config({"text": {"_type": "Value"}})).name_or_path == "byte-level"
