"""Kept checkpoints: a training run's checkpoint directory, holding one step directory per
checkpoint and a pointer to the latest, after DeepSpeed's ``global_stepN`` folders and ``latest``
file::

    D/index.json        the pointer, written last and atomically once a save is complete:
                        {"format": "poplar-latest-checkpoint", "latest": "step-00000006",
                        "iteration": 6, ...} with its own checksum. It is named index.json so that
                        ``D/index.json`` still says which iteration D holds, as it did when D was
                        a single checkpoint; ``load_checkpoint(engine, D)`` and ``read_index(D)``
                        follow it.
    D/step-00000004/    a complete checkpoint (``save_checkpoint``'s layout), kept
    D/step-00000006/    the latest

``save_kept`` saves into ``D/step-<iteration>`` (``save_checkpoint``: a temporary directory
renamed into place), then points index.json at it, then deletes all but the newest ``keep``
complete step directories up to it (later ones belong to a run that was not resumed). Before
saving it removes every leftover of interrupted saves in D (``.step-*.tmp-*``, pointer
``.part`` files; a ``.step-*.old-*`` is renamed back if the step it replaced is missing, else
removed): saves are collective, so no save of this run is in progress then. One run per
checkpoint directory: two runs saving into the same D at once are not supported.

``find_latest`` chooses what to resume from: the pointer's step if it is complete (a step a
save renamed into place but did not point to yet is not used, as DeepSpeed's ``latest``);
otherwise (a save died before the pointer was first written, or the pointed-to step is damaged)
the complete step directory of the highest iteration (or the one a save was replacing when it
died between its renames). A D that is a single checkpoint (index.json directly in it, as
``save_checkpoint(engine, D)`` and earlier Poplar releases write) is used as it is, and the next
``save_kept`` moves it into ``D/step-<iteration>``. Complete means: the index parses, matches its
checksum and lists files that are all there with their sizes (the data files' sha256 are checked
by the load itself, which raises ``DamagedCheckpoint`` on a mismatch; ``fit`` then goes back to
the previous kept one, ``agree_on_latest(..., below=iteration)``, with a warning). D holding
checkpoints of which none is complete is an error, never a silent start from iteration 0.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from poplar.checkpoint.errors import CheckpointError, Invalid
from poplar.checkpoint.layout import (FORMAT, INDEX_FILE, POINTER_FORMAT, POINTER_VERSION, check_files, data_files,
                                      parse_index, read_sealed_json, sealed)
from poplar.checkpoint.background import PendingSave
from poplar.checkpoint.save import check_can_save, save_checkpoint, write_checkpoint
from poplar.checkpoint.snapshot import take_snapshot
from poplar.checkpoint.storage import fsync_dir, publish, temporary_prefix, write_json

_STEP = re.compile(r"step-(\d{8,})")
_TEMPORARY = re.compile(r"\.step-\d{8,}\.tmp-[a-z0-9_]{8}")
_REPLACED = re.compile(r"\.(step-\d{8,})\.old-[0-9a-f]{8}")
_SINGLE_FILES = re.compile(r"model\.safetensors|(optim|rng)-rank\d+-of\d+\.safetensors|__\d+_\d+\.distcp|\.metadata")


class Source(Enum):
    """How the checkpoint to resume from was found."""

    POINTER = "the latest, as index.json says"
    NEWEST_COMPLETE = "the newest complete one: index.json names none that is complete"
    SINGLE = "a single-checkpoint directory"
    PREVIOUS = "the previous kept one: the newer one is damaged"


class NoComplete(Invalid):
    """The directory holds checkpoints, none of them complete."""


class NoCompleteCheckpoint(CheckpointError):
    """Raised on every rank: the checkpoint directory holds checkpoints, none of them complete.
    ``problem`` names the fixes that need no interface (remove it, resume from elsewhere); the
    caller adds how to start over in its own terms (``start_over``: an API argument, a config key)."""

    def __init__(self, problem: str, start_over: str | None = None) -> None:
        self.problem, self.start_over = problem, start_over
        super().__init__(problem if start_over is None else f"{problem}, or start from iteration 0: {start_over}")

    def __reduce__(self) -> tuple:
        return NoCompleteCheckpoint, (self.problem, self.start_over)


def nothing_loads(directory: str | os.PathLike, tried: list[str], start_over: str) -> NoCompleteCheckpoint:
    """The error when every checkpoint kept in ``directory`` failed to load: what each one tried
    (newest first) said, and what to do."""
    lines = "\n".join("  " + problem.replace("\n", "\n  ") for problem in tried)
    return NoCompleteCheckpoint(f"{directory} holds no checkpoint that loads; tried, newest first:\n{lines}\nRemove "
                                "the damaged step directories (or the whole directory), or resume from a checkpoint "
                                "elsewhere", start_over)


@dataclass(frozen=True)
class Latest:
    """The checkpoint to resume from, and why the newer or pointed-to ones were not used."""

    path: Path
    iteration: int
    source: Source
    passed_over: tuple[str, ...] = ()


def step_name(iteration: int) -> str:
    return f"step-{iteration:08d}"


def save_kept(engine: Any, directory: str | os.PathLike, *, keep: int = 2, extra: dict | None = None,
              max_shard_bytes: int | str | None = None) -> Path:
    """Save a checkpoint of ``engine`` into ``directory/step-<iteration>``, point
    ``directory/index.json`` at it, and keep the newest ``keep`` complete checkpoints.

    Call on every rank between iterations. Returns the step directory. Raises ``CheckpointError``
    on every rank if any rank fails (then the previous checkpoints and pointer are as they were,
    or the new step is complete and pointed to), and on every surviving rank if one dies.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (how many checkpoints to keep), got {keep!r}")
    comm = engine.comm
    root = Path(directory)
    step = root / step_name(engine.iteration)
    what = f"save checkpoint {step}"
    error = _on_rank0(comm.rank, prepare, root, step)
    comm.agree(error, what, error_type=CheckpointError)
    save_checkpoint(engine, step, extra=extra, max_shard_bytes=max_shard_bytes)
    error = _on_rank0(comm.rank, commit, root, step, engine.iteration, keep)
    comm.agree(error, what, error_type=CheckpointError)
    return step


