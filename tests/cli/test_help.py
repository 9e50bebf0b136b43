"""The command line's help is plain text (no RST or Markdown markup)."""

from __future__ import annotations

import pytest

from poplar.cli import build_parser


def test_train_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "poplar train" in text and "--config" in text
    assert "`" not in text  # neither RST ``literals`` nor Markdown `code`
