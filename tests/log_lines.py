"""A logging handler that keeps the messages it receives, for tests that check what was said."""

from __future__ import annotations

import logging


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