def start_save_kept(engine: Any, directory: str | os.PathLike, comm: Any, *, keep: int = 2,
                    extra: dict | None = None) -> PendingSave:
    """``save_kept`` written while training goes on: between iterations every rank copies its
    shards to host memory; a background thread then writes them over ``comm`` (a
    ``background.checkpoint_comm``), points index.json at the new step directory and prunes, as
    ``save_kept`` does. Call on every rank; poll the returned save at each iteration boundary
    (``PendingSave.poll``) and wait for it before the next save or the end."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (how many checkpoints to keep), got {keep!r}")
    root = Path(directory)
    step = root / step_name(engine.iteration)
    what = f"save checkpoint {step}"
    check_can_save(engine, what)
    engine.comm.agree(_on_rank0(engine.comm.rank, prepare, root, step), what, error_type=CheckpointError)
    snap = take_snapshot(engine, what, comm.group if comm.distributed else None, copy=True)
    iteration = engine.iteration

    def write() -> None:
        write_checkpoint(comm, snap, step, extra)
        comm.agree(_on_rank0(comm.rank, commit, root, step, iteration, keep), what, error_type=CheckpointError)
    return PendingSave(write, str(step))


def agree_on_latest(comm: Any, directory: str | os.PathLike, below: int | None = None) -> Latest | None:
    """``find_latest`` on every rank, which must all find the same (collective). ``below``: the
    newest complete step directory before that iteration instead (the one to go back to when the
    latest turned out damaged). Raises ``NoCompleteCheckpoint`` on every rank when the directory
    holds checkpoints of which none is complete."""
    error, found, empty = None, None, False
    try:
        found = _choose(Path(directory), below)
    except NoComplete as e:
        error, empty = str(e), True
    except Invalid as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        error = f"{type(e).__name__}: {e}"
    what = f"find the checkpoint to resume from in {directory}"
    try:
        return comm.agree(error, what, found, error_type=CheckpointError,
                          mismatch=f"ranks see different checkpoints in {directory}; every rank must see the same "
                                   "checkpoint directory (a shared filesystem when ranks span machines)")[0]
    except CheckpointError as e:
        if empty:  # every rank sees the same directory, so every rank takes this branch
            raise NoCompleteCheckpoint(str(e)) from None
        raise


def find_latest(directory: str | os.PathLike) -> Latest | None:
    """The checkpoint in ``directory`` to resume from (see the module doc); None if it holds no
    checkpoint at all. Raises ``CheckpointError`` if it holds checkpoints but none is complete.
    Looks only (one process, no collective)."""
    try:
        return _choose(Path(directory))
    except NoComplete as e:
        raise NoCompleteCheckpoint(str(e)) from None
    except Invalid as e:
        raise CheckpointError(str(e)) from None


def _choose(root: Path, below: int | None = None) -> Latest | None:
    """``find_latest`` raising ``Invalid``, for use before an agreement point; ``below``: only
    step directories before that iteration."""
    problems: list[str] = []
    pointed = None
    if below is not None:
        for path in _step_candidates(root):
            if int(_STEP.search(path.name).group(1)) < below and _is_complete(path):
                return Latest(path, _complete_iteration(path), Source.PREVIOUS)
        return None
    if (root / INDEX_FILE).is_file():
        try:
            head = read_sealed_json(root / INDEX_FILE)
            if head.get("format") == FORMAT:
                return Latest(root, _complete_iteration(root), Source.SINGLE)
            pointed = _pointer_target(root, head)
            return Latest(pointed, _complete_iteration(pointed), Source.POINTER)
        except Invalid as e:
            problems.append(str(e))
    for path in _step_candidates(root):
        if path == pointed:
            continue
        try:
            return Latest(path, _complete_iteration(path), Source.NEWEST_COMPLETE, tuple(problems))
        except Invalid as e:
            problems.append(str(e))
    if problems:
        raise NoComplete(f"{root} holds no complete checkpoint:\n  " + "\n  ".join(problems) + "\nRemove it, or "
                         "resume from a checkpoint elsewhere")
    return None


def read_index(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed index.json of a checkpoint directory (checked for format, version and its
    checksum); of a directory of kept checkpoints, that of its latest complete one."""
    try:
        return parse_index(resolve(Path(directory)))
    except Invalid as e:
        raise CheckpointError(str(e)) from None


