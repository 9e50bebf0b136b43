"""The README's and the guide pages' snippets run as written, so they cannot drift from the code.

Every page (``README.md`` and ``docs/*.md``) marks its fenced blocks with a comment on the line
before the fence:

- ``<!-- readme-test: python NAME -->`` and ``<!-- readme-test: file NAME -->``: the block is
  written to NAME (a script, a config) in the page's run directory;
- ``<!-- readme-test: shell -->``: run with bash, in order, in that directory, with the project's
  Python first on PATH;
- ``<!-- readme-test: excerpt PATH -->``: the block is part of PATH (a file of the repository,
  from its root): every line of the block is a line of that file;
- ``<!-- readme-test: gpu -->``: needs CUDA and NCCL, not run here (each has a marked CPU twin);
- ``<!-- readme-test: manual -->``: shown, not run (installs, synopses with optional arguments).

A python or shell block with no mark fails ``test_no_runnable_block_goes_unmarked``.

Each page's snippets run once, in a directory of its own (``page_runs``), and every test of that
page reads what that one run left (exit statuses, output, reports and checkpoints). To keep the
suite fast the training length is shortened, auto mode profiles with one measurement a batch
size and ``torch.compile`` runs without inductor (``SHORTEN``); ``POPLAR_README_FULL=1`` runs the
snippets exactly as written (the pages give each one's time and the load it was measured at).
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
from typing import Callable

import pytest

from poplar.types.plans import Plan
from poplar.types.profiles import Profile
from poplar.types.route import Collectives

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))
MARK = re.compile(r"<!-- readme-test: (\w+)(?: (\S+))? -->")
FENCE = re.compile(r"^( *)```([\w-]*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
KINDS = ("python", "file", "shell", "excerpt", "gpu", "manual")
NAMED = ("python", "file", "excerpt")
RUNNABLE_LANGUAGES = ("python", "py", "bash", "sh", "shell", "console")
COMMAND = re.compile(r"(poplar (demo|train|profile|plan|simulate)\b(?!:)|torchrun |python3? |pip |OMP_NUM_THREADS=)")
SHORTEN = [("iterations=40", "iterations=3"), ("every=20", "every=2"), ('"iterations": 40', '"iterations": 3'),
           ('"iterations": 300', '"iterations": 3'), ("range(100)", "range(3)"), ("range(20)", "range(3)"),
           ("range(10)", "range(3)"), ("--iterations 30", "--iterations 3"),
           # auto mode's profile: one measurement a batch size (the default takes the least of 3)
           ("AutoOptions(profile_data=data,", "AutoOptions(repeats=1, profile_data=data,"),
           # dynamo and AOTAutograd meet Poplar's hooks; inductor's kernel build takes minutes on a CPU
           (".compile()", '.compile(backend="aot_eager")')]
TORCHRUN = Path(sys.executable).with_name("torchrun")
# pages the guide links that are written apart from it: a link to one is checked once it exists
LINKED_AHEAD = ("docs/checkpoint-format.md",)


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its mark (kind and name; None where unmarked), language, text."""

    kind: str | None
    name: str | None
    language: str
    body: str
    line: int


