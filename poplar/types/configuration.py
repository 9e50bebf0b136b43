"""A configuration: one way to run a model, a ZeRO stage with an activation checkpointing setting.

The profiler measures configurations, the planner prices them, auto mode chooses among them
(docs/design.md §7.1), and an emulated cluster's calibration covers the heaviest one: all of
them speak of this one type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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


@dataclass(frozen=True)
class CandidateRow:
    """One configuration in auto mode's table (docs/design.md §7.1): whether it fits every rank,
    its mbs per device type, its predicted iteration (from its own timing rounds, or an estimate:
    a lower bound), whether it was chosen, and why not."""

    stage: int
    checkpointing: bool
    fits: bool
    mbs: dict[str, int] = field(default_factory=dict)  # per device type (smallest over its ranks)
    predicted_s: float | None = None  # predicted iteration seconds
    timed: bool = False  # predicted from its own timing rounds (else an estimate, a lower bound)
    reason: str = ""  # why it was rejected ("" for the choice)
    chosen: bool = False
    source: str = ""  # where the prediction comes from, when neither timed nor a bound ("presets")

    @property
    def configuration(self) -> Configuration:
        return Configuration(self.stage, self.checkpointing)

    @property
    def name(self) -> str:
        return self.configuration.name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CandidateRow":
        return cls(**d)


def heaviest(configurations: Sequence[Configuration]) -> Configuration | None:
    """The configuration whose micro-steps compute the most on one device: the highest stage,
    checkpointed if any is (None for no configurations)."""
    if not configurations:
        return None
    stage = max(c.stage for c in configurations)
    checkpointing = next((c.checkpointing for c in configurations if c.checkpointed), None)
    return Configuration(stage, checkpointing)
