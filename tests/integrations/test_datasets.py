"""Hugging Face ``datasets`` as data: a ``save_to_disk`` directory in ``poplar train`` (a tokenized
``input_ids`` column packed as is, or a text column tokenized), and a ``datasets.Dataset`` in
``poplar.fit`` trains exactly as the same samples in a plain dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

datasets = pytest.importorskip("datasets")

import poplar  # noqa: E402
from poplar.engine import PoplarEngine  # noqa: E402
from poplar.train import ReportOptions  # noqa: E402
from poplar.train.data import LoaderOptions  # noqa: E402
from poplar.train.options import FitConfig  # noqa: E402
from poplar.workloads.text import ByteTokenizer  # noqa: E402
from poplar.workloads.tokenized import TextTokenizer, TokenizedText  # noqa: E402
from tests import toy  # noqa: E402

TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).resolve().parents[2]


def test_a_tokenized_column_is_packed_as_is_and_a_text_column_is_tokenized(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    datasets.Dataset.from_dict({"input_ids": docs, "other": ["a", "b", "c"]}).save_to_disk(str(tmp_path / "tok"))
    packed = TokenizedText(tmp_path / "tok", seq_len=4)
    eos = ByteTokenizer.eos_id
    assert packed.ids.tolist() == [[1, 2, 3, eos], [4, 5, eos, 6], [7, 8, 9, eos]]
    padded = TokenizedText(tmp_path / "tok", seq_len=3, packing=False)
    assert padded[1]["labels"].tolist() == [4, 5, -100] and padded[1]["attention_mask"].tolist() == [1, 1, 0]

    texts = ["hello there", "a second document", "third"]
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "text"))
    (tmp_path / "same.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts))
    from_arrow = TokenizedText(tmp_path / "text", seq_len=6, text_key="body")
    assert torch.equal(from_arrow.ids, TokenizedText(tmp_path / "same.jsonl", seq_len=6, text_key="body").ids)
    with pytest.raises(ValueError, match="no 'input_ids' column and no 'text'"):
        TokenizedText(tmp_path / "text", seq_len=6, tokenizer=TextTokenizer())


def _fit(data: object) -> dict[str, torch.Tensor]:
    model = toy.make_model()
    engine = PoplarEngine(model, toy.make_optimizer(model, "sgd"), plan=toy.plan_of((2, 2, 1)),
                          loss_fn=lambda m, b: toy.loss_fn(m, b["tokens"]))
    config = FitConfig(loader=LoaderOptions(seed=3), report=ReportOptions(log_every=0, progress=False))
    poplar.fit(engine, data, 3, config=config)
    engine.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fit_trains_on_a_datasets_dataset_as_on_the_same_samples() -> None:
    tokens = torch.randint(0, toy.VOCAB, (23, toy.SEQ + 1), generator=torch.Generator().manual_seed(5))
    arrow = datasets.Dataset.from_dict({"tokens": tokens.tolist()}).with_format("torch")
    plain = [{"tokens": t} for t in tokens]
    trained = _fit(arrow)
    assert toy.max_rel_err(trained, _fit(plain)) == 0.0
    assert toy.max_rel_err(trained, toy.make_model().state_dict()) > 1e-3


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_poplar_train_reads_a_datasets_directory(tmp_path: Path) -> None:
    rng = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 250, (int(n),), generator=rng).tolist() for n in torch.randint(5, 40, (60,), generator=rng)]
    datasets.Dataset.from_dict({"input_ids": docs}).save_to_disk(str(tmp_path / "arrow"))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
              "poplar": {"iterations": 4, "model": {"name": "llama-tiny", "n_layers": 1},
                         "data": {"path": "arrow", "seq_len": 16, "eval_fraction": 0.1}, "eval_every": 4,
                         "report_dir": "report", "collective_timeout_s": 60}}
    (tmp_path / "run.json").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "poplar", "train",
                          "--config", "run.json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    blocks = (sum(len(d) + 1 for d in docs) // 16)
    assert f"{blocks - round(blocks * 0.1)} samples of 16 tokens (packed" in run.stderr, run.stderr[-3000:]
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["end_iteration"] == 4
