"""The README's marked snippets run as written, so they cannot drift from the code.

A fenced block preceded by ``<!-- readme-test: python NAME -->`` is written to NAME; one preceded
by ``<!-- readme-test: file NAME -->`` too (configs); one preceded by ``<!-- readme-test: shell
-->`` is run with bash, in order, in one temporary directory, with the project's Python first
on PATH. To keep the suite fast the training length is shortened (``SHORTEN``); set
``POPLAR_README_FULL=1`` to run the snippets exactly as written (the README gives each one's
measured time on a 2-core machine). Snippets for GPUs are not marked; each has a marked CPU-sized
variant beside it.

The snippets run once, for the whole module (``readme_run``): each test reads what that one run
left (its exit statuses, the reports and checkpoints the README's examples write).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from poplar.types.plans import Plan
from poplar.types.profiles import Profile

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


@dataclass
class SnippetRun:
    """One shell snippet as it ran: its text (shortened), exit status and error stream."""

    body: str
    returncode: int
    stderr: str


@dataclass
class ReadmeRun:
    """Where the snippets ran, and each shell snippet's run, in order."""

    directory: Path
    shells: list[SnippetRun]


def run_snippets(directory: Path) -> ReadmeRun:
    """Write the files and run the shell snippets, in order, in ``directory``; stop at the first
    that fails (the later ones build on what the earlier ones wrote)."""
    full = os.environ.get("POPLAR_README_FULL") == "1"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           # a store of its own: the run profiles as on a fresh machine and leaves ~/.cache alone
           "POPLAR_PROFILE_STORE": str(directory / "profiles")}
    shells: list[SnippetRun] = []
    for kind, name, body in snippets():
        if not full:
            for old, new in SHORTEN:
                body = body.replace(old, new)
        if kind in ("python", "file"):
            (directory / name).write_text(body)
            continue
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=directory, env=env, capture_output=True,
                             text=True, timeout=900 if full else 420)
        shells.append(SnippetRun(body, run.returncode, run.stderr))
        if run.returncode != 0:
            break
    return ReadmeRun(directory, shells)


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory: pytest.TempPathFactory) -> ReadmeRun:
    return run_snippets(tmp_path_factory.mktemp("readme"))


needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")


@needs_torchrun
@pytest.mark.multiprocess
def test_readme_snippets_run(readme_run: ReadmeRun) -> None:
    expected = sum(kind == "shell" for kind, _, _ in snippets())
    for run in readme_run.shells:
        assert run.returncode == 0, f"README snippet failed:\n{run.body}\n--- stderr ---\n{run.stderr[-4000:]}"
        assert "Traceback" not in run.stderr, run.stderr[-4000:]
    assert len(readme_run.shells) == expected


# the shortened runs: 3 iterations (40 as written)
ITERATIONS = 40 if os.environ.get("POPLAR_README_FULL") == "1" else 3


@needs_torchrun
@pytest.mark.multiprocess
@pytest.mark.parametrize("report", ["runs/quick", "runs/mine", "runs/tiny"])
def test_the_readmes_training_runs_write_their_reports(readme_run: ReadmeRun, report: str) -> None:
    """The quick start, the CPU script and the config's run each write the report the README
    describes (metrics, the plan and the profile it ran, the trace) and end with a checkpoint."""
    directory = readme_run.directory / report
    metrics = json.loads((directory / "metrics.json").read_text())
    assert metrics["end_iteration"] == ITERATIONS and len(metrics["losses"]) == ITERATIONS, metrics
    assert all(math.isfinite(x) for x in metrics["losses"]), metrics["losses"]
    plan = Plan.load(directory / "plan.json")
    profile = Profile.load(directory / "profile.json")
    assert plan.strategy == "poplar" and plan.zero_stage == 2 and len(plan.ranks) == profile.world_size == 4
    assert (directory / "trace.json").is_file()
    checkpoints = {"runs/quick": "runs/quick/ckpt", "runs/mine": "ckpt", "runs/tiny": "runs/tiny/ckpt"}[report]
    assert json.loads((readme_run.directory / checkpoints / "index.json").read_text())["iteration"] == ITERATIONS


@needs_torchrun
@pytest.mark.multiprocess
def test_poplar_plan_writes_the_plan_of_the_profile_the_run_measured(readme_run: ReadmeRun) -> None:
    plan = Plan.load(readme_run.directory / "plan.json")
    assert plan.zero_stage == 2 and sum(r.num_samples for r in plan.ranks) == 256
    assert [r.device_type for r in plan.ranks] == [r.device_type for r in
                                                   Profile.load(readme_run.directory / "runs/tiny/profile.json").ranks]
