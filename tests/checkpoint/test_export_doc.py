"""docs/export.md's marked snippets run as written (as the README's do, ``tests/test_readme.py``):
two ranks save a sharded checkpoint, ``poplar export`` writes model.safetensors in one process,
and it equals the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import MARKED, TORCHRUN

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
@pytest.mark.multiprocess
def test_the_export_docs_snippets_run(tmp_path: Path) -> None:
    snippets = MARKED.findall((REPO / "docs" / "export.md").read_text())
    assert [kind for kind, _, _ in snippets] == ["python", "shell"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    (tmp_path / snippets[0][1]).write_text(snippets[0][2])
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", snippets[1][2]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "wrote out: 4 tensors, 264 bytes in model.safetensors" in run.stdout
    assert run.stdout.rstrip().endswith("out/model.safetensors equals the model")
