"""Capacity search: the largest micro-batch ``mbs`` that one rank can train, found without any
collective (on a ZeRO runtime over a ``LocalCommunicator``; see ``local_comm``).

Algorithm 1 of the paper, made exact and bounded:

1. Trial step at batch 1 (which also fixes the optimizer state). Its memory before and after
   the forward gives the bytes per sample and the estimate U = (capacity - before) / per-sample.
2. Exponential growth 2, 4, 8, ... until an OOM, never jumping over U: when the next power of
   two would pass U, try U itself, and when U fits try U + 1 (if that fits too, the estimate
   was low and growth goes on over powers of two).
3. Binary search between the last batch that fitted and the first that did not.

Every out-of-memory error is caught, the failed step's memory is released, and the search goes
on; ``OomEvent`` records the memory in use before the trial and after the release (they must be
equal). Trial steps: with 2^k <= mbs < 2^(k+1), at most 1 (batch 1) + k (powers of two) + 2 (U,
U + 1) + 1 (the failing power) + k (bisection of a bracket of width <= 2^k) = 2k + 4
<= 2 log2(mbs) + 4; about log2(mbs) + 3 when the estimate is right.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from poplar.profiler.capacity_model import PeakModel, guided_mbs, peak_model
from poplar.profiler.devices import Device, to_device
from poplar.zero.failures import is_oom
from poplar.profiler.local_comm import search_plan
from poplar.comm import DistributedError
from poplar.zero.runtime import ZeroRuntime
from poplar.zero.runtime import PlanCheck

DEFAULT_MAX_BATCH = 4096


def trial_budget(mbs: int) -> int:
    """The most trial steps a search that ends at ``mbs`` may take: 2 log2(mbs) + 4."""
    return int(math.floor(2 * math.log2(max(mbs, 1)) + 4))


def search_mbs(trial: Callable[[int], bool], estimate: int | None, max_batch: int = DEFAULT_MAX_BATCH) -> int:
    """Largest batch for which ``trial`` holds, given that ``trial(1)`` held (already run) and that
    trial is monotone (fits up to mbs, fails beyond). ``estimate``: Algorithm 1's bound, or None."""
    lo, hi = 1, None  # lo fits; hi, once known, does not
    bound = max(1, estimate) if estimate is not None else None
    step = 2  # the next power of two above lo
    while hi is None and lo < max_batch:
        if bound is not None and lo < bound < step:
            batch = bound  # do not jump over the estimate
        elif bound is not None and lo == bound:
            batch, bound = bound + 1, None  # the estimate fitted: is it the largest?
        else:
            batch = step
        batch = min(batch, max_batch)
        if trial(batch):
            lo = batch
            while step <= lo:
                step *= 2
        else:
            hi = batch
    if hi is None:
        return lo  # everything up to max_batch fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trial(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class OomEvent:
    batch: int
    message: str
    memory_before: int  # device memory in use before the trial step
    memory_after: int  # ... after the failed step was released
    gathered_before: int  # stage 3: gathered parameter bytes, before / after
    gathered_after: int
    at: dict[str, Any] | None = None  # a virtual device's view at the failure: where, saved, gathered bytes
    rebuilt: bool = False  # the runtime did not clean up after the OOM and was rebuilt


@dataclass
class CapacityResult:
    stage: int
    capacity_bytes: int
    mbs: int  # 0: batch 1 does not fit
    trial_steps: int
    trials: list[tuple[int, bool]] = field(default_factory=list)  # (batch, fitted) in order
    estimate: int | None = None  # Algorithm 1's bound from batch 1
    base_bytes: int | None = None  # memory in use before a forward
    bytes_per_sample: float | None = None
    state_bytes: int | None = None  # model states (params, grads, optimizer, buffers)
    shard_bytes: int | None = None  # this rank's share of the sharded state (after a step that fitted)
    peaks: dict[int, int] = field(default_factory=dict)  # batch -> peak bytes of a step that fitted
    oom_events: list[OomEvent] = field(default_factory=list)
    capped: bool = False  # every batch up to max_batch fitted
    reason: str = ""  # why batch 1 does not fit
    overflowing_trials: int = 0  # trial steps skipped for an fp16 overflow (the loss scale backed off)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class NoRoomToBuild(Exception):
    """The runtime could not be built for lack of device memory (its message: the device's own
    words): no batch fits at its shard weights (see [Note: no room to build] in profile_run)."""


