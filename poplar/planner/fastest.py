"""The one rule of every choice among plans: the fastest predicted, unless a preferred candidate
is predicted within the tie.

Each choice (shard weights, optimizer placements, the way collectives cross nodes, which GPUs
take part, quantized collectives) plans its candidates in full and records each as a typed row
of the plan's table (``types.plan_choice``). ``fastest`` picks among them: of the candidates
predicted within ``tie`` (a fraction) of the fastest, the most preferred, and among equally
preferred ones the fastest (the first on equal predictions). A choice states its preference, and
why, where it builds its candidates: a prediction the cost model cannot resolve is no reason to
leave the plan that is better known, or simpler, or exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, Sequence, TypeVar

from poplar.types.plans import Plan


class Priced(Protocol):
    """A typed candidate row: its predicted iteration (None: no plan)."""

    @property
    def predicted_s(self) -> float | None: ...


R = TypeVar("R", bound=Priced)


@dataclass(frozen=True)
class Candidate(Generic[R]):
    """One candidate of a choice: its row of the plan's table, its plan (None where the row says
    why there is none) and its ``preference`` within the tie (0 first)."""

    row: R
    plan: Plan | None = None
    preference: int = 0


def fastest(candidates: Sequence[Candidate[R]], tie: float) -> Candidate[R]:
    """The most preferred candidate predicted within ``tie`` of the fastest; among equally
    preferred ones the fastest, the first on equal predictions. Candidates without a plan or a
    prediction are not chosen; a ``ValueError`` where no candidate has one."""
    priced = [c for c in candidates if c.plan is not None and c.row.predicted_s is not None]
    if not priced:
        raise ValueError("no candidate has a plan to choose")
    best = min(priced, key=_seconds)
    limit = _seconds(best) * (1 + tie)
    within = [c for c in priced if _seconds(c) <= limit]
    first = min(c.preference for c in within)
    return min((c for c in within if c.preference == first), key=_seconds)


def _seconds(candidate: Candidate) -> float:
    return candidate.row.predicted_s  # type: ignore[return-value]  # priced: not None
