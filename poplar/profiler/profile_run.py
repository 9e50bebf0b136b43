"""The profiler's run, on every rank: capacity search, stage escalation, lock-step timing, and the
collectives' bandwidth; the result is one ``Profile``, the same on every rank.

Shape (docs/design.md §4, "deadlock trap"):

1. Capacity search, per rank, with no collective at all (an engine over a LocalCommunicator has
   the real engine's memory at world size N). Any error in it, OOM or not, is caught and
   carried to the next step, so no rank can leave the others waiting.
2. Agreement: one ``all_gather_object`` of every rank's result, outside any training step.
   Every rank then takes the same decision: escalate to the next ZeRO stage if batch 1 fits
   nowhere on some rank, fail with the same error everywhere, or go on.
3. Timing in lock-step rounds at sizes known to fit (``timing``), with the real engine and its
   instrumented collectives. A virtual device only records overflows here (never raises
   mid-collective); the record is agreed on afterwards.
4. Collective bandwidth, then the profile is assembled from every rank's part.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from poplar.zero.runtime import ZeroRuntime
from poplar.profiler.capacity import DEFAULT_MAX_BATCH, CapacityResult, CapacitySearch, trial_budget
from poplar.profiler.devices import Device, to_device
from poplar.profiler.local_comm import local_engine, round_plan
from poplar.profiler.timing import exposed_costs, measure_comm, run_rounds, summarize, timing_batches
from poplar.types.profiles import Profile, ProfileError, RankProfile
from poplar.comm import Communicator, DistributedError

MB = 1e6


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """fp32 AdamW: 8 bytes of state per parameter, the K of docs/design.md §3."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


@dataclass
class ProfileOptions:
    zero_stage: int = 0
    escalate: bool = True  # move to the next ZeRO stage when batch 1 does not fit on some rank
    max_batch: int = DEFAULT_MAX_BATCH  # the search stops here even if more would fit
    repeats: int = 3  # measurements per timed batch size (the smallest is kept)
    max_extra_passes: int = 3  # re-measure points whose minimum no second measurement confirms
    tolerance: float = 0.02  # ... within this relative difference
    bucket_size_mb: float = 25.0
    wrap_policy: Any = None
    measure_comm: bool = True
    model_name: str = ""
    progress: bool = True  # a progress bar of the timing rounds on rank 0 (on a terminal)
    meta: dict[str, Any] = field(default_factory=dict)


def _log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _agree(comm: Communicator, error: str | None, what: str) -> None:
    """An agreement point (a collective outside any step): every rank raises the same
    ``ProfileError`` if any rank has an error."""
    comm.agree(error, what, error_type=ProfileError)


def model_size(model: nn.Module) -> tuple[int, int]:
    """(parameter count, bytes of one copy of the parameters), tied weights once."""
    params = list(model.parameters())  # unique objects
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def _fmt_bytes(n: float | None) -> str:
    return "?" if n is None else f"{n / MB:.3f} MB"


def engine_collectives(engine: ZeroRuntime) -> tuple[list[list], list[list]]:
    """The collectives of the engine's last iteration (a timing round: one micro-step per rank),
    as ``[op, bytes]``: those inside its micro-step, and those at the iteration's end."""
    last = engine.iteration - 1
    records = [r for r in engine.comm_ledger.records if r.iteration == last and r.op != "all_gather_object"]
    micro = [[r.op, r.bytes] for r in records if r.phase in ("forward", "backward") and r.micro_step == 0]
    end = [[r.op, r.bytes] for r in records if r.phase == "step"]
    return micro, end


def search_capacity(model_fn: Callable[[], nn.Module], optimizer_fn: Callable, loss_fn: Callable,
                    sample_fn: Callable[[int], Any], device: Device, *, world_size: int, rank: int, stage: int,
                    options: ProfileOptions, log: Callable[[str], None]) -> CapacityResult:
    """This rank's capacity search at ``stage``, without collectives."""
    stack = contextlib.ExitStack()
    holder: dict[str, Any] = {}

    def build() -> Any:
        stack.close()  # detach from the previous engine, if any
        holder.clear()
        device.release()
        model = model_fn().to(device.torch_device)
        engine = local_engine(model, optimizer_fn(model), world_size=world_size, rank=rank, zero_stage=stage,
                              device=device.torch_device, bucket_size_mb=options.bucket_size_mb,
                              wrap_policy=options.wrap_policy)
        holder["engine"] = engine
        stack.enter_context(device.attach(engine))
        return engine

    pad = getattr(device, "pad", None)
    if pad is not None:
        device.pad = False  # the search's steps are not timed: run them at CPU speed
    try:
        search = CapacitySearch(build(), device, sample_fn, loss_fn, stage, options.max_batch, log, rebuild=build)
        result = search.run()
        if getattr(device, "static_bytes", None):
            result.state_bytes = device.static_bytes()
        return result
    finally:
        stack.close()
        holder.clear()
        if pad is not None:
            device.pad = pad
        device.release()


