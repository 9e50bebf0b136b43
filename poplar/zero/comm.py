"""Instrumented collectives: every collective the engine issues goes through ``Communicator``.

Each call is recorded in a ``CommLedger`` with its op, bytes, phase (forward / backward / step),
micro-step, iteration and seconds. Seconds are what the calling rank spent blocked in the
collective, which includes waiting for slower ranks: the profiler subtracts exactly this from
compute time, and benchmarks read communication volume from it.

Reductions always use ``ReduceOp.SUM``; the engine scales losses itself (averaging by world
size is wrong for uneven batches).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


# torch 2.13 renamed the tensor collectives; older releases only have the old names
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistributedError(RuntimeError):
    """Raised on every rank when any rank reported a problem at an agreement point."""


@dataclass
class CommRecord:
    op: str
    bytes: int
    phase: str
    iteration: int
    micro_step: int
    seconds: float
    tag: str = ""
    start: float = 0.0  # wall clock (time.time()) when the rank entered the collective


class CommLedger:
    """The record of every collective. ``phase``/``micro_step``/``iteration`` are set by the engine.

    Only the latest ``max_records`` records are kept, so a long run does not grow without bound;
    ``total_seconds`` counts every collective ever recorded.
    """

    def __init__(self, max_records: int = 200_000) -> None:
        self.records: deque[CommRecord] = deque(maxlen=max_records)
        self.total_seconds = 0.0
        self.phase = "setup"
        self.micro_step = -1
        self.iteration = 0

    def add(self, op: str, nbytes: int, seconds: float, tag: str = "") -> None:
        self.total_seconds += seconds
        self.records.append(CommRecord(op, nbytes, self.phase, self.iteration, self.micro_step, seconds, tag,
                                       time.time() - seconds))

    def clear(self) -> None:
        self.records.clear()

    def of(self, iteration: int | None = None, op: str | None = None, phase: str | None = None,
           micro_step: int | None = None) -> list[CommRecord]:
        """Records matching all the given filters."""
        return [r for r in self.records
                if (iteration is None or r.iteration == iteration) and (op is None or r.op == op)
                and (phase is None or r.phase == phase) and (micro_step is None or r.micro_step == micro_step)]

    def seconds(self, **filters: Any) -> float:
        return sum(r.seconds for r in self.of(**filters))

    def summary(self, iteration: int | None = None) -> dict[str, dict[str, float]]:
        """Per op: count, bytes and seconds (of one iteration, or of all)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0, "seconds": 0.0})
        for r in self.of(iteration=iteration):
            s = out[r.op]
            s["count"] += 1
            s["bytes"] += r.bytes
            s["seconds"] += r.seconds
        return dict(out)

    def table(self, iteration: int | None = None) -> str:
        lines = [f"{'op':<16} {'count':>6} {'MB':>10} {'seconds':>9}"]
        for op, s in sorted(self.summary(iteration).items()):
            lines.append(f"{op:<16} {int(s['count']):>6} {s['bytes'] / 1e6:>10.3f} {s['seconds']:>9.4f}")
        return "\n".join(lines)


class _Pending:
    """An async collective in flight; ``wait()`` records the seconds blocked."""

    def __init__(self, comm: "Communicator", work: Any, op: str, nbytes: int, issue_s: float, tag: str) -> None:
        self.comm, self.work, self.op, self.nbytes, self.issue_s, self.tag = comm, work, op, nbytes, issue_s, tag
        self.phase, self.micro_step = comm.ledger.phase, comm.ledger.micro_step

    def wait(self) -> None:
        t0 = self.comm._start()
        if self.work is not None:
            self.comm._guard(self.op, self.tag, self.work.wait)
        blocked = self.issue_s + self.comm._stop(t0)
        ledger = self.comm.ledger
        saved = ledger.phase, ledger.micro_step
        ledger.phase, ledger.micro_step = self.phase, self.micro_step
        ledger.add(self.op, self.nbytes, blocked, self.tag)
        ledger.phase, ledger.micro_step = saved