def blocks(page: str) -> list[Block]:
    text = (REPO / page).read_text()
    found = []
    for fence in FENCE.finditer(text):
        before = text[:fence.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = MARK.fullmatch(before)
        found.append(Block(mark.group(1) if mark else None, mark.group(2) if mark else None, fence.group(2),
                           fence.group(3), text.count("\n", 0, fence.start()) + 1))
    return found


def runnable(block: Block) -> bool:
    """Whether an unmarked block is code a reader would run: tagged python or shell, or untagged
    with a command on its first line (untagged blocks are otherwise logs and listings)."""
    if block.language in RUNNABLE_LANGUAGES:
        return True
    first = next((line.strip() for line in block.body.splitlines() if line.strip()), "")
    return block.language == "" and COMMAND.match(first) is not None


def runs(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.kind in ("python", "file", "shell")]


SHELL_PAGES = [page for page in PAGES if any(b.kind == "shell" for b in blocks(page))]


@pytest.mark.parametrize("page", PAGES)
def test_every_mark_is_known_and_named(page: str) -> None:
    text = (REPO / page).read_text()
    marks = MARK.findall(text)
    assert all(kind in KINDS for kind, _ in marks), marks
    assert all(bool(name) == (kind in NAMED) for kind, name in marks), marks
    # a mark must sit right above a fence, or it marks nothing
    assert len(marks) == sum(b.kind is not None for b in blocks(page)), f"{page}: a mark without its block"


@pytest.mark.parametrize("page", PAGES)
def test_every_fence_closes(page: str) -> None:
    """A stray fence turns the prose after it into a block (and hides the blocks there from the
    tests): every fence line opens or closes a block the tests read."""
    fences = sum(bool(re.match(r" *```", line)) for line in (REPO / page).read_text().splitlines())
    assert fences == 2 * len(blocks(page)), f"{page}: {fences} fence lines, {len(blocks(page))} blocks"


def test_the_readme_runs_a_script_and_commands() -> None:
    kinds = {b.kind for b in blocks("README.md")}
    assert {"python", "shell", "gpu"} <= kinds
    top = (REPO / "README.md").read_text().splitlines()[:8]
    assert any("make demo" in line for line in top) and any("make test" in line for line in top)


@pytest.mark.parametrize("page", PAGES)
def test_no_runnable_block_goes_unmarked(page: str) -> None:
    unmarked = [f"{page}:{b.line}: {b.body.splitlines()[0] if b.body else ''}" for b in blocks(page)
                if b.kind is None and runnable(b)]
    assert not unmarked, "python or shell blocks neither run nor marked gpu / manual / excerpt:\n" + "\n".join(unmarked)


@pytest.mark.parametrize("page", PAGES)
def test_excerpts_are_part_of_their_files(page: str) -> None:
    for block in blocks(page):
        if block.kind != "excerpt":
            continue
        source = REPO / block.name
        assert source.is_file(), f"{page}:{block.line}: excerpt of {block.name}, which does not exist"
        lines = {line.rstrip() for line in source.read_text().splitlines()}
        missing = [line for line in block.body.splitlines() if line.strip() and line.rstrip() not in lines]
        assert not missing, f"{page}:{block.line}: lines not in {block.name}: {missing}"


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_links_between_pages_resolve(page: str) -> None:
    text = FENCE.sub("", (REPO / page).read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / page).parent / path if path else REPO / page
        name = file.resolve().relative_to(REPO).as_posix() if file.resolve().is_relative_to(REPO) else path
        if not file.exists():
            if name not in LINKED_AHEAD:
                broken.append(target)
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page}: links to no file or no heading: {broken}"


@dataclass
class SnippetRun:
    """One shell snippet as it ran: its text (shortened), exit status and output streams."""

    body: str
    returncode: int
    stdout: str
    stderr: str


@dataclass
class PageRun:
    """Where a page's snippets ran, and each shell snippet's run, in order."""

    directory: Path
    shells: list[SnippetRun]


def run_snippets(page: str, directory: Path) -> PageRun:
    """Write the page's files and run its shell snippets, in order, in ``directory``; stop at the
    first that fails (the later ones build on what the earlier ones wrote)."""
    full = os.environ.get("POPLAR_README_FULL") == "1"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           # a store of its own: the run profiles as on a fresh machine and leaves ~/.cache alone
           "POPLAR_PROFILE_STORE": str(directory / "profiles")}
    shells: list[SnippetRun] = []
    for block in runs(page):
        body = block.body
        if not full:
            for old, new in SHORTEN:
                body = body.replace(old, new)
        if block.kind in ("python", "file"):
            (directory / block.name).write_text(body)
            continue
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=directory, env=env, capture_output=True,
                             text=True, timeout=900 if full else 420)
        shells.append(SnippetRun(body, run.returncode, run.stdout, run.stderr))
        if run.returncode != 0:
            break
    return PageRun(directory, shells)


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], PageRun]:
    """Each page's run, made the first time a test asks for it."""
    done: dict[str, PageRun] = {}

    def run_of(page: str) -> PageRun:
        if page not in done:
            done[page] = run_snippets(page, tmp_path_factory.mktemp(Path(page).stem))
        return done[page]
    return run_of


needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")


@needs_torchrun
@pytest.mark.multiprocess
@pytest.mark.parametrize("page", SHELL_PAGES)
def test_page_snippets_run(page_runs: Callable[[str], PageRun], page: str) -> None:
    run = page_runs(page)
    for shell in run.shells:
        assert shell.returncode == 0, f"{page}: snippet failed:\n{shell.body}\n--- stderr ---\n{shell.stderr[-4000:]}"
        assert "Traceback" not in shell.stderr, shell.stderr[-4000:]
    assert len(run.shells) == sum(b.kind == "shell" for b in blocks(page))


