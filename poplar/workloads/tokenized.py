"""Language-model datasets from a text or JSONL file and a tokenizer, as Hugging Face batches.

Documents: a ``.txt`` file is one document (the whole text); a ``.jsonl`` file is one document
per line, the string under ``text_key`` (default ``"text"``); a directory written by Hugging Face
``datasets`` (``Dataset.save_to_disk``, read with ``load_from_disk``; optional extra ``poplar[hf]``)
is one document per row: its ``input_ids`` column if it has one (already tokenized: taken as
is), else the string under ``text_key``. Tokenizers: the built-in byte
tokenizer (``poplar.workloads.text.ByteTokenizer``: UTF-8 bytes, 260 ids with PAD/BOS/EOS/MASK),
or a Hugging Face ``tokenizer.json`` loaded through the ``tokenizers`` package (optional extra
``poplar[hf]``; imported only then).

Two layouts, each sample a dict ``{"input_ids", "attention_mask", "labels"}`` of ``seq_len``
int64 tokens (labels are the inputs: the causal-LM loss shifts them, as Hugging Face does):

- ``packed``: every document's tokens followed by EOS, concatenated, cut into consecutive blocks
  of ``seq_len`` (the tail shorter than a block is dropped). No padding: every position counts.
- ``padded``: one sample per document, truncated to ``seq_len`` and right-padded; padding has
  ``attention_mask`` 0 and label -100, so a ``(loss_sum, count)`` loss weighs every real token
  once whatever the sample's length (``poplar.workloads.hf``).

``split`` keeps the first (``"train"``) or the last (``"val"``) ``val_fraction`` of the samples,
a held-out set for evaluation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from poplar.workloads.text import ByteTokenizer, default_corpus_path, token_count

IGNORE_INDEX = -100


class TextTokenizer:
    """``encode(text) -> list[int]``, ``vocab_size``, ``eos_id`` and ``pad_id`` of either tokenizer."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = None if path in (None, "bytes") else str(path)
        if self.path is None:
            self._bytes: ByteTokenizer | None = ByteTokenizer()
            self.vocab_size, self.eos_id, self.pad_id = ByteTokenizer.vocab_size, ByteTokenizer.eos_id, \
                ByteTokenizer.pad_id
            return
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(f"the tokenizer {self.path} needs the tokenizers package: pip install 'poplar[hf]' "
                              "(or use the built-in byte tokenizer)") from None
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"tokenizer file {self.path} not found; give a Hugging Face tokenizer.json")
        self._bytes = None
        self._hf = Tokenizer.from_file(self.path)
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        eos = next((self._hf.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
                    if self._hf.token_to_id(t) is not None), None)
        pad = next((self._hf.token_to_id(t) for t in ("<pad>", "[PAD]") if self._hf.token_to_id(t) is not None), None)
        self.eos_id = eos if eos is not None else 0
        self.pad_id = pad if pad is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        if self._bytes is not None:
            return self._bytes.encode(text).tolist()
        return self._hf.encode(text, add_special_tokens=False).ids


