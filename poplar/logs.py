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
