"""Stage escalation: the lowest ZeRO stage, from the one asked for, at which batch 1 fits on
every rank (docs/design.md §4).

At each stage every rank runs its capacity search with no collective at all; any error in it,
OOM or not, is caught and carried to the agreement, so no rank can leave the others waiting.
The agreement is one ``all_gather_object`` of every rank's result, outside any training step,
after which every rank takes the same decision: go on at this stage, move to the next one if
batch 1 fits nowhere on some rank (and escalation is on), or fail with the same error
everywhere.

Offload escalation (``OffloadEscalation.SHORT_RANKS``): where batch 1 does not fit some ranks
even at ZeRO-3, those ranks search ZeRO-3 again with their optimizer state in host memory
(``Offload.OPTIMIZER``), decided from the agreed verdicts, so the same on every rank. A rank's
placement changes only its own memory, so a rank still short with its optimizer offloaded ends
the escalation: offloading the other ranks too could not make it fit. ``escalate_offload`` is
that loop, for one configuration (``find_fitting_stage``) and for each of auto mode's
candidates at their highest stage (``candidate_run.Candidates``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, TypeVar

from poplar.comm import Communicator
from poplar.profiler.capacity import CapacityResult
from poplar.profiler.devices import Device
from poplar.types.plans import Offload
from poplar.types.profiles import Escalation, ProfileError

MB = 1e6
Log = Callable[[str], None]
Placements = tuple[Offload, ...] | None  # where each rank's optimizer lives (None: on every device)
Found = TypeVar("Found")  # what an agreed capacity search at some placements found


class OffloadEscalation(str, Enum):
    """Whether the profiler may offload optimizers to host memory where batch 1 fits no stage."""

    NEVER = "never"  # the optimizers stay where the options put them; no fit is an error naming offload
    SHORT_RANKS = "short_ranks"  # at ZeRO-3, the ranks batch 1 does not fit offload their optimizer


def format_bytes(n: float | None) -> str:
    return "?" if n is None else f"{n / MB:.3f} MB"


@dataclass
class StageCapacity:
    """The stage every rank fits batch 1 at, and what the capacity searches found there."""

    stage: int
    result: CapacityResult  # this rank's search at ``stage``
    mbs: list[int]  # every rank's largest micro-batch at ``stage``
    escalations: list[Escalation] = field(default_factory=list)  # one per configuration left behind
    trials_per_stage: dict[str, int] = field(default_factory=dict)  # this rank's trial steps, per stage
    offloads: Placements = None  # every rank's optimizer placement at ``stage`` (None: on its device)


def next_offloads(current: Placements, no_fit: list[int], world_size: int) -> Placements:
    """The placements to search again with: ``current`` plus the ranks in ``no_fit`` offloaded;
    None when those already offload (nothing offload can do for them)."""
    now = current or (Offload.NONE,) * world_size
    wanted = tuple(Offload.OPTIMIZER if r in no_fit else o for r, o in enumerate(now))
    return None if wanted == now else wanted


def escalate_offload(found: Found, offloads: Placements, *, short: Callable[[Found], list[int]],
                     search: Callable[[Placements], Found], world_size: int,
                     announce: Callable[[Found, list[int], Placements], None]) -> tuple[Found, Placements]:
    """Offload escalation (module doc): while ``short(found)`` names ranks batch 1 does not fit,
    those ranks' optimizers offloaded (``next_offloads``), ``announce(found, short ranks, new
    placements)`` and ``search(new placements)`` again (every rank, agreed). Ends where every
    rank fits or the short ranks already offload; returns the last search and its placements.
    Decided from agreed data only, so every rank runs the same searches."""
    while no_fit := short(found):
        more = next_offloads(offloads, no_fit, world_size)
        if more is None:
            break
        announce(found, no_fit, more)
        offloads, found = more, search(more)
    return found, offloads


def find_fitting_stage(search: Callable[[int, Placements], CapacityResult], comm: Communicator, device: Device, *,
                       stage: int, escalate: bool, model_size: tuple[int, int], lead: Log, mine: Log,
                       offloads: Placements = None,
                       offload_escalation: OffloadEscalation = OffloadEscalation.NEVER) -> StageCapacity:
    """Search capacity at ``stage`` (``search(stage, offloads)``: this rank's search with these
    optimizer placements, no collectives) and, while batch 1 does not fit on some rank, at the
    next stages; at ZeRO-3, with ``OffloadEscalation.SHORT_RANKS``, with the short ranks'
    optimizers offloaded. ``model_size`` is (parameter count, bytes) for the error; ``lead``
    logs for the cluster, ``mine`` for this rank."""
    escalations: list[Escalation] = []
    trials_per_stage: dict[str, int] = {}
    refused: ProfileError | None = None  # the stage asked for did not fit and escalation is off

    def agreed(at: Placements) -> tuple[CapacityResult | None, list[dict[str, Any]]]:
        result, error = _search_at(search, stage, at, mine)
        if result is not None:
            key = str(stage) if not _offloading(at) else f"{stage}+offload"
            trials_per_stage[key] = trials_per_stage.get(key, 0) + result.trial_steps
        return result, _agree_on_capacity(comm, device, result, error)

    def short(found: tuple[CapacityResult | None, list[dict[str, Any]]]) -> list[int]:
        return [r for r, v in enumerate(found[1]) if v["mbs"] < 1]

    def announce(found: tuple[CapacityResult | None, list[dict[str, Any]]], no_fit: list[int],
                 more: Placements) -> None:
        said = found[1]
        lead(f"batch 1 does not fit at ZeRO-3 on {_names(said, no_fit)}; searching ZeRO-3 again with their "
             "optimizer offloaded to host memory")
        escalations.append(Escalation(stage, stage, no_fit, {str(r): said[r]["reason"] for r in no_fit},
                                      offload=[o.value for o in more]))

    while True:
        result, verdicts = agreed(offloads)
        if stage == 3 and refused is None and offload_escalation is OffloadEscalation.SHORT_RANKS:
            (result, verdicts), offloads = escalate_offload((result, verdicts), offloads, short=short, search=agreed,
                                                            world_size=comm.world_size, announce=announce)
        no_fit = short((result, verdicts))
        if not no_fit and refused is not None:  # the stage that would fit, named in the error
            raise ProfileError(f"{refused} ZeRO-{stage} fits batch 1 on every rank: give that stage, or \"auto\" "
                               "to let auto mode choose")
        if not no_fit:
            assert result is not None
            return StageCapacity(stage, result, [v["mbs"] for v in verdicts], escalations, trials_per_stage,
                                 offloads if _offloading(offloads) else None)
        names = _names(verdicts, no_fit)
        if stage == 3:
            raise refused or _does_not_fit(stage, verdicts, no_fit, names, model_size, offloads, offload_escalation)
        if not escalate:
            refused = refused or _does_not_fit(stage, verdicts, no_fit, names, model_size, offloads,
                                               offload_escalation)
            stage += 1  # searched only to name the stage that would fit
            continue
        lead(f"batch 1 does not fit at ZeRO-{stage} on {names}; moving to ZeRO-{stage + 1}")
        escalations.append(Escalation(stage, stage + 1, no_fit, {str(r): verdicts[r]["reason"] for r in no_fit}))
        stage += 1


def _names(verdicts: list[dict[str, Any]], ranks: list[int]) -> str:
    return ", ".join(f"rank {r} ({verdicts[r]['device']}, {format_bytes(verdicts[r]['capacity'])})" for r in ranks)


def _offloading(offloads: Placements) -> bool:
    return offloads is not None and any(o is not Offload.NONE for o in offloads)


def _search_at(search: Callable[[int, Placements], CapacityResult], stage: int, offloads: Placements,
               mine: Log) -> tuple[CapacityResult | None, str | None]:
    """This rank's search at ``stage``, or the error it raised (reported at the agreement)."""
    where = f"ZeRO-{stage}" + (" with offload" if _offloading(offloads) else "")
    try:
        result = search(stage, offloads)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        return None, f"capacity search at {where} failed: {type(e).__name__}: {e}"
    if result.mbs:
        mine(f"{where}: mbs {result.mbs}{' (capped)' if result.capped else ''} after "
             f"{result.trial_steps} trial steps (estimate {result.estimate}, "
             f"{len(result.oom_events)} OOMs recovered)")
    else:
        mine(f"{where}: batch 1 does not fit ({result.reason})")
    return result, None


