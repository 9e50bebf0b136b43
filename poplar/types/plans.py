"""Plans: how many samples each rank processes per iteration, and in which micro-steps.

A rank runs ``accum_steps`` micro-steps of ``micro_batch_size`` samples, then one more of
``last_batch_size`` samples if that is > 0. The global batch size is the sum over ranks.
At ZeRO-1/2/3 rank r also holds a share ``shard_weight_r / sum of weights`` of every sharded
state (optimizer state, gradients, parameters): equal weights are ZeRO's even shards. A rank
whose ``offload`` is ``Offload.OPTIMIZER`` keeps its optimizer state and fp32 master shard in
host memory and steps them there (ZeRO-1/2/3).
A plan also records how its collectives cross nodes when the job spans them (``poplar.Topology``):
``collectives`` (``poplar.types.route.Collectives``: flat, hierarchical, or at ZeRO-3 hierarchical
with secondary shards, docs/design.md §3.10); on one node every way runs as the flat collectives.
``compression`` (``poplar.types.compression.CommPolicy``) says which collectives send
block-quantized values; exact unless a user turns it on. ``route`` is the three a communicator
needs as one value: the ranks in the step, the way, the compression.
Plans are saved as JSON so that people can read and edit them.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import stat
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from poplar.types.compression import EXACT, CommPolicy, CompressionError
from poplar.types.errors import PlanError
from poplar.types.plan_choice import (  # noqa: F401  (the plan's records, importable from here)
    CompressionCandidate, CompressionChoice, OffloadPricing, PlanChoice)
from poplar.types.route import Collectives, Route, held_share_problem, read_collectives


def _check_count(name: str, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{where}: {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise PlanError(f"{where}: {name} must be >= 0, got {value}")
    return value


class Offload(str, Enum):
    """Where a rank keeps its shard of the optimizer state (and its fp32 master shard)."""

    NONE = "none"  # on its device
    OPTIMIZER = "optimizer"  # in host memory, stepped by the CPU


@dataclass
class RankPlan:
    """One rank's share of an iteration: ``accum_steps`` x ``micro_batch_size`` + ``last_batch_size``
    samples, and its ``shard_weight``: relative to the other ranks', the share of the sharded
    model state it holds (1.0 everywhere: even shards; 0: none); ``offload``: where its optimizer
    state lives (``Offload``; a plan file's "none" or "optimizer")."""

    micro_batch_size: int
    accum_steps: int
    last_batch_size: int = 0
    predicted_compute_s: float | None = None
    device_type: str | None = None
    shard_weight: float = 1.0
    offload: Offload = Offload.NONE

    def __post_init__(self) -> None:
        if isinstance(self.offload, str) and not isinstance(self.offload, Offload):
            try:
                self.offload = Offload(self.offload)
            except ValueError:
                pass  # validate() names it

    def validate(self, where: str = "RankPlan") -> None:
        _check_count("micro_batch_size", self.micro_batch_size, where)
        _check_count("accum_steps", self.accum_steps, where)
        _check_count("last_batch_size", self.last_batch_size, where)
        w = self.shard_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise PlanError(f"{where}: shard_weight must be a finite number >= 0 (its share of the sharded "
                            f"state, relative to the other ranks'), got {w!r}")
        if not isinstance(self.offload, Offload):
            raise PlanError(f"{where}: offload must be Offload.NONE or Offload.OPTIMIZER (\"none\" or "
                            f"\"optimizer\" in a plan file), got {self.offload!r}")
        if self.accum_steps > 0 and self.micro_batch_size == 0:
            raise PlanError(
                f"{where}: accum_steps={self.accum_steps} with micro_batch_size=0 runs empty "
                "micro-steps; set accum_steps=0 or a micro_batch_size >= 1")

    @property
    def num_samples(self) -> int:
        """n_i = b * gas + lbs: samples this rank processes per iteration."""
        return self.micro_batch_size * self.accum_steps + self.last_batch_size

    @property
    def left_out(self) -> bool:
        """No samples and no shard: the rank sits out the training step (docs/design.md §3.12)."""
        return self.num_samples == 0 and self.shard_weight == 0

    @property
    def num_micro_steps(self) -> int:
        return self.accum_steps + (1 if self.last_batch_size > 0 else 0)

    def micro_batch_sizes(self) -> list[int]:
        """The size of each micro-step, in order."""
        sizes = [self.micro_batch_size] * self.accum_steps
        if self.last_batch_size > 0:
            sizes.append(self.last_batch_size)
        return sizes


@dataclass
class Plan:
    """One row per rank, plus what the planner predicted for it (if it came from a planner):
    ``choice`` says how it was chosen (its tables and numbers, typed); ``meta`` holds a user's
    own notes, carried as they are: the planner writes nothing there."""

    ranks: list[RankPlan]
    zero_stage: int | None = None
    strategy: str | None = None
    predicted_iteration_s: float | None = None
    predicted_comm_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    choice: PlanChoice = field(default_factory=PlanChoice)
    collectives: Collectives = Collectives.FLAT  # how they cross nodes on a topology that spans nodes
    compression: CommPolicy = EXACT  # quantized collectives (lossy; off unless a user turns them on)
    # across nodes once per iteration: the share of the parameters that cross so, the rest per
    # micro-step (``Route``'s Note: a share held)
    held_share: float = 1.0

    def __post_init__(self) -> None:
        self.ranks = [r if isinstance(r, RankPlan) else RankPlan(**r) for r in self.ranks]
        if isinstance(self.collectives, str):
            self.collectives = Collectives.named(self.collectives, PlanError)
        if isinstance(self.choice, dict):
            self.choice = PlanChoice(**self.choice)
        if isinstance(self.compression, dict):
            try:
                self.compression = CommPolicy.from_dict(self.compression)
            except CompressionError as e:
                raise PlanError(f"plan compression: {e}") from None
        self.validate()

    @property
    def route(self) -> Route:
        """How this plan's collectives run: the ranks in the step, the way, the compression."""
        return Route(self.step_ranks, self.collectives, self.compression, self.held_share)

    @property
    def hierarchical(self) -> bool:
        """Whether the collectives cross nodes in two tiers (read-only; the way is ``collectives``)."""
        return self.collectives.hierarchical

    @property
    def secondary_shards(self) -> bool:
        """Whether ZeRO-3 keeps node-local secondary shards (read-only; the way is ``collectives``)."""
        return self.collectives.secondary_shards

    @property
    def predicted_samples_per_s(self) -> float | None:
        """The global batch over the predicted iteration (None: not predicted)."""
        if not self.predicted_iteration_s:
            return None
        return self.global_batch_size / self.predicted_iteration_s

    def validate(self) -> None:
        if not self.ranks:
            raise PlanError("plan has no ranks; give one RankPlan per rank")
        for i, r in enumerate(self.ranks):
            if not isinstance(r, RankPlan):
                raise PlanError(f"plan rank {i} must be a RankPlan, got {type(r).__name__}")
            r.validate(f"plan rank {i}")
        if self.global_batch_size == 0:
            raise PlanError("plan processes 0 samples per iteration; give at least one rank samples")
        if sum(r.shard_weight for r in self.ranks) <= 0:
            raise PlanError("plan's shard weights are all 0; some rank must hold the sharded state "
                            "(1.0 on every rank gives even shards)")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"plan zero_stage must be 0-3, got {self.zero_stage}")
        if not isinstance(self.collectives, Collectives):
            raise PlanError(f"plan collectives must be one of {', '.join(repr(c.value) for c in Collectives)}, "
                            f"got {self.collectives!r}")
        if self.collectives.secondary_shards and self.zero_stage not in (None, 3):
            raise PlanError(f"plan has collectives=\"secondary_shards\" at zero_stage={self.zero_stage}; "
                            "secondary shards are ZeRO-3's (parameters sharded): use zero_stage=3, or "
                            "collectives=\"hierarchical\"")
        if (problem := held_share_problem(self.held_share, self.collectives)) is not None:
            raise PlanError(f"plan: {problem}")
        if not isinstance(self.compression, CommPolicy):
            raise PlanError(f"plan compression must be a CommPolicy, got {self.compression!r}")
        if (problem := self.compression.problem(self.zero_stage)) is not None:
            raise PlanError(f"plan: {problem}")

    def problem(self, world_size: int) -> str | None:
        """Why this plan cannot run on ``world_size`` ranks, or None. Checked again each time a
        runtime takes a plan: its fields may have been edited since it was built."""
        try:
            self.validate()
        except PlanError as e:
            return str(e)
        if self.world_size != world_size:
            return f"plan has {self.world_size} rows but the world has {world_size} ranks; give one RankPlan per rank"
        return None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def global_batch_size(self) -> int:
        return sum(r.num_samples for r in self.ranks)

    @property
    def shard_weights(self) -> tuple[float, ...]:
        """Every rank's shard weight, in rank order."""
        return tuple(float(r.shard_weight) for r in self.ranks)

    @property
    def offloads(self) -> tuple[Offload, ...]:
        """Every rank's optimizer placement, in rank order."""
        return tuple(r.offload for r in self.ranks)

    def with_offloads(self, offloads: tuple[Offload, ...]) -> "Plan":
        """This plan with these optimizer placements, one per rank (batches and shards kept)."""
        if len(offloads) != self.world_size:
            raise PlanError(f"{len(offloads)} offload placements for a plan of {self.world_size} ranks; give one per rank")
        return replace(self, ranks=[replace(r, offload=o) for r, o in zip(self.ranks, offloads)], meta=dict(self.meta),
                       choice=replace(self.choice))

    @property
    def even_shards(self) -> bool:
        return len(set(self.shard_weights)) == 1

    def shard_shares(self) -> list[float]:
        """Every rank's fraction of the sharded state (weights over their sum)."""
        return list(shares_of(self.shard_weights))

    @property
    def left_out(self) -> tuple[int, ...]:
        """The ranks this plan leaves out of the training step (rows of 0 samples and weight 0)."""
        return tuple(i for i, r in enumerate(self.ranks) if r.left_out)

    @property
    def step_ranks(self) -> tuple[int, ...]:
        """The ranks in the training step: every rank but those left out."""
        return tuple(i for i, r in enumerate(self.ranks) if not r.left_out)

    @property
    def max_micro_steps(self) -> int:
        """The micro-steps every rank in the step runs at stages 2/3 (a rank left out runs none)."""
        return max(r.num_micro_steps for r in self.ranks)

    def sample_offsets(self) -> list[int]:
        """Start of each rank's contiguous slice of the global batch."""
        offsets, start = [], 0
        for r in self.ranks:
            offsets.append(start)
            start += r.num_samples
        return offsets

    @classmethod
    def even(cls, world_size: int, global_batch_size: int, micro_batch_size: int) -> "Plan":
        """Equal shares, as DeepSpeed runs: gbs / world_size samples each, in micro-steps of
        ``micro_batch_size`` plus a last micro-step for any remainder."""
        if world_size < 1:
            raise PlanError(f"world_size must be >= 1, got {world_size}")
        if micro_batch_size < 1:
            raise PlanError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if global_batch_size % world_size:
            raise PlanError(
                f"global_batch_size {global_batch_size} does not divide by world_size {world_size}; "
                "an even plan needs equal shares (use a planner for uneven ones)")
        share = global_batch_size // world_size
        gas, lbs = divmod(share, micro_batch_size)
        return cls([RankPlan(micro_batch_size, gas, lbs) for _ in range(world_size)], strategy="even")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for row in d["ranks"]:
            row["offload"] = Offload(row["offload"]).value
        if self.choice.offload_pricing is not None:
            d["choice"]["offload_pricing"] = self.choice.offload_pricing.value
        d["collectives"] = self.collectives.value
        d["compression"] = self.compression.to_dict()
        if self.choice.compression_choice is not None:
            d["choice"]["compression_choice"] = self.choice.compression_choice.to_dict()
        d["global_batch_size"] = self.global_batch_size
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = read_collectives(d, PlanError)  # a plan written before routes: its two booleans
        gbs = d.pop("global_batch_size", None)
        try:
            plan = cls(**d)
        except TypeError as e:
            raise PlanError(f"malformed plan: {e}") from None
        if gbs is not None and gbs != plan.global_batch_size:
            raise PlanError(
                f"plan says global_batch_size={gbs} but its ranks sum to {plan.global_batch_size}; "
                "fix the rows or the total")
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        return cls.from_dict(read_json(path, "plan file", PlanError))

    def table(self) -> str:
        """A readable table of the rows. Every table has the offload column (each rank's optimizer
        placement, as plan.json records it), so a table always says where the optimizer lives."""
        shares = None if self.even_shards else self.shard_shares()  # the column only for uneven shards
        head = f"{'rank':>4} {'device':>12} {'b':>5} {'gas':>5} {'lbs':>5} {'n':>6} {'pred s':>9}"
        head += ("" if shares is None else f" {'shard':>6}") + f" {'offload':>9}"
        lines = [head, "-" * len(head)]
        for i, r in enumerate(self.ranks):
            pred = "" if r.predicted_compute_s is None else f"{r.predicted_compute_s:.4f}"
            lines.append(f"{i:>4} {str(r.device_type or '-'):>12} {r.micro_batch_size:>5} "
                         f"{r.accum_steps:>5} {r.last_batch_size:>5} {r.num_samples:>6} {pred:>9}"
                         + ("" if shares is None else f" {100 * shares[i]:>5.1f}%")
                         + f" {r.offload.value:>9}")
        tail = f"global batch {self.global_batch_size}"
        if self.left_out:
            tail += f", ranks {list(self.left_out)} left out"
        if self.collectives.hierarchical:
            tail += ", hierarchical collectives" + {Collectives.SECONDARY_SHARDS: " with secondary shards",
                                                    Collectives.ONCE_PER_ITERATION: " across nodes once per iteration"
                                                    }.get(self.collectives, "")
            if self.held_share < 1:
                tail += f" for {100 * self.held_share:.0f}% of the parameters"
        if self.choice.compression_choice is not None:
            tail += f", {self.choice.compression_choice.describe()}"
        elif self.compression.lossy:
            tail += f", {self.compression.describe()}"
        if self.predicted_iteration_s is not None:
            tail += f", predicted iteration {self.predicted_iteration_s:.4f} s"
        lines.append(tail)
        return "\n".join(lines)


