"""What the data sets say about data too small to train on: the text's own token count (not the
end-of-text tokens packing adds), an empty file called empty, and counts in plain words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poplar.workloads.text import TextBlocks, token_count
from poplar.workloads.tokenized import TokenizedText


@pytest.mark.parametrize("packing", [True, False])
def test_an_empty_text_file_is_called_empty_not_one_token(tmp_path: Path, packing: bool) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ValueError) as caught:
        TokenizedText(path, seq_len=16, packing=packing)
    text = str(caught.value)
    assert "holds no text" in text and "0 tokens" in text and str(path) in text and "1 token" not in text, text


def test_a_jsonl_file_of_empty_documents_is_called_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n".join(json.dumps({"text": ""}) for _ in range(3)) + "\n")
    with pytest.raises(ValueError, match=r"holds no text: 3 documents, 0 tokens"):
        TokenizedText(path, seq_len=16)


def test_too_little_text_counts_its_own_tokens(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("abc")  # 3 byte tokens; packing adds one end-of-text token
    with pytest.raises(ValueError, match=r"the data has 3 tokens \(4 with an end-of-text token .*fewer than one block "
                                         r"of 16"):
        TokenizedText(path, seq_len=16)
    with pytest.raises(ValueError, match=r"the text has 1 token, fewer than one block of 9"):
        TextBlocks(text="a", seq_len=8)
    assert [token_count(n) for n in (0, 1, 2)] == ["0 tokens", "1 token", "2 tokens"]
