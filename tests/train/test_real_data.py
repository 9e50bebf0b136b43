"""poplar train's real data: text and JSONL files, packed or right-padded with -100 labels, and
the model forms of the config (built-in name, Hugging Face config file, factory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from poplar.train.run_parts import build_parts
from poplar.train.config import ConfigError, TrainConfig
from poplar.workloads.tokenized import TokenizedText


def test_packed_text_and_padded_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world " * 20)
    packed = TokenizedText(tmp_path / "a.txt", seq_len=8)
    assert len(packed) == (240 + 1) // 8 and bool(packed[0]["attention_mask"].all())
    assert torch.equal(packed[0]["labels"], packed[0]["input_ids"])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in ("ab", "abcdefghijk", "xyz")))
    padded = TokenizedText(tmp_path / "b.jsonl", seq_len=6, packing=False, text_key="body")
    assert len(padded) == 3 and padded[0]["attention_mask"].tolist() == [1, 1, 0, 0, 0, 0]
    assert padded[0]["labels"].tolist()[2:] == [-100] * 4 and padded[1]["attention_mask"].sum() == 6
    with pytest.raises(ValueError, match="text"):
        TokenizedText(tmp_path / "b.jsonl", seq_len=6)


def test_model_forms(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 260, "n_positions": 16,
                                                    "n_embd": 16, "n_layer": 1, "n_head": 2}))
    base = {"train_batch_size": 4, "poplar": {"data": {"seq_len": 16}}}
    cfg = TrainConfig.from_dict({**base, "poplar": {**base["poplar"], "model": {"hf_config": str(tmp_path / "gpt2.json")}}})
    parts = build_parts(cfg, torch.device("cpu"))
    batch = torch.utils.data.default_collate([parts.train_data[i] for i in range(2)])
    total, count = parts.loss_fn(parts.model, batch)
    assert count == batch["attention_mask"][:, 1:].sum() and parts.eval_data is not None
    cfg = TrainConfig.from_dict({**base, "poplar": {**base["poplar"], "model": "llama-tiny"}})
    total, count = build_parts(cfg, torch.device("cpu")).loss_fn(build_parts(cfg, torch.device("cpu")).model, batch)
    assert torch.isfinite(total)
    assert TrainConfig.from_dict({"poplar": {"model": "tests.toy:make_model"}}).model_factory == "tests.toy:make_model"
    with pytest.raises(ConfigError, match="exactly one"):
        TrainConfig.from_dict({"poplar": {"model": {"name": "llama-tiny", "hf_config": "x.json"}}})