def shard_weights_problem(weights: Any) -> str | None:
    """Why ``weights`` cannot be the ranks' shard weights (one number per rank), or None."""
    try:
        values = list(weights)
    except TypeError:
        values = None
    if not values or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0
                         for w in values) or sum(values) <= 0:
        return f"shard weights must be one finite number >= 0 per rank, not all 0, got {weights!r}"
    return None


def shares_of(weights: tuple[float, ...]) -> tuple[float, ...]:
    """Each weight's fraction of their sum: what a rank of that shard weight holds."""
    total = sum(weights)
    return tuple(w / total for w in weights)


def read_json(path: str | os.PathLike, what: str, error: type[Exception], hint: str = "") -> Any:
    """The parsed JSON file at ``path``; ``error`` naming ``what`` it is if it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist{hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{what} {path} is not valid JSON: {e}") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a text file via a temporary file and rename, so readers never see half a file.

    The file gets the mode ``open(path, "w")`` would give it: an existing file keeps its mode, a
    new one gets 0o666 minus the umask (``tempfile.mkstemp`` would make every file 0o600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        keep_mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        keep_mode = None
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the kernel applies the umask
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"could not create a temporary file next to {path}")
    try:
        with os.fdopen(fd, "w") as f:
            if keep_mode is not None and hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), keep_mode)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
