"""Durable, atomic writing of checkpoint files: fsync, sha256, file modes, moving a finished
temporary directory into place over an older checkpoint, and removing the temporary and
set-aside directories that interrupted saves left behind."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from poplar.checkpoint.layout import INDEX_FILE, POINTER_FORMAT, is_dcp_file, is_model_file


def check_replaceable(directory: Path) -> None:
    """Refuse a target that exists and is neither empty nor a Poplar checkpoint, or that holds
    kept checkpoints (replacing it would delete them all)."""
    if directory.exists():
        if not directory.is_dir():
            raise FileExistsError(f"{directory} exists and is not a directory")
        if any(directory.iterdir()) and not (directory / INDEX_FILE).exists():
            raise FileExistsError(f"{directory} exists, is not empty and is not a Poplar checkpoint; "
                                  "refusing to replace it (choose another directory)")
        if _is_pointer(directory / INDEX_FILE) or any(p.is_dir() for p in directory.iterdir()):
            raise FileExistsError(f"{directory} holds kept checkpoints (step-* directories and index.json "
                                  "pointing at the latest) or other directories, and saving there would replace "
                                  "them all; save into a new directory, or keep saving there with "
                                  "poplar.checkpoint.save_kept or fit()")


def publish(tmp: Path, directory: Path) -> None:
    """Move the finished temporary directory to ``directory``, replacing an older checkpoint."""
    umask_mode(tmp, 0o777)
    fsync_dir(tmp)
    if directory.exists():
        old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(directory, old)
        try:
            os.replace(tmp, directory)
        except BaseException:
            os.replace(old, directory)  # put the previous checkpoint back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    fsync_dir(directory.parent)


def remove_replaced(directory: Path) -> list[Path]:
    """Remove the older checkpoints ``publish`` set aside as ``.NAME.old-*`` and could not remove
    (its process died between its renames). Call once ``directory`` holds the newer checkpoint;
    like ``remove_stale_temporaries``, it never makes a save fail."""
    pattern = re.compile(re.escape(f".{directory.name}.old-") + r"[0-9a-f]{8}")
    try:
        siblings = list(directory.parent.iterdir())
    except OSError:
        return []
    removed = []
    for path in siblings:
        if pattern.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _is_pointer(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("format") == POINTER_FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` atomically (a ``.part`` file, fsync, rename)."""
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_facts(path: Path) -> dict[str, Any]:
    """Flush a written file to disk, give it the usual mode, and return its size and sha256."""
    umask_mode(path, 0o666)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def umask_mode(path: Path, mode: int) -> None:
    """Temporary files and directories are private (0600/0700); give the result the usual mode."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """The file's sha256, read through one reused buffer of ``chunk_bytes`` (a checkpoint file
    is a rank's whole shard; the check holds no more of it than that)."""
    h = hashlib.sha256()
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


# An interrupted save can leave its temporary directory behind (rank 0 removes its own on any
# failure it survives, so this happens when rank 0 dies). A save in progress writes its files one
# after another, each step bounded by the collective timeout (torch's defaults: 10 or 30 minutes),
# so one in which nothing changed for an hour is abandoned. Were it not, removing it would make
# that save fail clearly at its next write or at the move into place, never leave a partial
# checkpoint.
STALE_TEMPORARY_S = 3600.0
_TEMPORARY_SUFFIX = re.compile(r"[a-z0-9_]{8}")  # tempfile.mkdtemp's random part
_INDEX_PART = INDEX_FILE + ".part"
_RANK_FILE = re.compile(r"(optim|rng)-rank\d+-of\d+\.safetensors")


def temporary_prefix(directory: Path) -> str:
    """The name prefix of the temporary directories of saves to ``directory``."""
    return f".{directory.name}.tmp-"


def remove_stale_temporaries(directory: Path, stale_after_s: float = STALE_TEMPORARY_S) -> list[Path]:
    """Remove what interrupted saves to ``directory`` left next to it; return what was removed.

    Removed is only a directory named exactly like a save's temporary for this target that holds
    nothing but the files a save writes before its index (rank files, the model, ``index.json.part``;
    no index.json, which may be the only copy of a finished checkpoint, no subdirectory, no link,
    no other file), none of which changed in the last ``stale_after_s`` seconds. Anything else is
    left alone, and a failure to remove is ignored: leftovers never make a save fail.
    """
    prefix = temporary_prefix(directory)
    removed = []
    try:
        siblings = list(directory.parent.iterdir())
    except OSError:
        return removed
    for path in siblings:
        name = path.name
        if not (name.startswith(prefix) and _TEMPORARY_SUFFIX.fullmatch(name[len(prefix):])):
            continue
        try:
            if path.is_symlink() or not path.is_dir() or not _is_stale_partial_save(path, stale_after_s):
                continue
            shutil.rmtree(path)
            removed.append(path)
        except OSError:
            continue  # another process removed or changed it meanwhile; it is not ours to insist on
    return removed


def _is_stale_partial_save(path: Path, stale_after_s: float) -> bool:
    newest = path.lstat().st_mtime
    for entry in path.iterdir():
        if (entry.name != _INDEX_PART and not is_model_file(entry.name) and not _RANK_FILE.fullmatch(entry.name)
                and not is_dcp_file(entry.name)):
            return False
        if entry.is_symlink() or not entry.is_file():
            return False
        newest = max(newest, entry.lstat().st_mtime)
    return time.time() - newest > stale_after_s
