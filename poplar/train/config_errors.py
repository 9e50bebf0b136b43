"""The errors of a config (``poplar.train.config``): ``ConfigError`` names a key and its fix;
``ConfigProblems`` collects them while a config is read, so a bad key hides no other and a user
fixes every problem in one pass, not one a run."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


class ConfigError(ValueError):
    """A config that cannot be run; the message names the key and the fix."""


class ConfigProblems:
    """The problems of one config: each part is read under ``check()``, and ``raise_all()``
    raises one ``ConfigError`` naming every problem (one alone: its own message)."""

    def __init__(self) -> None:
        self.found: list[str] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        """Read one part of the config; its ``ConfigError`` is kept, and reading goes on."""
        try:
            yield
        except ConfigError as e:
            self.found.append(str(e))

    def section(self, raw: dict, key: str, where: str) -> dict:
        """The object ``raw[key]`` ({} where it is missing or null; where it is not an object, {}
        and a problem naming it, ``where``: the key's section, "" at the top)."""
        value: Any = raw.get(key)
        if value is None or isinstance(value, dict):
            return value or {}
        self.found.append(f'"{where}{key}" must be an object (a dict), got {value!r}')
        return {}

    def raise_all(self) -> None:
        if len(self.found) == 1:
            raise ConfigError(self.found[0])
        if self.found:
            raise ConfigError(f"the config has {len(self.found)} problems:\n" +
                              "\n".join(f"  {i}. {problem}" for i, problem in enumerate(self.found, 1)))
