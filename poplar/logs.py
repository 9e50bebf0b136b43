"""Poplar's logger: ``logging.getLogger("poplar")``. Unless the application configured it (gave
it a handler), its first use installs one that prints ``[poplar] message`` to stderr at INFO, as
training launchers do, so auto mode's plan and the training progress show without set-up.
Callers log on rank 0 only, unless a line is about one rank."""

from __future__ import annotations

import logging
import sys

_logger = logging.getLogger("poplar")


def _ensure_handler() -> None:
    if not _logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[poplar] %(message)s"))
        _logger.addHandler(handler)
        if _logger.level == logging.NOTSET:
            _logger.setLevel(logging.INFO)
        _logger.propagate = False


class _Log:
    """``log.info(...)`` etc. with the default handler installed on first use."""

    def __getattr__(self, name: str):  # noqa: ANN204 - forwards to logging.Logger
        _ensure_handler()
        return getattr(_logger, name)


log = _Log()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: object) -> None:
        pass

    def write(self, message: str, file: object = None) -> None:
        log.info(message.removeprefix("[poplar] "))

    def close(self) -> None:
        pass

    total = 0


def progress_bar(total: int, desc: str, enabled: bool = True):  # noqa: ANN201 - a tqdm or a stand-in
    """A tqdm progress bar on stderr when ``enabled`` and stderr is a terminal (tqdm's
    ``disable=None``); otherwise a stand-in with the same methods that draws nothing."""
    if enabled and total > 0:
        try:
            from tqdm import tqdm
        except ImportError:
            return _NoBar()
        return tqdm(total=total, desc=f"[poplar] {desc}", unit="it", disable=None, file=sys.stderr, leave=False)
    return _NoBar()
