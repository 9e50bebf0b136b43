"""The README's marked snippets run as written, so they cannot drift from the code.

A fenced block preceded by ``<!-- readme-test: python NAME -->`` is written to NAME; one preceded
by ``<!-- readme-test: file NAME -->`` too (configs); one preceded by ``<!-- readme-test: shell
-->`` is run with bash, in order, in one temporary directory, with the project's Python first
on PATH. To keep the suite fast the training length is shortened (``SHORTEN``); set
``POPLAR_README_FULL=1`` to run the snippets exactly as written (the README gives each one's
measured time on a 2-core machine). Snippets for GPUs are not marked; each has a marked CPU-sized
variant beside it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"<!-- readme-test: (\w+)(?: (\S+))? -->\n```[\w-]*\n(.*?)```", re.S)
SHORTEN = [("iterations=40", "iterations=3"), ("every=20", "every=2"), ('"iterations": 40', '"iterations": 3'),
           ('"iterations": 300', '"iterations": 3'), ("range(100)", "range(3)"),
           ("--iterations 30", "--iterations 3")]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def snippets() -> list[tuple[str, str | None, str]]:
    return MARKED.findall((REPO / "README.md").read_text())


def test_the_readme_marks_its_runnable_snippets() -> None:
    kinds = [kind for kind, _, _ in snippets()]
    assert "python" in kinds and "shell" in kinds
    assert all(kind in ("python", "file", "shell") for kind in kinds)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_readme_snippets_run(tmp_path: Path) -> None:
    full = os.environ.get("POPLAR_README_FULL") == "1"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           # a store of its own: the run profiles as on a fresh machine and leaves ~/.cache alone
           "POPLAR_PROFILE_STORE": str(tmp_path / "profiles")}
    for kind, name, body in snippets():
        if not full:
            for old, new in SHORTEN:
                body = body.replace(old, new)
        if kind in ("python", "file"):
            (tmp_path / name).write_text(body)
            continue
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=900 if full else 420)
        assert run.returncode == 0, f"README snippet failed:\n{body}\n--- stderr ---\n{run.stderr[-4000:]}"
        assert "Traceback" not in run.stderr, run.stderr[-4000:]