# the shortened runs: 3 iterations (40 as written)
ITERATIONS = 40 if os.environ.get("POPLAR_README_FULL") == "1" else 3


@needs_torchrun
@pytest.mark.multiprocess
@pytest.mark.parametrize("page, report, checkpoint", [("docs/engine.md", "runs/quick", "runs/quick/ckpt"),
                                                      ("README.md", "runs/mine", "ckpt"),
                                                      ("README.md", "runs/tiny", "runs/tiny/ckpt")])
def test_the_training_runs_write_their_reports(page_runs: Callable[[str], PageRun], page: str, report: str,
                                               checkpoint: str) -> None:
    """The engine page's script, the README's CPU script and its config's run each write the
    report described (metrics, the plan and the profile it ran, the trace) and end with a
    checkpoint."""
    directory = page_runs(page).directory
    metrics = json.loads((directory / report / "metrics.json").read_text())
    assert metrics["end_iteration"] == ITERATIONS and len(metrics["losses"]) == ITERATIONS, metrics
    assert all(math.isfinite(x) for x in metrics["losses"]), metrics["losses"]
    plan = Plan.load(directory / report / "plan.json")
    profile = Profile.load(directory / report / "profile.json")
    assert plan.strategy == "poplar" and plan.zero_stage == 2 and len(plan.ranks) == profile.world_size == 4
    assert (directory / report / "trace.json").is_file()
    assert json.loads((directory / checkpoint / "index.json").read_text())["iteration"] == ITERATIONS


@needs_torchrun
@pytest.mark.multiprocess
def test_poplar_plan_writes_the_plan_of_the_profile_the_run_measured(page_runs: Callable[[str], PageRun]) -> None:
    directory = page_runs("README.md").directory
    plan = Plan.load(directory / "plan.json")
    assert plan.zero_stage == 2 and sum(r.num_samples for r in plan.ranks) == 256
    assert [r.device_type for r in plan.ranks] == [r.device_type for r in
                                                   Profile.load(directory / "runs/tiny/profile.json").ranks]


@needs_torchrun
@pytest.mark.multiprocess
def test_hpz_runs_on_secondary_shards(page_runs: Callable[[str], PageRun]) -> None:
    """The configuration page's `zero_hpz_partition_size` example trains with secondary shards."""
    plan = Plan.load(page_runs("docs/configuration.md").directory / "runs/hpz/plan.json")
    assert plan.strategy == "even" and plan.collectives is Collectives.SECONDARY_SHARDS


@needs_torchrun
@pytest.mark.multiprocess
def test_the_network_pages_print_what_they_say(page_runs: Callable[[str], PageRun]) -> None:
    """Two nodes: most bytes stay in a node; int8 sends about a quarter of fp32's bytes between
    them (0.254 as the page prints); shard weights 2 : 1 and the offloaded rank's state on the host."""
    printed = page_runs("docs/network.md").shells[0].stdout
    sent = json.loads(re.search(r"bytes by link: (\{.*\})", printed).group(1).replace("'", '"'))
    assert 0 < sent["cross-node"] < sent["intra-node"], printed
    printed = page_runs("docs/lossy.md").shells[0].stdout
    assert 0.24 < float(re.search(r"\(([\d.]+) of exact\)", printed).group(1)) < 0.27, printed
    printed = page_runs("docs/memory.md").shells[0].stdout
    pattern = r"rank (\d): loss [\d.]+ after \d+ steps; parameter shard ([\d,]+) B, optimizer state ([\d,]+) B on " \
              r"the device and ([\d,]+) B"
    held = {int(rank): [int(n.replace(",", "")) for n in numbers] for rank, *numbers in re.findall(pattern, printed)}
    assert held[0][0] == 2 * held[1][0] and held[1][1] == 0 and held[1][2] == held[1][0] and held[0][2] == 0, printed


@needs_torchrun
@pytest.mark.multiprocess
def test_the_export_page_prints_what_it_says(page_runs: Callable[[str], PageRun]) -> None:
    """Two ranks save a sharded checkpoint, ``poplar export`` writes model.safetensors in one
    process, and it equals the model."""
    printed = page_runs("docs/export.md").shells[0].stdout
    assert "wrote out: 4 tensors, 264 bytes in model.safetensors" in printed, printed
    assert printed.rstrip().endswith("out/model.safetensors equals the model"), printed
