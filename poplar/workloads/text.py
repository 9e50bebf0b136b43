"""Text datasets over a local file: a byte-level tokenizer, next-token blocks for a decoder and
masked blocks for an encoder. The default text is the small English corpus shipped with
Poplar (``poplar/workloads/data/corpus.txt``, written for the project), so demos and tests need no download.

Tokens: the 256 byte values (UTF-8 bytes of the text) and four specials, ``VOCAB_SIZE`` = 260.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["PAD", "BOS", "EOS", "MASK", "VOCAB_SIZE", "ByteTokenizer", "default_corpus_path", "load_text",
           "TextBlocks", "MaskedTextBlocks"]

PAD, BOS, EOS, MASK = 256, 257, 258, 259
VOCAB_SIZE = 260
IGNORE_INDEX = -100  # label of a position that carries no loss (torch's cross_entropy default)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus PAD/BOS/EOS/MASK = 256..259."""

    vocab_size = VOCAB_SIZE
    pad_id, bos_id, eos_id, mask_id = PAD, BOS, EOS, MASK

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> torch.Tensor:
        raw = bytearray(text.encode("utf-8"))
        ids = torch.frombuffer(raw, dtype=torch.uint8).long() if raw else torch.zeros(0, dtype=torch.long)
        parts = ([torch.tensor([BOS])] if bos else []) + [ids] + ([torch.tensor([EOS])] if eos else [])
        return torch.cat(parts) if len(parts) > 1 else ids

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Bytes back to text; specials are dropped, broken UTF-8 becomes U+FFFD."""
        values = ids.tolist() if torch.is_tensor(ids) else list(ids)
        return bytes(v for v in values if 0 <= v < 256).decode("utf-8", errors="replace")


def default_corpus_path() -> Path:
    """The corpus shipped with the package."""
    return Path(str(resources.files("poplar.workloads") / "data" / "corpus.txt"))


def load_text(path: str | os.PathLike | None = None) -> str:
    """The text of ``path`` (UTF-8), or of the shipped corpus when ``path`` is None."""
    path = default_corpus_path() if path is None else Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"text file {path} not found; pass an existing UTF-8 file "
                                "(or None for the corpus shipped with Poplar)") from None


def _split_range(n: int, split: str | None, val_fraction: float) -> range:
    if split is None:
        return range(n)
    if split not in ("train", "val"):
        raise ValueError(f"split must be None, 'train' or 'val', got {split!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ValueError(f"{n} blocks are too few to split off a validation set; use a longer text or a "
                         "shorter seq_len")
    return range(n - n_val) if split == "train" else range(n - n_val, n)


def token_count(n: int) -> str:
    """``n`` tokens, in words: "0 tokens", "1 token", "5 tokens"."""
    return f"{n} token{'' if n == 1 else 's'}"


class TextBlocks(Dataset):
    """Next-token-prediction samples: fixed blocks of ``seq_len + 1`` byte tokens.

    Block i is tokens[i·seq_len : i·seq_len + seq_len + 1] (consecutive blocks share one token,
    so every token after the first is a target exactly once). A batch collates to a
    (B, seq_len + 1) int64 tensor: inputs ``[:, :-1]``, targets ``[:, 1:]``.

    ``split="train"``/``"val"`` keeps the first / the last ``val_fraction`` of the blocks.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, seq_len: int = 64, split: str | None = None,
                 val_fraction: float = 0.1, text: str | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        self.tokens = ByteTokenizer().encode(load_text(path) if text is None else text)
        n = (len(self.tokens) - 1) // seq_len
        if n < 1:
            raise ValueError(f"the text has {token_count(len(self.tokens))}, fewer than one block of {seq_len + 1}")
        self.blocks = _split_range(n, split, val_fraction)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = self.blocks[i] * self.seq_len
        return self.tokens[start:start + self.seq_len + 1].clone()


class MaskedTextBlocks(Dataset):
    """Masked-language-model samples: blocks of ``seq_len`` byte tokens, BERT-style masking.

    Each position is chosen with probability ``mask_prob`` (at least one per sample, so a
    per-sample mean loss is always defined); a chosen position becomes MASK (80 %), a random
    byte (10 %) or stays (10 %), and its label is the original token; other labels are -100.
    The masking of sample i is fixed by (``seed``, i): the same on every rank, worker and epoch.
    Items are dicts ``{"input_ids": (seq_len,), "labels": (seq_len,)}``.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, seq_len: int = 64, mask_prob: float = 0.15,
                 seed: int = 0, split: str | None = None, val_fraction: float = 0.1, text: str | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 < mask_prob <= 1.0:
            raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob}")
        self.seq_len, self.mask_prob, self.seed = seq_len, mask_prob, seed
        self.tokens = ByteTokenizer().encode(load_text(path) if text is None else text)
        n = len(self.tokens) // seq_len
        if n < 1:
            raise ValueError(f"the text has {token_count(len(self.tokens))}, fewer than one block of {seq_len}")
        self.blocks = _split_range(n, split, val_fraction)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        b = self.blocks[i]
        ids = self.tokens[b * self.seq_len:(b + 1) * self.seq_len].clone()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + b)
        chosen = torch.rand(self.seq_len, generator=g) < self.mask_prob
        forced = torch.randint(self.seq_len, (1,), generator=g)  # drawn always: a fixed stream
        if not chosen.any():
            chosen[forced] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
        action = torch.rand(self.seq_len, generator=g)
        random_bytes = torch.randint(256, (self.seq_len,), generator=g)
        inputs = torch.where(chosen & (action < 0.8), torch.full_like(ids, MASK), ids)
        inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_bytes, inputs)
        return {"input_ids": inputs, "labels": labels}
