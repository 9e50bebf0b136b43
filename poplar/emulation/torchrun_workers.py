"""Find a torchrun worker's process, for tests and benches that kill one rank of a job.

torchrun starts each worker as a child of its launcher, with ``RANK`` in its environment, so on
Linux a worker is the process under ``/proc`` whose parent is the launcher and whose environment
holds ``RANK=rank``.
"""

from __future__ import annotations

from pathlib import Path


def worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of launcher ``launcher``'s worker of ``rank``, or None (not started, or no /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None
