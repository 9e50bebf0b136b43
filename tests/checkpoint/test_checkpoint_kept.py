"""Kept checkpoints: whatever point of a save a rank dies at (rank 0 or another, before, between
or after the renames that publish it, by exit or SIGTERM), a complete checkpoint is found and
resumed from with the state it had when saved, and the next save leaves no leftovers; the newest
K are kept; the pointer, a damaged pointer or index, and single-checkpoint directories; and the
reports of finished and resumed runs."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset

import poplar
import poplar.checkpoint.kept as kept_module
import poplar.checkpoint.hf_layout as hf_layout_module
import poplar.checkpoint.save as save_module
from poplar.checkpoint import CheckpointError, find_latest, load_checkpoint, read_index, save_checkpoint
from poplar.checkpoint.kept import Source, step_name
from poplar.process.launch import RankFailure, spawn
from poplar.engine import PoplarEngine
from poplar.train import CheckpointOptions, ReportOptions
from poplar.types.plans import Plan
from tests.checkpoint.test_checkpoint_failures import state_by_name
from tests.toy import SEQ, VOCAB, loss_fn, make_model, make_optimizer, plan_of

PLAN = plan_of((3, 2, 1), (2, 2, 1))  # n_i = 7, 5: gbs 12 on 2 ranks
PLAN1 = plan_of((4, 2, 4))  # the same gbs on one rank
EXIT_CODE = 7
COLLECTIVE_TIMEOUT_S = 20.0


class Tokens(Dataset):
    """A deterministic map-style dataset of token sequences."""

    def __len__(self) -> int:
        return 240

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(i))


def make_engine(stage: int, plan: Plan, seed: int = 0) -> PoplarEngine:
    model = make_model(seed)
    return PoplarEngine(model, make_optimizer(model, "adamw"), zero_stage=stage, plan=plan, loss_fn=loss_fn)


def fit(engine: PoplarEngine, iterations: int, directory: Path, every: int, *, keep_checkpoints: int = 2,
        report_dir: Path | None = None, lr_at=None):
    return poplar.fit(engine, Tokens(), iterations, lr_schedule=lr_at,
                      checkpoint=CheckpointOptions(directory, every=every, keep_checkpoints=keep_checkpoints),
                      report=ReportOptions(report_dir, log_every=0, progress=False))


class At(Enum):
    RANK_FILE = "right after writing its own rank file (its RNG, after its shards)"
    SHARDS = "right after the ranks wrote their shards (rank 0: and DCP's metadata)"
    BEFORE_PUBLISH = "just before the step directory is renamed into place"
    AFTER_PUBLISH = "just after the step directory is renamed into place (the pointer still names the previous)"
    AFTER_SAVE = "after save_checkpoint returned, before the pointer is agreed"
    AFTER_POINTER = "just after the pointer is renamed into place, before pruning"
    BETWEEN_RENAMES = "between the two renames that replace an existing step directory"


class How(Enum):
    EXIT = "os._exit"
    SIGTERM = "SIGTERM"


@dataclass(frozen=True)
class Point:
    rank: int
    at: At
    how: How = How.EXIT
    resumes_at: int = 2  # the checkpoint found afterwards: the one before (2) or the one being saved (4)


POINTS = {
    "rank1-mid-save": Point(1, At.RANK_FILE),
    "rank0-mid-save": Point(0, At.RANK_FILE),
    "rank0-before-publish": Point(0, At.BEFORE_PUBLISH),
    "rank0-after-publish": Point(0, At.AFTER_PUBLISH),
    "rank1-after-publish": Point(1, At.AFTER_SAVE, resumes_at=4),
    "rank0-after-pointer": Point(0, At.AFTER_POINTER, resumes_at=4),
    "rank0-between-renames": Point(0, At.BETWEEN_RENAMES, resumes_at=4),
    "rank1-sigterm": Point(1, At.RANK_FILE, How.SIGTERM),
    "rank0-sigterm": Point(0, At.SHARDS, How.SIGTERM),
}
DYING = step_name(4)  # the save that is interrupted
# rank 0 removes its temporary directory on any failure it survives
LEAVE_LEFTOVERS = {At.RANK_FILE, At.SHARDS, At.BEFORE_PUBLISH, At.BETWEEN_RENAMES}


def _die(how: How) -> None:
    if how is How.SIGTERM:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the signal ends the process before this returns
    os._exit(EXIT_CODE)


def _arm(point: Point, rank: int, root: Path) -> None:
    """Make this rank die at ``point`` of the save into step 4 (and nowhere else)."""
    real_save_file, real_replace, real_save = save_module.save_file, os.replace, kept_module.save_checkpoint
    real_write_shards = save_module.write_shards

    def save_file(tensors, filename, metadata=None):
        real_save_file(tensors, filename, metadata=metadata)
        path = Path(filename)
        if point.at is At.RANK_FILE and path.name.startswith(f"rng-rank{rank}-") and \
                path.parent.name.startswith(f".{DYING}.tmp-"):
            _die(point.how)

    def write_shards(comm, snap, tmp_dir, what):
        out = real_write_shards(comm, snap, tmp_dir, what)
        if point.at is At.SHARDS and Path(tmp_dir).name.startswith(f".{DYING}.tmp-"):
            _die(point.how)
        return out

    def replace(src, dst):
        src, dst = Path(src), Path(dst)
        publishing = ".tmp-" in src.name and dst.name == DYING
        pointing = dst == root / "ckpt" / "index.json" and DYING in src.read_text()
        if point.at is At.BEFORE_PUBLISH and publishing:
            _die(point.how)
        real_replace(src, dst)
        if (point.at is At.AFTER_PUBLISH and publishing) or (point.at is At.AFTER_POINTER and pointing) or \
                (point.at is At.BETWEEN_RENAMES and dst.name.startswith(f".{DYING}.old-")):
            _die(point.how)

    def save_checkpoint(engine, directory, **kwargs):
        out = real_save(engine, directory, **kwargs)
        if point.at is At.AFTER_SAVE and Path(directory).name == DYING:
            _die(point.how)
        return out

    if rank == point.rank:
        save_module.save_file, os.replace, kept_module.save_checkpoint = save_file, replace, save_checkpoint
        save_module.write_shards = write_shards


def _record_saves(root: Path) -> None:
    """Every save_kept first writes the state it saves (by name, gathered) to saved-<iteration>."""
    real = kept_module.save_kept

    def save_kept(engine, directory, **kwargs):
        state = state_by_name(engine)
        if engine.rank == 0:
            save_file(state, str(root / f"saved-{engine.iteration}.safetensors"))
        return real(engine, directory, **kwargs)
    kept_module.save_kept = save_kept


def dying_world(rank: int, world: int, root: str, name: str) -> None:
    """Stage 2 on 2 ranks: fit to 4 saving every 2 (keep 2); the save at 4 is interrupted (or,
    for BETWEEN_RENAMES, a second save at 4 that replaces the first)."""
    point, root_dir = POINTS[name], Path(root)
    _record_saves(root_dir)
    engine = make_engine(2, PLAN)
    if point.at is not At.BETWEEN_RENAMES:
        _arm(point, rank, root_dir)
    fit(engine, 4, root_dir / "ckpt", 2)
    _arm(point, rank, root_dir)
    kept_module.save_kept(engine, root_dir / "ckpt", keep=2)


@pytest.fixture
def poplar_log():
    """The messages Poplar logs during the test."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("poplar")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def resume_and_save(directory: Path, iterations: int, **kwargs):
    """A fresh one-rank engine at stage 1 resumes from ``directory`` and saves each iteration."""
    with torch.random.fork_rng(devices=[]):  # loading sets this process's RNG
        return fit(make_engine(1, PLAN1, seed=6), iterations, directory, 1, **kwargs)


