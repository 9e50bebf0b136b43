"""The package's metadata: the license is an SPDX string, with a setuptools that reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