def _agree_on_capacity(comm: Communicator, device: Device, result: CapacityResult | None,
                       error: str | None) -> list[dict[str, Any]]:
    """Every rank's verdict; a failed search on any rank is a ``ProfileError`` on every rank."""
    return comm.agree(error, "profiling", {"mbs": result.mbs if result else 0, "device": device.name,
                                           "capacity": device.capacity_bytes, "reason": result.reason if result else "",
                                           "state_bytes": result.state_bytes if result else None},
                      error_type=ProfileError)


def _does_not_fit(stage: int, verdicts: list[dict[str, Any]], no_fit: list[int], names: str,
                  model_size: tuple[int, int], offloads: Placements,
                  offload_escalation: OffloadEscalation) -> ProfileError:
    param_count, param_bytes = model_size
    offloaded = [r for r in no_fit if _offloading(offloads) and offloads[r] is not Offload.NONE]  # type: ignore[index]
    if offloaded:
        hint_offload = f" (ranks {offloaded} with their optimizer already offloaded to host memory)"
        fix = "Use devices with more memory, a smaller model, activation checkpointing, or leave those ranks out."
    else:
        hint_offload = ""
        fix = ("Use devices with more memory, a smaller model, or leave those ranks out"
               + ("; or offload those ranks' optimizer to host memory (ProfileOptions(offload_escalation="
                  "OffloadEscalation.SHORT_RANKS), in auto mode AutoOptions(offload=\"auto\"))."
                  if offload_escalation is OffloadEscalation.NEVER else "."))
    smallest = min(range(len(verdicts)), key=lambda r: verdicts[r]["capacity"])
    hint = "even at ZeRO-3" if stage == 3 else f"at ZeRO-{stage}, the stage given,"
    first = verdicts[no_fit[0]]
    states = (f"; its model states at ZeRO-{stage} alone are {format_bytes(first['state_bytes'])}"
              if first["state_bytes"] else "")
    return ProfileError(
        f"the model ({param_count:,} parameters, {format_bytes(param_bytes)} of weights) does not fit batch 1 "
        f"{hint} on {names}{hint_offload}{states}. Smallest capacity: {format_bytes(verdicts[smallest]['capacity'])} on "
        f"rank {smallest} ({verdicts[smallest]['device']}). First failure: {first['reason']}. " + fix)
