"""One job per checkpoint directory: ``D/poplar.lock``, a JSON record of the job that owns D.

Two jobs saving into one directory remove each other's temporary directories and prune each
other's steps, so the histories mix. The first job takes the lock before it deletes anything;
a second one is refused at once, with a message naming the owner. The record::

    {"format": "poplar-checkpoint-lock", "host": "node3", "pid": 4242, "pid_start": 1234567,
     "started": "2026-11-26T01:02:03+0000", "job": "torchrun run id or null", "attempt": 0,
     "token": "9f0c..."}

``pid_start`` is the owner's start time in the kernel's clock ticks (``/proc/PID/stat``), so a
pid reused by another process is not mistaken for the owner. A lock is stale, and is taken over
with a note, when its owner ran on this machine and is gone, or when it belongs to an earlier
attempt of this same torchrun job (``TORCHELASTIC_RUN_ID``; a restart after a failure). An owner
on another machine cannot be checked from here: the message says which file to remove once that
job is known to be gone.

The lock is created atomically (a complete temporary file hard-linked to the name, which fails
if it exists), so no reader ever sees a half-written record. A process holds each directory's
lock once; holding it again (``fit`` called twice, the command line's early lock and the
trainer's) nests, and the file goes when the last holder releases it. Release removes the file
only while it still holds this process's token.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

LOCK_FILE = "poplar.lock"
LOCK_FORMAT = "poplar-checkpoint-lock"


class LockState(Enum):
    """What was found at ``D/poplar.lock`` when taking it."""

    FREE = "free"
    OURS = "held by this process already"
    STALE = "stale"
    HELD = "held by another job"


@dataclass(frozen=True)
class Owner:
    """Who holds a checkpoint directory (the lock file's record)."""

    host: str
    pid: int
    pid_start: int | None
    started: str
    job: str | None
    attempt: int
    token: str

    @classmethod
    def me(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), _process_start(os.getpid()),
                   time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.environ.get("TORCHELASTIC_RUN_ID"),
                   int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), uuid.uuid4().hex)

    def to_json(self) -> dict[str, Any]:
        return {"format": LOCK_FORMAT, "host": self.host, "pid": self.pid, "pid_start": self.pid_start,
                "started": self.started, "job": self.job, "attempt": self.attempt, "token": self.token}

    @classmethod
    def from_json(cls, obj: Any) -> "Owner":
        if not isinstance(obj, dict) or obj.get("format") != LOCK_FORMAT:
            raise ValueError("not a Poplar checkpoint lock")
        return cls(str(obj["host"]), int(obj["pid"]), obj.get("pid_start"), str(obj.get("started", "?")),
                   obj.get("job"), int(obj.get("attempt", 0)), str(obj.get("token", "")))

    def describe(self) -> str:
        job = f", torchrun job {self.job} attempt {self.attempt}" if self.job else ""
        return f"pid {self.pid} on {self.host}, started {self.started}{job}"


class DirectoryLocked(RuntimeError):
    """Another live job owns the checkpoint directory."""


@dataclass
class _Held:
    owner: Owner
    count: int


_held: dict[Path, _Held] = {}  # this process's locks: directory -> its record and how many hold it


def acquire(directory: str | os.PathLike) -> str | None:
    """Take ``directory``'s lock for this process (making the directory). Returns a note when a
    stale lock was taken over, else None. Raises ``DirectoryLocked`` naming the owner when
    another live job holds it."""
    root = Path(directory).resolve()
    if root in _held:
        _held[root].count += 1
        return None
    root.mkdir(parents=True, exist_ok=True)
    me = Owner.me()
    path = root / LOCK_FILE
    tmp = root / f".{LOCK_FILE}.{me.token[:8]}"
    tmp.write_text(json.dumps(me.to_json(), indent=1) + "\n")
    note = None
    try:
        for _ in range(3):  # a lock removed or replaced between our looks: look again
            try:
                os.link(tmp, path)
                break
            except FileExistsError:
                pass
            state, owner, why = inspect(path, me)
            if state is LockState.FREE:
                continue
            if state is LockState.HELD:
                raise DirectoryLocked(
                    f"checkpoint directory {root} is in use by another job ({owner.describe()}); two jobs saving "
                    f"into one directory delete each other's checkpoints. Give this run another checkpoint "
                    f"directory, or wait for that job to end" + (
                        "" if owner.host == me.host else
                        f" (it runs on another machine; if it is gone, remove {path})"))
            os.replace(tmp, path)  # stale or ours: take it over
            note = f"took over the lock of {root} from {owner.describe() if owner else 'an unreadable record'} ({why})"
            break
        else:
            raise DirectoryLocked(f"could not take the lock {path}: it keeps changing (another job is starting "
                                  "there); give this run another checkpoint directory")
    finally:
        tmp.unlink(missing_ok=True)
    _held[root] = _Held(me, 1)
    return note


def release(directory: str | os.PathLike) -> None:
    """Let go of ``directory``'s lock; the file is removed when the last holder in this process
    releases it, and only if it is still this process's."""
    root = Path(directory).resolve()
    held = _held.get(root)
    if held is None:
        return
    held.count -= 1
    if held.count > 0:
        return
    del _held[root]
    path = root / LOCK_FILE
    try:
        if Owner.from_json(json.loads(path.read_text())).token == held.owner.token:
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        pass  # gone, or taken over: not ours to remove


def read_owner(directory: str | os.PathLike) -> Owner | None:
    """The record of ``directory``'s lock (None: no lock, or an unreadable one)."""
    try:
        return Owner.from_json(json.loads((Path(directory) / LOCK_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def inspect(path: Path, me: Owner) -> tuple[LockState, Owner | None, str]:
    """The state of the lock at ``path`` as seen by ``me``, its owner, and why it is stale."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return LockState.FREE, None, ""
    try:
        owner = Owner.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError):
        if time.time() - path.stat().st_mtime > 10:  # not a record being written: a damaged one
            return LockState.STALE, None, "its record is unreadable"
        return LockState.HELD, Owner("?", -1, None, "?", None, 0, ""), ""
    if owner.host == me.host and owner.pid == me.pid:
        return LockState.OURS, owner, "this process"
    if owner.job is not None and owner.job == me.job and owner.attempt < me.attempt:
        return LockState.STALE, owner, f"an earlier attempt of this job ({owner.attempt}; this is {me.attempt})"
    if owner.host == me.host and not _alive(owner.pid, owner.pid_start):
        return LockState.STALE, owner, "its process has ended"
    return LockState.HELD, owner, ""


def _alive(pid: int, start: int | None) -> bool:
    """Whether ``pid`` runs here and is the process that started at ``start`` (when known)."""
    now = _process_start(pid)
    if now is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return start is None  # /proc says nothing here: trust the pid alone
    return start is None or now == start


def _process_start(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot (None without /proc, or if it is gone or
    a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])
