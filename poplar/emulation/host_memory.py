"""The host running out of memory while the emulator calibrates: one error that names the model
and what to change, instead of the CPU allocator's raw message.

An emulated cluster runs every rank's model in this machine's memory, and calibration runs trial
steps of growing batches on it, so a model that fits each emulated GPU can still exhaust the
host. torch's CPU allocator then raises a plain ``RuntimeError`` ("DefaultCPUAllocator: can't
allocate memory"), possibly wrapped in the runtime's failure report; Python raises
``MemoryError``. ``host_memory_guard`` turns either into ``HostMemoryError``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from poplar.emulation.cluster import ClusterError

_ALLOCATOR_WORDS = ("defaultcpuallocator", "can't allocate memory", "cannot allocate memory", "not enough memory")


class HostMemoryError(ClusterError):
    """The host ran out of memory while emulating a cluster; the message names the model and the fix."""


def _allocator_error(exc: BaseException | None) -> BaseException | None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError):
            return exc
        if isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _ALLOCATOR_WORDS):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _allocator_words(exc: BaseException) -> str:
    """The line of the allocator's message that says what failed."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if any(w in line.lower() for w in _ALLOCATOR_WORDS)]
    return (said or lines or [type(exc).__name__])[0][:240]


def describe_model(model: object | None) -> str:
    """A model's class and parameter count, for messages."""
    if model is None:
        return "the model"
    try:
        count = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a description only
        return f"the model {type(model).__name__}"
    size = f"{count / 1e6:,.1f}M" if count >= 10 ** 5 else f"{count:,}"
    return f"the model {type(model).__name__} ({size} parameters)"


@contextlib.contextmanager
def host_memory_guard(model: Callable[[], object | None], what: str) -> Iterator[None]:
    """Within the block, the host's out-of-memory becomes ``HostMemoryError`` naming ``model()``
    (called only then) and ``what`` was being done."""
    try:
        yield
    except Exception as e:
        cause = _allocator_error(e)
        if cause is None:
            raise
        first = _allocator_words(cause)
        raise HostMemoryError(
            f"this machine ran out of memory while calibrating the emulated cluster on {describe_model(model())} "
            f"({what}): the emulator holds every rank's model, gradients and optimizer state in host memory. "
            f"Emulate a smaller model (fewer layers or a smaller hidden size), shorter samples (a smaller seq_len), "
            f"a cluster of fewer GPUs, or run on a machine with more memory ({first})") from None
