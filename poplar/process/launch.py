"""Run a function on N local processes joined by a process group: the emulated cluster of the
demo and the harness of the multi-process tests.

``spawn(fn, world_size, args)`` calls ``fn(rank, world_size, *args)`` in each process and
returns the per-rank results. It never hangs: the whole run has a deadline, the process group
a collective timeout, and a rank that raises or dies fails the call with that rank's traceback
(or exit code) after the others are stopped.

[Note: ranks start from a fork server]
A process started with multiprocessing's "spawn" is a new interpreter that imports torch again:
about a second of CPU per rank, several seconds for four ranks on a small machine, paid by every
call. Ranks are started from multiprocessing's fork server instead, which imported torch,
torch.distributed and poplar once (``PRELOAD``) and forks a rank in a fraction of a second. A
forked rank is clean like a spawned one: the server forks from its own state, not the caller's,
and multiprocessing hands it the caller's ``sys.path`` and working directory. The one thing a
fork server's child would take from the server rather than the caller is the environment, so
``spawn`` passes the caller's environment and the rank installs it first. Where a platform has
no fork server (Windows) ranks are spawned.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out; the message holds each one's story."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)  # plain bytes: no shared-memory handles that die with the sender
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# what the fork server imports once for every rank; torch imports ``torch._dynamo`` at a rank's
# first optimizer (about 1 s of CPU), so it is imported once here rather than in every rank
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "poplar"]


def _context() -> Any:
    """The multiprocessing context ranks start in (see [Note: ranks start from a fork server])."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when this process first starts its server
    return ctx


# [Note: a failed rendezvous starts again]
# On a loaded machine gloo's full mesh of loopback connections now and then fails to form
# ("connectFullMesh failed ... Connection closed by peer"): a peer's ephemeral port, or its
# connection, is lost under the load of other groups forming beside it. Where some rank failed to
# join and no rank reported that it joined, no rank has started ``fn``, so the group is started
# once more, with new processes and a new store, inside the same deadline: like torchrun's
# restarts, but only where nothing of ``fn`` ran. A second failure is reported with both stories.
RENDEZVOUS = "rendezvous"  # a rank's report: it failed to join the group
JOINED = "joined"  # a rank's report: it joined the group and starts fn
RENDEZVOUS_ATTEMPTS = 2


def _worker(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, port: int, backend: str,
            collective_timeout_s: float, threads: int, results: Any, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's environment, not the fork server's
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        timeout = timedelta(seconds=collective_timeout_s)
        try:
            store = dist.TCPStore("127.0.0.1", port, None, False, timeout)  # a client of the caller's store
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        except Exception:  # noqa: BLE001 - fn has not run: the caller may start the group again
            results.put((RENDEZVOUS, rank, traceback.format_exc()))
            return
        results.put((JOINED, rank, b""))
        out = fn(rank, world_size, *args)
        results.put(("ok", rank, _dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - peers may already be gone
            pass


# How long ranks that all reported get to leave on their own before they are terminated. A rank
# leaving runs its exit handlers (the process group's teardown, the release of the named
# semaphores it created, e.g. a progress bar's lock); a rank terminated in the middle of them
# leaves those to the resource tracker, which warns of them at the caller's exit.
EXIT_GRACE_S = 5.0


def _stop(procs: list[Any], wait_s: float) -> None:
    """Wait up to ``wait_s`` for the ranks to exit, then terminate the rest, then kill what is left."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class _Attempt(NamedTuple):
    """One start of the group: each rank's result or its failure."""

    outputs: dict[int, Any]
    failures: dict[int, str]
    rendezvous_failed: bool  # some rank failed to join the group and none started fn


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 120.0,
          backend: str = "gloo", collective_timeout_s: float = 60.0, threads_per_rank: int = 1,
          grace_s: float = 10.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    ``fn`` must be importable by name (a module-level function). Raises ``RankFailure`` if any
    rank raises or dies (waiting up to ``grace_s`` for the other ranks' reports), or if the run
    passes ``timeout_s``. A group that failed to form is started once more (Note: a failed
    rendezvous starts again).
    """
    deadline = time.monotonic() + timeout_s
    stories: list[str] = []
    for attempt in range(RENDEZVOUS_ATTEMPTS):
        run = _start(fn, world_size, args, deadline, backend, collective_timeout_s, threads_per_rank, grace_s)
        if not run.failures:
            return [run.outputs[r] for r in range(world_size)]
        detail = "\n".join(f"--- rank {r}:\n{msg}" for r, msg in sorted(run.failures.items()))
        stories.append(detail)
        if not run.rendezvous_failed or attempt + 1 == RENDEZVOUS_ATTEMPTS or time.monotonic() > deadline:
            break
    again = (f" (the process group failed to form {len(stories)} times; the first time:\n{stories[0]}\nthen)"
             if len(stories) > 1 else "")
    raise RankFailure(f"{len(run.failures)} of {world_size} ranks failed{again}:\n{stories[-1]}", run.failures)


def _start(fn: Callable[..., Any], world_size: int, args: tuple, deadline: float, backend: str,
           collective_timeout_s: float, threads_per_rank: int, grace_s: float) -> _Attempt:
    """Start the group once and collect each rank's report until ``deadline``."""
    ctx = _context()
    results = ctx.Queue()
    # The rendezvous store lives in this process, on a port the system picked when it bound it: a
    # port chosen free and bound later by rank 0 can be taken in between by another job.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=collective_timeout_s), wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, args, port, backend, collective_timeout_s, threads_per_rank, results,
                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    unjoined: set[int] = set()  # ranks that failed to join the group
    joined = False  # some rank joined it and started fn
    first_failure: float | None = None
    try:
        while len(outputs) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline or (first_failure is not None and now > first_failure + grace_s):
                for r in range(world_size):
                    if r not in outputs and r not in failures:
                        failures[r] = "timed out" if first_failure is None else "stopped after another rank failed"
                break
            try:
                status, rank, payload = results.get(timeout=0.1)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in outputs and r not in failures and p.exitcode is not None:
                        try:  # it may have reported just before exiting
                            status, rank, payload = results.get(timeout=1.0)
                        except queue.Empty:
                            failures[r] = f"died with exit code {p.exitcode} without reporting"
                            first_failure = first_failure or time.monotonic()
                        else:
                            break
                else:
                    continue
            if status == JOINED:
                joined = True
            elif status == "ok":
                outputs[rank] = _loads(payload)
            else:
                failures[rank] = payload
                if status == RENDEZVOUS:
                    unjoined.add(rank)
                first_failure = first_failure or time.monotonic()
    finally:
        _stop(procs, EXIT_GRACE_S if len(outputs) == world_size else 0.0)
    rendezvous = bool(unjoined) and not joined
    return _Attempt(outputs, failures, rendezvous)
