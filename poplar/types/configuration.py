"""A configuration: one way to run a model, a ZeRO stage with an activation checkpointing setting.

The profiler measures configurations, the planner prices them, auto mode chooses among them
(docs/design.md §7.1), and an emulated cluster's calibration covers the heaviest one: all of
them speak of this one type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Configuration:
    """A ZeRO stage (0-3) and an activation checkpointing setting: None or False off; True (the
    wrap policy's blocks) or a policy naming module classes on."""

    stage: int
    checkpointing: Any = None

    @property
    def checkpointed(self) -> bool:
        return self.checkpointing not in (None, False)

    @property
    def name(self) -> str:
        return f"ZeRO-{self.stage}{' +ckpt' if self.checkpointed else ''}"


def heaviest(configurations: Sequence[Configuration]) -> Configuration | None:
    """The configuration whose micro-steps compute the most on one device: the highest stage,
    checkpointed if any is (None for no configurations)."""
    if not configurations:
        return None
    stage = max(c.stage for c in configurations)
    checkpointing = next((c.checkpointing for c in configurations if c.checkpointed), None)
    return Configuration(stage, checkpointing)
