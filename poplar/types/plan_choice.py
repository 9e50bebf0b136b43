"""How a plan was chosen: the typed rows of the tables a plan keeps for a reader (``Plan.choice``).

Each choice the planner makes among alternatives (shard weights, optimizer placements, the way
collectives cross nodes, which GPUs take part, quantized collectives; auto mode's configuration)
records every candidate it planned as one row: what the candidate is, its predicted iteration
(None: no plan, ``reason`` says why) and, where the table marks it, whether it was chosen. The
runtime reads none of it. Rows are frozen; their JSON is the plain object of their fields, and a
plan written before the rows were typed (the same keys, some absent) reads as the same rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any

from poplar.types.compression import CommPolicy
from poplar.types.configuration import CandidateRow
from poplar.types.errors import PlanError


class OffloadPricing(str, Enum):
    """Whether the planner priced the optimizer placements (offload copies and host step)."""

    PRICED = "priced"  # each placement candidate planned and priced from the profile's offload cost
    NO_OFFLOAD_COST = "no_offload_cost"  # not priced: the profile has no offload cost; nothing offloaded
    OTHER_STAGE = "other_stage"  # not priced: planned at another stage than the profile measured
    AS_GIVEN = "as_given"  # the placements given, not priced (the profile has no offload cost)


def _row(kind: type, value: Any, where: str) -> Any:
    """``value`` as a ``kind`` row: itself, or read from its JSON object (lists become tuples)."""
    if isinstance(value, kind):
        return value
    if not isinstance(value, dict):
        raise PlanError(f"plan choice.{where} rows must be objects, got {value!r}")
    try:
        return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
    except TypeError as e:
        raise PlanError(f"malformed plan choice.{where} row {value!r}: {e}") from None


def _rows(kind: type, values: Any, where: str) -> tuple | None:
    if values is None:
        return None
    if not isinstance(values, (list, tuple)):
        raise PlanError(f"plan choice.{where} must be a list of rows, got {values!r}")
    return tuple(_row(kind, v, where) for v in values)


@dataclass(frozen=True)
class ShardRow:
    """One set of shard weights planned (``planner.shards``): its name and weights, the predicted
    iteration and every rank's largest micro-batch there."""

    name: str
    weights: tuple[float, ...]
    predicted_s: float | None = None
    reason: str | None = None
    mbs: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PlacementRow:
    """One (shard weights, optimizer placement) pair planned (``planner.placement_choice``): the
    shard candidate's name and weights, the placement's name and every rank's placement (None
    where no placement could be named: ``reason``), the predicted iteration with the largest
    rank's offload seconds (``offload_s``) and every rank's largest micro-batch."""

    shards: str
    weights: tuple[float, ...]
    offload: str | None = None
    offloads: tuple[str, ...] | None = None  # the values of ``Offload``, one per rank
    predicted_s: float | None = None
    reason: str | None = None
    offload_s: float | None = None
    mbs: tuple[int, ...] | None = None


@dataclass(frozen=True)
class CollectivesRow:
    """One way of running the collectives planned (``planner.collective_choice``; the value of a
    ``Collectives``), its predicted iteration and whether it was chosen."""

    collectives: str
    predicted_s: float | None = None
    reason: str | None = None
    chosen: bool = False
    held_share: float = 1.0  # once per iteration: the share of the parameters held so (``Route``'s Note: a share held)


@dataclass(frozen=True)
class SubsetRow:
    """One set of GPUs planned (``planner.participation``): its name, the ranks it leaves out, its
    predicted iteration and whether it was chosen."""

    subset: str
    left_out: tuple[int, ...] = ()
    predicted_s: float | None = None
    reason: str | None = None
    chosen: bool = False


@dataclass(frozen=True)
class CompressionCandidate:
    """One option of quantized collectives priced with ``allow_lossy``: its policy and predicted
    iteration (None: no plan, ``reason`` says why)."""

    policy: CommPolicy
    predicted_s: float | None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_dict(), "predicted_s": self.predicted_s, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompressionCandidate":
        return cls(CommPolicy.from_dict(d["policy"]), d.get("predicted_s"), d.get("reason"))