def resolve(directory: Path) -> Path:
    """A kept-checkpoints directory's latest complete checkpoint; any other directory as it is."""
    try:
        head = read_sealed_json(directory / INDEX_FILE)
    except Invalid:
        return directory  # not a pointer: the load reports what is wrong with it
    if head.get("format") != POINTER_FORMAT:
        return directory
    found = _choose(directory)
    assert found is not None  # the pointer itself is a candidate
    return found.path


# ---------------------------------------------------------------------------- rank 0's part of a save
def prepare(root: Path, step: Path) -> None:
    """Before a save into ``step``: make ``root``, move a single checkpoint there into its step
    directory, remove the leftovers of interrupted saves and an incomplete ``step``."""
    root.mkdir(parents=True, exist_ok=True)
    _refuse_foreign(root)
    _move_single_into_step(root)
    for path in list(root.iterdir()):
        if _TEMPORARY.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif (m := _REPLACED.fullmatch(path.name)) and path.is_dir() and not path.is_symlink():
            _restore_or_remove(path, root / m.group(1))
    (root / (INDEX_FILE + ".part")).unlink(missing_ok=True)
    if step.exists() and not _is_complete(step):
        shutil.rmtree(step)


def commit(root: Path, step: Path, iteration: int, keep: int) -> None:
    """After a complete save into ``step``: point index.json at it, then prune."""
    write_pointer(root, step, iteration)
    prune(root, iteration, keep)