def profile_rank(model_fn: Callable[[], nn.Module], loss_fn: Callable, sample_fn: Callable[[int], Any],
                 device: Device, *, optimizer_fn: Callable | None = None, options: ProfileOptions | None = None,
                 log: Callable[[str], None] | None = None, process_group: Any = None) -> Profile:
    """Profile this rank; every rank of the process group must call it with the same arguments
    (but its own ``device``). Returns the whole cluster's profile, the same on every rank."""
    options = options or ProfileOptions()
    optimizer_fn = optimizer_fn or default_optimizer
    comm = Communicator(process_group, device.torch_device)
    rank, world = comm.rank, comm.world_size
    say = log or _log_to_stderr
    lead = (lambda m: say(f"[poplar profile] {m}")) if rank == 0 else (lambda m: None)
    mine = lambda m: say(f"[poplar profile] rank {rank} ({device.name}): {m}")  # noqa: E731
    if options.zero_stage not in (0, 1, 2, 3):
        raise ProfileError(f"zero_stage must be 0, 1, 2 or 3, got {options.zero_stage!r}")
    t_start = time.perf_counter()
    late_before = getattr(device, "late_steps", 0)

    error: str | None = None
    param_count = param_bytes = 0
    try:
        probe = model_fn()
        param_count, param_bytes = model_size(probe)
        del probe
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        error = f"model_fn() failed: {type(e).__name__}: {e}"
    _agree(comm, error, "profile set-up")

    stage = options.zero_stage
    escalations: list[dict[str, Any]] = []
    trials_per_stage: dict[str, int] = {}
    lead(f"{world} ranks, model {options.model_name or 'model'} with {param_count:,} parameters "
         f"({_fmt_bytes(param_bytes)}), ZeRO-{stage}")
    while True:
        # ---- 1. capacity search, no collectives; every error is carried to the agreement
        error = None
        result: CapacityResult | None = None
        try:
            result = search_capacity(model_fn, optimizer_fn, loss_fn, sample_fn, device, world_size=world,
                                     rank=rank, stage=stage, options=options, log=lambda m: None)
            trials_per_stage[str(stage)] = result.trial_steps
            if result.mbs:
                mine(f"ZeRO-{stage}: mbs {result.mbs}{' (capped)' if result.capped else ''} after "
                     f"{result.trial_steps} trial steps (estimate {result.estimate}, "
                     f"{len(result.oom_events)} OOMs recovered)")
            else:
                mine(f"ZeRO-{stage}: batch 1 does not fit ({result.reason})")
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"capacity search at ZeRO-{stage} failed: {type(e).__name__}: {e}"
        # ---- 2. agreement
        verdicts = comm.all_gather_object(
            {"error": error, "mbs": result.mbs if result else 0, "device": device.name,
             "capacity": device.capacity_bytes, "reason": result.reason if result else "",
             "state_bytes": result.state_bytes if result else None}, tag="profile:capacity")
        failed = [(r, v["error"]) for r, v in enumerate(verdicts) if v["error"]]
        if failed:
            raise ProfileError("profiling failed:\n" + "\n".join(f"  rank {r}: {m}" for r, m in failed))
        no_fit = [r for r, v in enumerate(verdicts) if v["mbs"] < 1]
        if not no_fit:
            break
        names = ", ".join(f"rank {r} ({verdicts[r]['device']}, {_fmt_bytes(verdicts[r]['capacity'])})" for r in no_fit)
        if stage < 3 and options.escalate:
            lead(f"batch 1 does not fit at ZeRO-{stage} on {names}; moving to ZeRO-{stage + 1}")
            escalations.append({"from": stage, "to": stage + 1, "ranks": no_fit,
                                "reasons": {str(r): verdicts[r]["reason"] for r in no_fit}})
            stage += 1
            continue
        smallest = min(range(world), key=lambda r: verdicts[r]["capacity"])
        hint = "even at ZeRO-3" if stage == 3 else f"at ZeRO-{stage} (escalation is off)"
        first = verdicts[no_fit[0]]
        states = (f"; its model states at ZeRO-{stage} alone are {_fmt_bytes(first['state_bytes'])}"
                  if first["state_bytes"] else "")
        raise ProfileError(
            f"the model ({param_count:,} parameters, {_fmt_bytes(param_bytes)} of weights) does not fit batch 1 "
            f"{hint} on {names}{states}. Smallest capacity: {_fmt_bytes(verdicts[smallest]['capacity'])} on "
            f"rank {smallest} ({verdicts[smallest]['device']}). First failure: {first['reason']}. "
            "Use devices with more memory, a smaller model, or leave those ranks out.")
    assert result is not None and verdicts is not None
    phases = {"capacity_s": time.perf_counter() - t_start}
    mbs = [v["mbs"] for v in verdicts]
    lead(f"ZeRO-{stage}: mbs per rank {mbs}")

    # ---- 3. lock-step timing with the real engine and collectives
    per_rank = [timing_batches(m) for m in mbs]
    first_round = [max(b) for b in per_rank]
    error, batches = None, {}
    try:
        batches = {b: to_device(sample_fn(b), device.torch_device) for b in sorted(set(per_rank[rank]))}
        model = model_fn().to(device.torch_device)
        optimizer = optimizer_fn(model)
    except Exception as e:  # noqa: BLE001
        error = f"timing set-up failed: {type(e).__name__}: {e}"
    _agree(comm, error, "profile timing set-up")
    engine = ZeroRuntime(model, optimizer, zero_stage=stage, plan=round_plan(first_round),
                          process_group=process_group, bucket_size_mb=options.bucket_size_mb,
                          wrap_policy=options.wrap_policy)
    raise_oom = getattr(device, "raise_oom", None)
    if raise_oom is not None:
        device.raise_oom = False  # record, never raise inside a lock-step collective
        device.overflows.clear()
    try:
        with device.attach(engine):
            measured, rounds, facts = run_rounds(engine, device, per_rank, batches, loss_fn, comm, repeats=options.repeats,
                                          max_extra_passes=options.max_extra_passes, tolerance=options.tolerance,
                                          log=lead, progress=options.progress and rank == 0)
    except DistributedError as e:  # the engine reported a failed round on every rank
        raise ProfileError(f"a lock-step timing round failed: {e}") from None
    finally:
        if raise_oom is not None:
            device.raise_oom = raise_oom
    overflow = getattr(device, "overflows", [])
    error = None
    if overflow:
        error = ("a timing round exceeded the device memory although the capacity search found that it fits: "
                 + overflow[0]["message"])
    _agree(comm, error, "profile timing memory")
    points = summarize(measured)
    comm_seconds = engine.comm_ledger.seconds()
    calls = engine_collectives(engine)
    costs = exposed_costs(comm.all_gather_object(facts, tag="profile:costs"))
    del engine, model, optimizer, batches
    device.release()
    phases["timing_s"] = time.perf_counter() - t_start - sum(phases.values())

    # ---- 4. collectives, then the profile
    comm_profile = measure_comm(comm) if options.measure_comm else None
    phases["comm_s"] = time.perf_counter() - t_start - sum(phases.values())
    rp = RankProfile(rank=rank, device_type=device.device_type, mbs=result.mbs, points=points,
                     device_name=device.name, capacity_bytes=int(device.capacity_bytes),
                     base_bytes=result.base_bytes, bytes_per_sample=result.bytes_per_sample,
                     nominal_tflops=device.nominal_tflops, trial_steps=result.trial_steps)
    extra = {"estimate": result.estimate, "trials": result.trials, "trial_budget": trial_budget(result.mbs),
             "trial_steps_per_stage": trials_per_stage,
             "state_bytes": result.state_bytes, "capped": result.capped,
             "oom_events": [vars(e) for e in result.oom_events], "device": device.describe(),
             "late_steps": getattr(device, "late_steps", 0) - late_before, "timing_comm_s": comm_seconds,
             "phase_seconds": {k: round(v, 3) for k, v in phases.items()}}
    parts = comm.all_gather_object((rp, extra), tag="profile:assemble")
    if comm_profile is None:
        from poplar.types.profiles import CommProfile
        comm_profile = CommProfile(bandwidth_bytes_per_s=1e15, backend=comm.backend)
    comm_profile.collectives_stage = stage
    comm_profile.micro_step, comm_profile.iteration = calls
    for key, value in costs.items():
        setattr(comm_profile, key, value)
    meta = dict(options.meta)
    meta.update({"requested_stage": options.zero_stage, "escalations": escalations,
                 "timing_rounds": rounds, "repeats": options.repeats,
                 "timing_estimator": "min over repeats, confirmed by a 2nd measurement within "
                                     f"{options.tolerance:.0%} (up to {options.max_extra_passes} extra passes)",
                 "comm_fit": "seconds = latency_s + bus volume / bandwidth (ring: 2(N-1)/N V all-reduce, "
                             "(N-1)/N V reduce-scatter/all-gather)",
                 "ranks": {str(r): e for r, (_, e) in enumerate(parts)},
                 "seconds": round(time.perf_counter() - t_start, 3)})
    profile = Profile(zero_stage=stage, world_size=world, param_count=param_count, param_bytes=param_bytes,
                      ranks=[p for p, _ in parts], comm=comm_profile, model_name=options.model_name, meta=meta)
    lead(f"done in {meta['seconds']:.1f} s")
    return profile