def is_arrow_dataset(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a directory ``datasets.Dataset.save_to_disk`` wrote."""
    return path is not None and (Path(path) / "dataset_info.json").is_file() and (Path(path) / "state.json").is_file()


def load_token_documents(path: str | os.PathLike | None, tokenizer: TextTokenizer,
                         text_key: str = "text") -> list[list[int]]:
    """Every document of ``path`` as token ids (see the module doc)."""
    if not is_arrow_dataset(path):
        return [tokenizer.encode(d) for d in load_documents(path, text_key)]
    try:
        from datasets import load_from_disk
    except ImportError:
        raise ImportError(f"{path} is a Hugging Face datasets directory; reading it needs the datasets package: "
                          "pip install 'poplar[hf]'") from None
    table = load_from_disk(str(path))
    if not hasattr(table, "column_names") or isinstance(table.column_names, dict):
        raise ValueError(f"{path} holds a DatasetDict (splits {list(table.column_names)}); save one split "
                         "(dataset['train'].save_to_disk(...)) and give its directory")
    if "input_ids" in table.column_names:
        return [[int(t) for t in ids] for ids in table["input_ids"]]
    if text_key not in table.column_names:
        raise ValueError(f"{path} has no 'input_ids' column and no {text_key!r} text column (columns: "
                         f"{table.column_names}); tokenize it into 'input_ids' or set data.text_key")
    return [tokenizer.encode(str(t)) for t in table[text_key]]


def load_documents(path: str | os.PathLike | None, text_key: str = "text") -> list[str]:
    """The documents of a ``.txt`` (one) or ``.jsonl`` (one per line) file; None: the shipped corpus."""
    p = default_corpus_path() if path is None else Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {p} not found; give a UTF-8 .txt or .jsonl file (null: the corpus "
                                "shipped with Poplar)")
    if p.suffix != ".jsonl":
        return [p.read_text(encoding="utf-8")]
    docs = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            docs.append(record[text_key])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{p}:{n}: each line must be a JSON object with a string under {text_key!r} "
                             f"({type(e).__name__}: {e})") from None
        if not isinstance(docs[-1], str):
            raise ValueError(f"{p}:{n}: {text_key!r} must be a string, got {type(docs[-1]).__name__}")
    if not docs:
        raise ValueError(f"{p} holds no documents")
    return docs


def _split(n: int, split: str | None, val_fraction: float) -> range:
    if split is None:
        return range(n)
    if split not in ("train", "val"):
        raise ValueError(f"split must be None, 'train' or 'val', got {split!r}")
    n_val = max(1, round(n * val_fraction))
    if not 0 < val_fraction < 1 or n_val >= n:
        raise ValueError(f"{n} samples cannot be split with val_fraction={val_fraction}: give more data, a shorter "
                         "seq_len, or a separate eval file")
    return range(n - n_val) if split == "train" else range(n - n_val, n)


class TokenizedText(Dataset):
    """Causal-LM samples of a file (see the module doc for ``packed`` and ``padded``)."""

    def __init__(self, path: str | os.PathLike | None = None, *, seq_len: int = 64,
                 tokenizer: TextTokenizer | None = None, packing: bool = True, text_key: str = "text",
                 split: str | None = None, val_fraction: float = 0.1) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
        self.seq_len, self.packing = seq_len, packing
        self.tokenizer = tokenizer or TextTokenizer()
        docs = load_token_documents(path, self.tokenizer, text_key)
        eos, pad = self.tokenizer.eos_id, self.tokenizer.pad_id
        tokens = sum(len(d) for d in docs)  # the text's own, without the end-of-text tokens packing adds
        if tokens == 0:
            raise ValueError(f"the data ({path if path is not None else 'the shipped corpus'}) holds no text: "
                             f"{len(docs)} document{'s' if len(docs) != 1 else ''}, 0 tokens; give a file with text")
        if packing:
            stream = torch.tensor([t for d in docs for t in (*d, eos)], dtype=torch.long)
            n = len(stream) // seq_len
            if n < 1:
                raise ValueError(f"the data has {token_count(tokens)} ({len(stream)} with an "
                                 f"end-of-text token after each document), fewer than one block of {seq_len}; give "
                                 "more text or a shorter seq_len")
            self.ids = stream[:n * seq_len].view(n, seq_len)
            self.mask = torch.ones_like(self.ids)
        else:
            docs = [d[:seq_len] for d in docs if d]
            self.ids = torch.full((len(docs), seq_len), pad, dtype=torch.long)
            self.mask = torch.zeros_like(self.ids)
            for i, d in enumerate(docs):
                self.ids[i, :len(d)] = torch.tensor(d, dtype=torch.long)
                self.mask[i, :len(d)] = 1
        self.rows = _split(len(self.ids), split, val_fraction)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        r = self.rows[i]
        ids, mask = self.ids[r].clone(), self.mask[r].clone()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def describe(data: Any) -> str:
    """One line about a dataset of this module, for the log."""
    if not isinstance(data, TokenizedText):
        return f"{len(data)} samples"
    tok = data.tokenizer.path or "byte-level"
    layout = "packed" if data.packing else "padded"
    return f"{len(data)} samples of {data.seq_len} tokens ({layout}, tokenizer {tok}, vocab {data.tokenizer.vocab_size})"