@dataclass(frozen=True)
class CompressionChoice:
    """How the plan's quantized collectives were chosen with ``allow_lossy``: the policy kept
    (``chosen``: exact unless a lossy one was predicted faster by more than ``tie``), the
    predicted iteration of the fastest exact plan and of the plan kept, and every option priced."""

    chosen: CommPolicy
    exact_s: float | None
    chosen_s: float | None
    tie: float
    candidates: tuple[CompressionCandidate, ...] = ()

    @property
    def saving_s(self) -> float:
        """Predicted seconds per iteration the chosen policy saves over exact (0: exact kept)."""
        if self.exact_s is None or self.chosen_s is None:
            return 0.0
        return self.exact_s - self.chosen_s

    @property
    def saving(self) -> float:
        """``saving_s`` as a fraction of the exact plan's predicted iteration."""
        return self.saving_s / self.exact_s if self.exact_s else 0.0

    def describe(self) -> str:
        """A line for the plan table: what was chosen and the predicted saving, or why exact."""
        if self.chosen.lossy:
            return (f"{self.chosen.describe()} chosen (allow_lossy): predicted {100 * self.saving:.1f}% faster than "
                    f"exact ({self.chosen_s:.4f} s vs {self.exact_s:.4f} s)")
        priced = [c for c in self.candidates if c.policy.lossy and c.predicted_s is not None]
        if not priced or self.exact_s is None:
            return "exact collectives (allow_lossy: no quantized option could be planned)"
        best = min(priced, key=lambda c: c.predicted_s)  # type: ignore[arg-type, return-value]
        percent = round(100 * (self.exact_s - best.predicted_s) / self.exact_s, 1)  # type: ignore[operator]
        # by the sign of the gain as printed: a gain that rounds to 0.0 % is a tie, never "-0.0% slower"
        by = f"{percent:.1f}% faster, not more than the tie ({100 * self.tie:.1f}%)" if percent > 0 else \
            f"{-percent:.1f}% slower" if percent < 0 else "to take as long as exact (a tie)"
        return f"exact collectives kept (allow_lossy): the best quantized option, {best.policy.describe()}, is " \
               f"predicted {by}"

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.to_dict(), "exact_s": self.exact_s, "chosen_s": self.chosen_s, "tie": self.tie,
                "saving_s": self.saving_s, "candidates": [c.to_dict() for c in self.candidates]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompressionChoice":
        try:
            return cls(CommPolicy.from_dict(d["chosen"]), d.get("exact_s"), d.get("chosen_s"), float(d["tie"]),
                       tuple(CompressionCandidate.from_dict(c) for c in d.get("candidates", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed choice.compression_choice record: {e}; give chosen, exact_s, chosen_s, tie "
                            "and candidates") from None


@dataclass(frozen=True)
class DeviceTypeRow:
    """One device type as the plan saw it: its ranks, its largest micro-batch (smallest over its
    ranks) and its speed curve's peak."""

    device_type: str
    count: int
    mbs: int
    peak_batch: int
    peak_samples_per_s: float


@dataclass(frozen=True)
class KeptPlan:
    """A conventional plan (``strategy``) the ``poplar`` strategy kept because it was predicted
    within ``tie`` of the allocator's own plan (``own_predicted_s``)."""

    strategy: str
    predicted_s: float
    own_predicted_s: float
    tie: float


@dataclass(frozen=True)
class AllocatorSearch:
    """What the ``poplar`` strategy's allocator searched; a field is None where it does not apply."""

    # ZeRO-0/1 (``planner.zero01``): the cheaper of two allocators under the cost model, and both prices
    allocator: str | None = None
    paper_predicted_s: float | None = None
    threshold_predicted_s: float | None = None
    # ZeRO-2/3 (``planner.zero23``): the lock-step micro-steps found, the full and last step's
    # compute, the candidate full steps searched and the search's own price of its plan
    micro_steps: int | None = None
    full_step_s: float | None = None
    last_step_s: float | None = None
    candidates: int | None = None
    search_predicted_s: float | None = None
    kept: KeptPlan | None = None  # a conventional plan kept within the tie instead of the allocator's

    @classmethod
    def read(cls, value: Any) -> "AllocatorSearch | None":
        """The search of a plan's JSON object (itself, or None, as it is)."""
        if value is None or isinstance(value, cls):
            return value
        found = _row(cls, value, "search")
        return found if found.kept is None else replace(found, kept=_row(KeptPlan, found.kept, "search.kept"))


@dataclass
class PlanChoice:
    """How a plan was chosen among alternatives: tables and numbers for a reader (``plan.json``,
    the log); the runtime reads none of it. None: that choice was not made."""

    plan_tie: float | None = None  # a predicted gain below this fraction keeps the conventional plan
    offload_pricing: OffloadPricing | None = None
    offload_s: list[float] | None = None  # per rank: predicted seconds of its offload copies and host step
    shard_candidates: tuple[ShardRow, ...] | None = None  # the shard weights planned
    placement_candidates: tuple[PlacementRow, ...] | None = None  # shard weights x optimizer placements planned
    # auto mode: the configurations it compared, its rule, its profiling seconds, the profile store's use
    candidates: tuple[CandidateRow, ...] | None = None
    choice_rule: str | None = None
    profiling_s: dict[str, float] | None = None
    profile_store: str | None = None
    shard_trial_failed_on: list[int] | None = None  # ranks where the planned shard weights did not fit a step
    # on a job that spans nodes: each way of running the collectives planned
    collective_candidates: tuple[CollectivesRow, ...] | None = None
    # on a job that spans nodes: each set of GPUs planned
    participation_candidates: tuple[SubsetRow, ...] | None = None
    # allow_lossy: the quantized collectives chosen, the options priced and the predicted saving
    compression_choice: CompressionChoice | None = None
    # the strategy's search (``poplar`` only), the device types planned and the communication the
    # cost model priced per micro-step and per iteration
    search: AllocatorSearch | None = None
    device_types: tuple[DeviceTypeRow, ...] | None = None
    comm_per_micro_step_s: float | None = None
    comm_per_iteration_s: float | None = None

    def __post_init__(self) -> None:
        if self.offload_pricing is not None:
            self.offload_pricing = OffloadPricing(self.offload_pricing)
        if isinstance(self.compression_choice, dict):
            self.compression_choice = CompressionChoice.from_dict(self.compression_choice)
        self.shard_candidates = _rows(ShardRow, self.shard_candidates, "shard_candidates")
        self.placement_candidates = _rows(PlacementRow, self.placement_candidates, "placement_candidates")
        self.candidates = _rows(CandidateRow, self.candidates, "candidates")
        self.collective_candidates = _rows(CollectivesRow, self.collective_candidates, "collective_candidates")
        self.participation_candidates = _rows(SubsetRow, self.participation_candidates, "participation_candidates")
        self.device_types = _rows(DeviceTypeRow, self.device_types, "device_types")
        self.search = AllocatorSearch.read(self.search)


def row_dicts(rows: tuple | None) -> list[dict[str, Any]] | None:
    """A table's rows as JSON objects (None stays None)."""
    return None if rows is None else [asdict(r) for r in rows]

