"""Fine-tuning from the command line: ``"model": {"hf_pretrained": dir}`` loads a model saved
with ``save_pretrained`` (and the tokenizer saved beside it), and the first step trains those
weights: its loss is the saved model's loss on the same batch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from poplar.train.run_parts import build_parts
from poplar.train.config import ConfigError, TrainConfig
from tests.cli.test_train_cli import TORCHRUN, _torchrun

DOCS = [f"document {i}: the quick brown fox jumps over the lazy dog, {i * 7} times over." for i in range(8)]


def save_tiny_gpt2(directory: Path) -> None:
    """A tiny GPT-2 (no dropout, so a training step's loss is the model's loss) and a byte-level
    BPE tokenizer trained on the documents, both written with save_pretrained."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(DOCS, vocab_size=300, special_tokens=["<|endoftext|>"])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    eos = tokenizer.eos_token_id
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=eos, eos_token_id=eos,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(123)  # not the run's seed: a freshly initialised model would give another loss
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _config(tmp: Path) -> dict:
    (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return {"train_batch_size": len(DOCS), "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
            "zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "poplar": {"iterations": 2, "model": {"hf_pretrained": "pretrained"}, "report_dir": "report",
                       "data": {"path": "docs.jsonl", "seq_len": 24, "packing": False, "eval_fraction": 0},
                       "collective_timeout_s": 60}}


def reference_loss(tmp: Path, cfg: dict) -> float:
    """The saved model's token-weighted loss on the whole data set (the run's first global batch)."""
    parts = build_parts(TrainConfig.from_dict(cfg), torch.device("cpu"))
    assert len(parts.train_data) == len(DOCS) and parts.eval_data is None
    batch = torch.utils.data.default_collate([parts.train_data[i] for i in range(len(DOCS))])
    with torch.no_grad():
        total, count = parts.loss_fn(parts.model, batch)
    return float(total / count)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_a_pretrained_gpt2_fine_tunes_from_poplar_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_tiny_gpt2(tmp_path / "pretrained")
    cfg = _config(tmp_path)
    cfg["poplar"]["checkpoint"] = {"dir": "ckpt"}
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)  # the config's paths are relative to the run's directory
    expected = reference_loss(tmp_path, cfg)
    run = _torchrun(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = json.loads((tmp_path / "report" / "metrics.json").read_text())["losses"]
    assert len(losses) == 2 and losses[0] == pytest.approx(expected, rel=1e-5), (losses, expected)
    assert losses[1] < losses[0] and math.isfinite(losses[1])
    assert "tokenizer pretrained/tokenizer.json" in run.stderr, run.stderr[-3000:]
    _check_model_folder(tmp_path)


def _checkpoint_model(step: Path) -> dict[str, torch.Tensor]:
    """The model a sharded checkpoint holds, put together offline by torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    whole = step.parent / f"{step.name}.pt"
    dcp_to_torch_save(step, whole)
    return torch.load(whole, weights_only=True)["model"]


def _check_model_folder(tmp: Path) -> None:
    """The finished run's folder (report/model by default) loads with from_pretrained and no step
    path: the engine's final weights (as its last checkpoint holds them) and the run's tokenizer."""
    transformers = pytest.importorskip("transformers")
    out = tmp / "report" / "model"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    final = _checkpoint_model(tmp / "ckpt" / "step-00000002")
    before = transformers.AutoModelForCausalLM.from_pretrained(tmp / "pretrained").state_dict()
    state = model.state_dict()
    assert type(model).__name__ == "GPT2LMHeadModel" and set(final) <= set(state)
    for key, value in final.items():
        assert torch.equal(state[key], value), key
    assert not torch.equal(state["transformer.h.0.mlp.c_fc.weight"], before["transformer.h.0.mlp.c_fc.weight"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    saved = transformers.AutoTokenizer.from_pretrained(tmp / "pretrained")
    assert tokenizer(DOCS[3])["input_ids"] == saved(DOCS[3])["input_ids"]
    assert tokenizer.eos_token == "<|endoftext|>"


def test_hf_pretrained_needs_a_directory_with_a_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path)
    with pytest.raises(ConfigError, match="is not a directory"):
        build_parts(TrainConfig.from_dict(cfg), torch.device("cpu"))
    (tmp_path / "pretrained").mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        build_parts(TrainConfig.from_dict(cfg), torch.device("cpu"))
    with pytest.raises(ConfigError, match="exactly one"):
        TrainConfig.from_dict({"poplar": {"model": {"hf_pretrained": "a", "hf_config": "b"}}})


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_an_hf_config_run_with_a_tokenizer_json_writes_its_output_dir(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf_config`` with ``poplar.data.tokenizer`` and ``poplar.output_dir`` (no report dir): the
    folder holds the final weights (ZeRO-3, gathered) and the run's tokenizer.json as a fast tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    save_tiny_gpt2(tmp_path / "pretrained")
    config = json.loads((tmp_path / "pretrained" / "config.json").read_text())
    (tmp_path / "gpt2-config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    cfg = _config(tmp_path)
    cfg["zero_optimization"] = {"stage": 3}
    del cfg["poplar"]["report_dir"]
    cfg["poplar"].update({"model": {"hf_config": "gpt2-config.json"}, "checkpoint": {"dir": "ckpt"},
                          "output_dir": "out"})
    cfg["poplar"]["data"]["tokenizer"] = "pretrained/tokenizer.json"
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)
    run = _torchrun(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    state = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    final = _checkpoint_model(tmp_path / "ckpt" / "step-00000002")
    assert final and all(torch.equal(state[k], v) for k, v in final.items())
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    own = tokenizers.Tokenizer.from_file(str(tmp_path / "pretrained" / "tokenizer.json"))
    assert tokenizer(DOCS[5], add_special_tokens=False)["input_ids"] == own.encode(DOCS[5], add_special_tokens=False).ids


def test_the_output_folder_is_for_hugging_face_models_and_defaults_to_the_report_dir() -> None:
    from poplar.train.hf_output import output_dir

    base = {"poplar": {"model": {"hf_config": "c.json"}, "report_dir": "runs/x"}}
    assert output_dir(TrainConfig.from_dict(base)) == Path("runs/x/model")
    base["poplar"]["output_dir"] = "final"
    assert output_dir(TrainConfig.from_dict(base)) == Path("final")
    assert output_dir(TrainConfig.from_dict({"poplar": {"model": "llama-tiny", "report_dir": "r"}})) is None
    assert output_dir(TrainConfig.from_dict({"poplar": {"model": {"hf_config": "c.json"}}})) is None
    with pytest.raises(ConfigError, match="output_dir"):
        TrainConfig.from_dict({"poplar": {"model": "llama-tiny", "output_dir": 3}})
