"""Small finish problems that once slipped through: report files' permissions, RST markup in
``--help``, and the package's license metadata."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from poplar.cli import build_parser
from poplar.types.plans import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_atomic_write_gives_a_new_file_the_mode_open_would(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        path = tmp_path / "sub" / "metrics.json"
        write_text_atomic(path, '{"a": 1}\n')
    finally:
        os.umask(old)
    assert path.read_text() == '{"a": 1}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]  # no temporary file left


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_atomic_write_keeps_an_existing_files_mode(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old\n")
    path.chmod(0o640)
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    write_text_atomic(tmp_path / "fresh.json", "{}\n")
    assert stat.S_IMODE((tmp_path / "fresh.json").stat().st_mode) == 0o666 & ~_umask()


def test_atomic_write_failure_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        write_text_atomic(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def test_train_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "poplar train" in text and "--config" in text
    assert "`" not in text  # neither RST ``literals`` nor Markdown `code`


def test_license_is_an_spdx_string() -> None:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    setuptools = [r.replace(" ", "") for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert len(setuptools) == 1 and ">=" in setuptools[0], meta["build-system"]
    assert int(setuptools[0].split(">=")[1].split(".")[0]) >= 77  # the first to read PEP 639 license strings