def write_pointer(root: Path, step: Path, iteration: int) -> None:
    write_json(root / INDEX_FILE, sealed({"format": POINTER_FORMAT, "version": POINTER_VERSION, "latest": step.name,
                                          "iteration": iteration,
                                          "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    fsync_dir(root)


def prune(root: Path, latest: int, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete step directories up to iteration ``latest``
    (later ones, and incomplete ones, included), and a moved single checkpoint's data files.
    Returns what was deleted; a failure to delete is left for the next save."""
    kept = 0
    doomed = []
    for path in _step_candidates(root, include_replaced=False):
        if int(_STEP.fullmatch(path.name).group(1)) <= latest and kept < keep and _is_complete(path):
            kept += 1
        else:
            doomed.append(path)
    doomed += [path for path in root.iterdir() if _SINGLE_FILES.fullmatch(path.name) and path.is_file()]
    deleted = []
    for path in doomed:
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except OSError:
            continue
        deleted.append(path)
    return deleted


# ---------------------------------------------------------------------------- helpers
def _on_rank0(rank: int, fn: Any, *args: Any) -> str | None:
    if rank != 0:
        return None
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        return f"{type(e).__name__}: {e}"
    return None


def _complete_iteration(directory: Path) -> int:
    try:
        index = parse_index(directory)
        check_files(directory, index)
        return int(index["iteration"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Invalid(f"{directory / INDEX_FILE} is malformed ({type(e).__name__}: {e}): the checkpoint is "
                      "corrupt") from None


def _is_complete(directory: Path) -> bool:
    try:
        _complete_iteration(directory)
    except Invalid:
        return False
    return True


def _pointer_target(root: Path, head: dict[str, Any]) -> Path:
    path = root / INDEX_FILE
    if head.get("format") != POINTER_FORMAT:
        raise Invalid(f"{path} is neither a Poplar checkpoint index nor a pointer to one")
    if head.get("version") != POINTER_VERSION:
        raise Invalid(f"{path} has pointer version {head.get('version')}; this Poplar reads {POINTER_VERSION}")
    name = head.get("latest")
    if not isinstance(name, str) or not _STEP.fullmatch(name):
        raise Invalid(f"{path} names no step directory (latest={name!r}): the pointer is corrupt")
    return root / name


def _step_candidates(root: Path, include_replaced: bool = True) -> list[Path]:
    """Step directories (and, after each, one a save was replacing), the highest iteration first."""
    found = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for path in entries:
        if not path.is_dir() or path.is_symlink():
            continue
        if m := _STEP.fullmatch(path.name):
            found.append((int(m.group(1)), 1, path))
        elif include_replaced and (m := _REPLACED.fullmatch(path.name)):
            found.append((int(_STEP.fullmatch(m.group(1)).group(1)), 0, path))
    return [path for *_, path in sorted(found, key=lambda t: (t[0], t[1]), reverse=True)]


def _refuse_foreign(root: Path) -> None:
    """An index.json that is JSON but neither a checkpoint nor a pointer belongs to someone else."""
    try:
        head = read_sealed_json(root / INDEX_FILE)
    except Invalid:
        return  # missing, or a damaged file of ours: the pointer written after the save replaces it
    if head.get("format") not in (FORMAT, POINTER_FORMAT):
        raise FileExistsError(f"{root / INDEX_FILE} is not a Poplar checkpoint index or pointer; refusing to "
                              "replace it (choose another checkpoint directory)")


def _move_single_into_step(root: Path) -> None:
    """A complete single checkpoint in ``root`` becomes ``root/step-<iteration>`` (its files are
    linked, or copied, into a temporary directory renamed into place), then the pointer replaces
    its index.json; ``prune`` deletes its data files after the save."""
    try:
        index = parse_index(root)
        iteration = _complete_iteration(root)
    except Invalid:
        return
    step = root / step_name(iteration)
    if not _is_complete(step):
        tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(step), dir=root))
        for entry in data_files(index):
            _link_or_copy(root / entry["file"], tmp / entry["file"])
        _link_or_copy(root / INDEX_FILE, tmp / INDEX_FILE)  # last: the step is complete once it is there
        publish(tmp, step)
    write_pointer(root, step, iteration)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _restore_or_remove(replaced: Path, step: Path) -> None:
    """What a save replacing ``step`` left when it died between its two renames: put it back
    if the step is missing (as the save would have on a failure it survived), else delete it."""
    if not step.exists() and _is_complete(replaced):
        os.replace(replaced, step)
    else:
        shutil.rmtree(replaced, ignore_errors=True)