class Communicator:
    """The engine's only door to ``torch.distributed``. With no process group initialised it
    runs as a world of one (every collective is a local copy), so single-process use works."""

    def __init__(self, process_group: Any = None, device: torch.device | None = None,
                 ledger: CommLedger | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group if process_group is not None else (dist.group.WORLD if self.distributed else None)
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.device = device or torch.device("cpu")
        self.ledger = ledger or CommLedger()
        self.backend = dist.get_backend(self.group) if self.distributed else "none"

    # timing: on CUDA synchronise so queued compute is not billed to the collective
    def _start(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _stop(self, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _run(self, op: str, nbytes: int, fn: Any, async_op: bool, tag: str) -> _Pending | None:
        t0 = self._start()
        work = self._guard(op, tag, lambda: fn(async_op)) if self.world_size > 1 else None
        if async_op:
            issue = time.perf_counter() - t0
            return _Pending(self, work, op, nbytes, issue, tag)
        self.ledger.add(op, nbytes, self._stop(t0), tag)
        return None

    def _guard(self, op: str, tag: str, fn: Any) -> Any:
        """Run a collective; a peer that died or timed out becomes a clear error on this rank."""
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as e:
            if isinstance(e, DistributedError):
                raise
            raise DistributedError(
                f"rank {self.rank}: collective {op} ({tag or 'untagged'}) failed — another rank probably died, "
                f"raised outside a collective, or timed out ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
            ) from e

    def all_reduce(self, tensor: torch.Tensor, tag: str = "", async_op: bool = False) -> _Pending | None:
        """Sum ``tensor`` over ranks, in place."""
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_reduce", nbytes,
                         lambda a: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=a),
                         async_op, tag)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, tag: str = "",
                       async_op: bool = False) -> _Pending | None:
        """``output`` (1/N of ``input``) gets this rank's slice of the sum of ``input`` over ranks."""
        if self.world_size == 1:
            output.copy_(input)
        nbytes = input.numel() * input.element_size()
        return self._run("reduce_scatter", nbytes,
                         lambda a: _reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM,
                                                              group=self.group, async_op=a),
                         async_op, tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: str = "",
                   async_op: bool = False) -> _Pending | None:
        """``output`` (N x ``input``) gets every rank's ``input``, in rank order."""
        if self.world_size == 1:
            output.copy_(input)
        nbytes = output.numel() * output.element_size()
        return self._run("all_gather", nbytes,
                         lambda a: _all_gather_tensor(output, input, group=self.group, async_op=a),
                         async_op, tag)

    def all_gather_object(self, obj: Any, tag: str = "") -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        t0 = self._start()
        self._guard("all_gather_object", tag, lambda: dist.all_gather_object(out, obj, group=self.group))
        self.ledger.add("all_gather_object", 0, self._stop(t0), tag)
        return out

    def gather_verdicts(self, error: str | None, value: Any, what: str, *, mismatch: str | None = None,
                        error_type: type[DistributedError] = DistributedError) -> list[Any]:
        """Every rank's ``value``, or ``error_type`` on every rank naming each rank's ``error``
        (and, given ``mismatch``, the fix to name when the values differ between ranks). A peer
        that died or timed out is an ``error_type`` too, naming ``what``."""
        try:
            verdicts = self.all_gather_object((error, value), tag=what)
        except DistributedError as e:
            if error_type is DistributedError:
                raise
            raise error_type(f"{what}: {e}") from e
        lines = [f"  rank {r}: {e}" for r, (e, _) in enumerate(verdicts) if e is not None]
        if lines:
            raise error_type(f"{what} failed on {len(lines)} of {self.world_size} ranks:\n" + "\n".join(lines))
        values = [v for _, v in verdicts]
        if mismatch is not None and len(set(values)) > 1:
            raise error_type(f"{what} failed: {mismatch}")
        return values

    def agree(self, error: str | None, what: str) -> None:
        """Agreement point: every rank says whether it is fine. If any rank is not, every rank
        raises ``DistributedError`` naming each failing rank and its reason — no rank is left
        waiting in a later collective."""
        flag = torch.tensor([0.0 if error is None else 1.0], device=self.device)
        self.all_reduce(flag, tag=f"agree:{what}")
        if flag.item() == 0:
            return
        errors = self.all_gather_object(error, tag=f"agree:{what}")
        lines = [f"  rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        raise DistributedError(f"{what} failed on {len(lines)} of {self.world_size} ranks:\n" + "\n".join(lines))
