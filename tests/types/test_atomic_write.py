"""``write_text_atomic``: a report file gets the mode ``open`` would give it, an existing file
keeps its mode, and a failed write leaves the old file and no temporary behind."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from poplar.types.plans import write_text_atomic


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