@pytest.mark.parametrize("name", list(POINTS))
@pytest.mark.multiprocess
def test_a_save_interrupted_anywhere_resumes_from_a_complete_checkpoint(tmp_path: Path, name: str,
                                                                        poplar_log: list[str]) -> None:
    point = POINTS[name]
    with pytest.raises(RankFailure) as info:
        spawn(dying_world, 2, (str(tmp_path), name), timeout_s=90, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
              grace_s=COLLECTIVE_TIMEOUT_S + 5)
    failures = info.value.failures
    code = -signal.SIGTERM if point.how is How.SIGTERM else EXIT_CODE
    assert f"exit code {code}" in failures[point.rank], failures
    survivor = failures.get(1 - point.rank, "")  # it raised a clear error
    assert "CheckpointError" in survivor and "another rank probably died" in survivor, failures

    directory = tmp_path / "ckpt"
    leftovers = [name for name in os.listdir(directory) if name.startswith(".")]
    assert bool(leftovers) == (point.rank == 0 and point.at in LEAVE_LEFTOVERS), leftovers
    latest = find_latest(directory)
    assert latest is not None and latest.iteration == point.resumes_at, (latest, sorted(os.listdir(directory)))
    engine = make_engine(1, PLAN1, seed=5)
    with torch.random.fork_rng(devices=[]):
        meta = load_checkpoint(engine, directory)  # the directory of kept checkpoints loads its latest
    assert meta["iteration"] == point.resumes_at and meta["path"] == str(latest.path)
    saved = load_file(str(tmp_path / f"saved-{point.resumes_at}.safetensors"))
    state = state_by_name(engine)
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)

    result = resume_and_save(directory, point.resumes_at + 1)
    assert result.start_iteration == point.resumes_at and result.end_iteration == point.resumes_at + 1
    assert any(f"resumed from {directory} at iteration {point.resumes_at}: {latest.path}" in line
               for line in poplar_log), poplar_log
    assert sorted(os.listdir(directory)) == ["index.json", step_name(point.resumes_at),
                                             step_name(point.resumes_at + 1)]  # no leftovers
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
        return f"{type(e).__name__}: {e}"
    return "no error"