class CapacitySearch:
    """Runs trial steps of ``runtime`` (a ``ZeroRuntime`` on a LocalCommunicator) with ``device``
    attached.

    ``rebuild``, if given, replaces a broken runtime: when an OOM escapes the runtime's own error
    handling (the exception that leaves ``train_step`` is not the runtime's agreed
    ``DistributedError``) or the memory does not come back to its level before the trial, the
    runtime's state cannot be trusted; ``rebuild()`` must detach the device, drop the runtime and
    return a fresh one with the device attached, or raise ``NoRoomToBuild``, which leaves the
    search. The event is recorded (``OomEvent.rebuilt``). Without ``rebuild`` such a failure is an
    error.
    """

    def __init__(self, runtime: ZeroRuntime, device: Device, sample_fn: Callable[[int], Any], loss_fn: Callable,
                 stage: int, max_batch: int = DEFAULT_MAX_BATCH, log: Callable[[str], None] | None = None,
                 rebuild: Callable[[], ZeroRuntime] | None = None) -> None:
        self.runtime, self.device, self.sample_fn, self.loss_fn = runtime, device, sample_fn, loss_fn
        self.shard_weights = runtime.shard_weights  # the trials keep the runtime's shards
        self.offloads = runtime.plan.offloads  # and its optimizer placements
        self.stage, self.max_batch, self.log, self.rebuild = stage, max_batch, log or (lambda s: None), rebuild
        self.result = CapacityResult(stage=stage, capacity_bytes=device.capacity_bytes, mbs=0, trial_steps=0)
        # a real allocator also counts earlier runtimes' uncollected garbage: it would shrink the
        # capacity found and, collected by the first recovery, read as memory the runtime lost
        device.release()

    def trial(self, batch: int) -> bool:
        """One real training step of ``batch`` samples; False on out-of-memory (then released)."""
        runtime, device = self.runtime, self.device
        runtime.set_plan(search_plan(runtime.world_size, runtime.rank, batch, self.shard_weights, self.offloads),
                         PlanCheck.LOCAL)
        data = to_device(self.sample_fn(batch), device.torch_device)
        device.last_failure = None
        before, gathered = device.memory_in_use(), runtime.stage.gathered_bytes
        self.result.trial_steps += 1
        message, handled = "", True
        try:
            runtime.train_step(data, self.loss_fn)
            ok = True
        except Exception as e:  # noqa: BLE001 - only an OOM is an answer; anything else is re-raised
            if not is_oom(e):
                raise
            ok, message = False, oom_message(e)
            handled = isinstance(e, DistributedError)  # the runtime's agreed report, its clean-up done
            if not handled:
                message += f" (then, in the runtime's clean-up: {type(e).__name__}: {str(e)[:200]})"
            e = None  # noqa: F841 - drop the failed step's frames (and the activations they hold)
        del runtime  # a rebuild below must find the broken runtime held by nothing else (its memory)
        self.result.trials.append((batch, ok))
        if ok:
            self._record_fit(batch)
        else:
            self._recover(OomEvent(batch, message, before, 0, gathered, 0), handled)
        del data
        self.log(f"  trial batch {batch}: {'fits' if ok else 'out of memory'}")
        return ok

    def steady_fits(self, batch: int) -> bool:
        """``batch`` as the runtime's first step and, where the device sees only its allocator's
        total (``static_bytes`` None: a real GPU), once more: state built lazily in the first
        step (the optimizer's, allocated at its first ``step``) is absent from that step's
        backward, so only the second step holds what every later one holds. A device that counts
        the model states itself counts them as after the first step already."""
        if not self.trial(batch):
            return False
        return self.device.static_bytes() is not None or self.trial(batch)

    def _record_fit(self, batch: int) -> None:
        """The peak of a step that fitted; at batch 1 also Algorithm 1's base and per-sample bytes."""
        res, step = self.result, self.device.last_step
        res.shard_bytes = self.runtime.stage.sharded_bytes()  # the optimizer state exists after a step
        if step is not None and step.batch == batch:
            res.peaks[batch] = step.peak
            if batch == 1:
                res.base_bytes = step.before_forward
                res.bytes_per_sample = float(max(step.after_forward - step.before_forward, 1))

    def _recover(self, event: OomEvent, handled: bool) -> None:
        """Release the failed step's memory and record ``event`` (memory before the trial set);
        rebuild the runtime if it did not clean up after itself."""
        device = self.device
        device.abort_step()
        device.release()
        event.memory_after, event.gathered_after = device.memory_in_use(), self.runtime.stage.gathered_bytes
        event.at = dict(device.last_failure) if device.last_failure else None
        if not handled or event.memory_after != event.memory_before or event.gathered_after != event.gathered_before:
            if self.rebuild is None:
                raise RuntimeError(f"the runtime did not recover from an out-of-memory error at batch {event.batch}: "
                                   f"{event.message}; memory {event.memory_before} -> {event.memory_after} bytes, "
                                   f"gathered {event.gathered_before} -> {event.gathered_after}")
            # [Note: one runtime at a time] the broken runtime is dropped before its replacement
            # is built: a real allocator frees its memory only once nothing holds it, and the
            # two together need twice the state the card is being measured for
            del self.runtime
            self.runtime = self.rebuild()  # NoRoomToBuild ends the search
            event.rebuilt = True
            event.memory_after = device.memory_in_use()
            event.gathered_after = self.runtime.stage.gathered_bytes
        self.result.oom_events.append(event)
        if event.batch == 1:
            self.result.reason = event.message

    def run_guided(self, reference: "CapacityResult | None" = None) -> CapacityResult:
        """The search guided by a memory model (``capacity_model``): a line through this
        configuration's batch-1 peak, with the slope of ``reference`` (the search of another
        configuration of the same model with the same activation memory: another ZeRO stage)
        or, without one, batch 1's own bytes above the base. The batch-1 step always runs
        first: a runtime's first step can hold less than the later ones (lazily built state)."""
        res = self.result
        if not self.steady_fits(1):
            return res
        model = None
        if 1 in res.peaks and reference is not None and reference.mbs >= 1 and 1 in reference.peaks:
            model = peak_model(reference.peaks, reference.bytes_per_sample)
            model = model.shifted(res.peaks[1] - reference.peaks[1]) if model is not None else None
        elif 1 in res.peaks and res.base_bytes is not None:
            model = PeakModel(1, float(res.peaks[1]), float(max(res.peaks[1] - res.base_bytes, 1)))
        guide = {"model": model}

        def trial(batch: int) -> bool:
            ok = self.trial(batch)
            m, fail = guide["model"], self.device.last_failure
            if m is not None:
                if ok and batch in res.peaks:
                    own = peak_model(res.peaks)
                    guide["model"] = own if own is not None and batch == max(res.peaks) else m.moved(batch,
                                                                                                   res.peaks[batch])
                elif not ok and fail and fail.get("usage"):
                    guide["model"] = m.moved(batch, fail["usage"])
                else:
                    guide["model"] = None
            return ok

        def guess() -> int | None:
            m = guide["model"]
            return None if m is None else m.largest(res.capacity_bytes)
        res.estimate = guess()
        res.mbs = guided_mbs(trial, guess, self.max_batch, lo=1)
        res.capped = res.mbs >= self.max_batch
        res.bytes_per_sample = _slope(res.peaks) or res.bytes_per_sample or (
            reference.bytes_per_sample if reference is not None else None)
        return res

    def run(self) -> CapacityResult:
        res = self.result
        if not self.steady_fits(1):
            return res
        if res.base_bytes is not None and res.bytes_per_sample:
            res.estimate = max(1, int((res.capacity_bytes - res.base_bytes) // res.bytes_per_sample))
        res.mbs = search_mbs(self.trial, res.estimate, self.max_batch)
        res.capped = res.mbs >= self.max_batch
        res.bytes_per_sample = _slope(res.peaks) or res.bytes_per_sample
        return res


def _slope(peaks: dict[int, int]) -> float | None:
    """Least-squares bytes per sample of the peaks of the steps that fitted."""
    if len(peaks) < 2:
        return None
    xs, ys = list(peaks), list(peaks.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else None


def oom_message(e: BaseException) -> str:
    """The first line of the out-of-memory error in ``e``'s chain (the device's own words)."""
    chain: BaseException | None = e
    while chain is not None:
        if is_oom(chain) and not is_oom(chain.__cause__ or chain.__context__):
            return f"{type(chain).__name__}: {chain}".splitlines()[0][:400]
        chain = chain.__cause__ or chain.__context__
    return traceback.format_exception_only(type(e), e)[-1].strip()[:400]