def corrupted_world(rank: int, world: int, root: str) -> dict:
    """2 ranks keep checkpoints at 2 and 4; rank 0 changes a value in step 4's index."""
    directory = Path(root) / "ckpt"
    fit(make_engine(2, PLAN), 4, directory, 2)
    if rank == 0:
        index = directory / step_name(4) / "index.json"
        index.write_text(index.read_text().replace('"zero_stage": 2', '"zero_stage": 1'))
    dist.barrier()
    out = {"load": _error_of(lambda: load_checkpoint(make_engine(2, PLAN, seed=3), directory / step_name(4)))}
    out["start"] = fit(make_engine(2, PLAN, seed=3), 5, directory, 1).start_iteration
    return out


@pytest.mark.multiprocess
def test_a_corrupted_index_fails_every_rank_and_resume_falls_back(tmp_path: Path) -> None:
    results = spawn(corrupted_world, 2, (str(tmp_path),), timeout_s=90, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["load"].startswith("CheckpointError") and "failed on 2 of 2 ranks" in r["load"], (rank, r)
        assert "does not match its own checksum" in r["load"], (rank, r)
        assert r["start"] == 2  # the damaged step 4 is passed over on every rank
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["index.json", step_name(4), step_name(5)]
    assert read_index(tmp_path / "ckpt" / step_name(4))["zero_stage"] == 2  # saved again


# ---------------------------------------------------------------------------- one process
def test_the_newest_k_are_kept_and_the_pointer_names_the_latest(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    with torch.random.fork_rng(devices=[]):
        result = fit(make_engine(1, PLAN1), 5, directory, 1)
    assert result.checkpoints == [f"{directory}@{i}" for i in range(1, 6)]
    assert sorted(os.listdir(directory)) == ["index.json", step_name(4), step_name(5)]
    pointer = json.loads((directory / "index.json").read_text())
    assert pointer["format"] == "poplar-latest-checkpoint" and pointer["latest"] == step_name(5)
    assert pointer["iteration"] == 5 and len(pointer["index_sha256"]) == 64
    assert read_index(directory)["iteration"] == 5  # read_index and load_checkpoint follow the pointer

    with torch.random.fork_rng(devices=[]):
        fit(make_engine(1, PLAN1), 8, directory, 1, keep_checkpoints=3)
    assert sorted(os.listdir(directory)) == ["index.json", step_name(6), step_name(7), step_name(8)]
    with pytest.raises(ValueError, match="keep_checkpoints must be an int >= 1"):
        fit(make_engine(1, PLAN1), 9, directory, 1, keep_checkpoints=0)
    with pytest.raises(CheckpointError, match="holds kept checkpoints"):  # would replace them all
        save_checkpoint(make_engine(1, PLAN1), directory)


def _two_kept(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    with torch.random.fork_rng(devices=[]):
        fit(make_engine(1, PLAN1), 4, directory, 2)
    return directory


def test_a_bad_pointer_falls_back_to_the_newest_complete_step(tmp_path: Path, poplar_log: list[str]) -> None:
    directory = _two_kept(tmp_path)
    pointer = directory / "index.json"
    text = pointer.read_text()
    for damage, needle in ((lambda: pointer.write_text(text.replace('"iteration": 4', '"iteration": 5')),
                            "does not match its own checksum"),
                           (lambda: pointer.write_text(text[:40]), "is not valid JSON")):
        damage()
        latest = find_latest(directory)
        assert (latest.iteration, latest.source) == (4, Source.NEWEST_COMPLETE) and needle in latest.passed_over[0]
    pointer.unlink()
    latest = find_latest(directory)
    assert (latest.iteration, latest.source, latest.passed_over) == (4, Source.NEWEST_COMPLETE, ())
    pointer.write_text(text)
    (directory / step_name(4) / ".metadata").unlink()  # the pointed-to step is incomplete
    latest = find_latest(directory)
    assert (latest.iteration, latest.source) == (2, Source.NEWEST_COMPLETE)
    result = resume_and_save(directory, 3)
    assert result.start_iteration == 2
    assert any("not resuming from a damaged or incomplete checkpoint" in line and "is missing" in line
               for line in poplar_log), poplar_log
    assert sorted(os.listdir(directory)) == ["index.json", step_name(2), step_name(3)]


def test_a_complete_step_the_pointer_does_not_name_yet_is_not_used(tmp_path: Path) -> None:
    """A save that died after renaming its step into place but before the pointer: the pointer's
    step is resumed from (DeepSpeed's ``latest`` rule), and the unnamed step is pruned later."""
    directory = _two_kept(tmp_path)
    kept_module.write_pointer(directory, directory / step_name(2), 2)
    latest = find_latest(directory)
    assert (latest.iteration, latest.source) == (2, Source.POINTER)
    assert resume_and_save(directory, 3).start_iteration == 2
    assert sorted(os.listdir(directory)) == ["index.json", step_name(2), step_name(3)]


def test_a_corrupted_index_is_refused_and_counts_as_incomplete(tmp_path: Path) -> None:
    directory = _two_kept(tmp_path)
    index = directory / step_name(4) / "index.json"
    index.write_text(index.read_text().replace('"iteration": 4', '"iteration": 3'))  # still valid JSON
    with pytest.raises(CheckpointError, match="does not match its own checksum"):
        load_checkpoint(make_engine(1, PLAN1), directory / step_name(4))
    with pytest.raises(CheckpointError, match="does not match its own checksum"):
        read_index(directory / step_name(4))
    assert find_latest(directory).iteration == 2
    for step in (2, 4):
        (directory / step_name(step) / "index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):  # never a silent restart from 0
        resume_and_save(directory, 5)


def test_a_single_checkpoint_directory_is_resumed_and_moved_into_a_step(tmp_path: Path, poplar_log) -> None:
    """A directory that is one checkpoint (save_checkpoint, earlier releases; its index without
    a checksum): fit resumes from it, moves it into its step directory and keeps going."""
    directory = tmp_path / "ckpt"
    engine = make_engine(1, PLAN1)
    with torch.random.fork_rng(devices=[]):
        fit(engine, 2, tmp_path / "other", 2)
    save_checkpoint(engine, directory, extra={"data": {"iteration": 2}})
    index = json.loads((directory / "index.json").read_text())
    del index["index_sha256"]
    (directory / "index.json").write_text(json.dumps(index))
    assert find_latest(directory).source is Source.SINGLE
    result = resume_and_save(directory, 4, keep_checkpoints=3)
    assert result.start_iteration == 2
    assert any(f"resumed from {directory} at iteration 2: {directory} (a single-checkpoint" in line
               for line in poplar_log), poplar_log
    assert sorted(os.listdir(directory)) == ["index.json", step_name(2), step_name(3), step_name(4)]
    assert read_index(directory / step_name(2)) == index


def test_the_next_save_removes_every_leftover(tmp_path: Path) -> None:
    directory = _two_kept(tmp_path)
    partial = directory / f".{step_name(6)}.tmp-abcd1234"  # rank 0 died before its rename: young, with an index
    partial.mkdir()
    (partial / "index.json").write_text("{}")
    (partial / "optim-rank0-of2.safetensors").write_bytes(b"partial")
    replaced = directory / f".{step_name(2)}.old-0123abcd"  # the step it replaced exists
    replaced.mkdir()
    (directory / "index.json.part").write_text("{")
    keep = [directory / "notes.txt", directory / ".step-x.tmp-abcd1234"]  # not names a save makes
    keep[0].write_text("mine")
    keep[1].mkdir()
    resume_and_save(directory, 5)
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith((".step-x", "notes"))) == \
        ["index.json", step_name(4), step_name(5)]
    assert all(p.exists() for p in keep)


# ---------------------------------------------------------------------------- reports
def test_a_finished_run_started_again_does_nothing(tmp_path: Path, poplar_log: list[str]) -> None:
    directory, reports = tmp_path / "ckpt", tmp_path / "report"
    with torch.random.fork_rng(devices=[]):
        fit(make_engine(1, PLAN1), 3, directory, 2, report_dir=reports)
    before = {name: (reports / name).read_bytes() for name in ("metrics.json", "trace.json", "plan.json")}
    listing = sorted(os.listdir(directory))
    result = resume_and_save(directory, 3, report_dir=reports)
    assert (result.start_iteration, result.end_iteration, result.losses) == (3, 3, [])
    assert any("nothing to do" in line and "iterations=3 is reached" in line for line in poplar_log), poplar_log
    assert {name: (reports / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(directory)) == listing


class Killed(Exception):
    pass


def crash_at(iteration: int):
    def lr_at(it: int) -> None:
        if it == iteration:
            raise Killed(f"the job is killed before iteration {it}")
    return lr_at


def test_a_resumed_run_reports_every_iteration_from_zero(tmp_path: Path) -> None:
    """Run 1 reaches 3; run 2 goes on to 6 but is killed at iteration 5 (its checkpoint at 4
    wrote the metrics up to it); run 3 resumes from 4 and ends at 7: metrics.json covers 0..6."""
    directory, reports = tmp_path / "ckpt", tmp_path / "report"
    with torch.random.fork_rng(devices=[]):
        first = fit(make_engine(1, PLAN1), 3, directory, 2, report_dir=reports)
        with pytest.raises(Killed):
            fit(make_engine(1, PLAN1, seed=1), 6, directory, 2, report_dir=reports, lr_at=crash_at(5))
        partial = json.loads((reports / "metrics.json").read_text())
        last = fit(make_engine(1, PLAN1, seed=2), 7, directory, 2, report_dir=reports)
    assert [r["iteration"] for r in partial["iterations"]] == [0, 1, 2, 3]
    assert last.start_iteration == 4 and len(last.iterations) == 3
    metrics = json.loads((reports / "metrics.json").read_text())
    assert [r["iteration"] for r in metrics["iterations"]] == list(range(7))
    assert metrics["first_iteration"] == 0 and metrics["end_iteration"] == 7 and len(metrics["losses"]) == 7
    assert metrics["losses"][:3] == first.losses and metrics["losses"][4:] == last.losses
    assert [(r["start_iteration"], r["end_iteration"]) for r in metrics["runs"]] == [(0, 3), (3, 4), (4, 7)]
    assert metrics["iterations"][:3] == first.iterations
