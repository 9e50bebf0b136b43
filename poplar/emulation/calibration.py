"""Calibration of an emulated cluster: the memory and time scales that make preset GPUs fit a
CPU-sized model on this machine (docs/design.md §4.5).

- ``memory_scale`` multiplies every preset's memory. ``"auto"`` measures the model (model
  states at the requested stage and bytes per sample, on a LocalCommunicator runtime of the
  cluster's world size, one process) and picks the scale at which the cluster's smallest-memory
  device fits a batch of about ``target_min_mbs`` (8).
- ``time_scale`` multiplies every preset's step time. A virtual device pads its real CPU
  compute up to its curve, which only works while the real compute stays below the curve: a
  micro-step whose real compute overshoots it is *late*, and runs slower than the GPU it
  emulates. ``"auto"`` therefore measures the real compute **under the run's concurrency**: one
  process per rank of the cluster, all computing the same batch at the same moment (lock-step,
  a barrier before each trial), at batches 1, 2, 4, 8 and every device type's predicted mbs;
  per batch the slowest rank's median over the repeats. That is a pessimistic figure (in the
  run ranks mostly sleep, so fewer compute at once) and it already contains whatever else keeps
  the machine's cores busy at calibration time. The time scale is the smallest at which (a) the
  fastest device's batch-1 step lasts ``min_step_s`` (sleep precision) and (b) that real compute
  is at most ``margin`` (0.6) of every device's curve at every batch up to its mbs (measured
  points interpolated linearly), so a load that grows by a further ``1 / margin`` after
  calibration still leaves the devices on time.

A cluster with an emulated interconnect (``virtual_link``) is timed on a real runtime over the
job's process group, its collectives paced by that link: a run's micro-step then also does the
collectives' CPU work, and at ZeRO-3 every rank leaves each block's all-gather at the same
moment and computes the next block alongside all the others, which the trial steps of a
LocalCommunicator runtime (no collectives) do not see.

Under a mixed-precision policy both fp32 and the policy's precision are measured and the time
scale satisfies both, so fp32 and bf16/fp16 runs of one model emulate the same GPUs; the memory
scale comes from the fp32 pass (a GPU's memory does not shrink with the dtype).

Where the ranks come from: ``calibrate`` (one process, before a cluster is spawned) spawns a
short job of world-size processes for the concurrent timing (``poplar.process.launch.spawn``);
inside a running job (``emulate.emulate_cluster_together``) the job's own ranks time together
through ``time_trials`` with the job's communicator as barrier.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch

from poplar.profiler.capacity import CapacitySearch
from poplar.profiler.local_comm import local_engine
from poplar.profiler.profile_run import ProfileJob
from poplar.types.configuration import Configuration
from poplar.emulation.virtual_device import VirtualDevice
from poplar.emulation.virtual_link import LinkSpec
from poplar.emulation.virtual_network import NetworkSpec, paced_link
from poplar.types.plans import Plan, RankPlan
from poplar.zero.config import ZeroConfig
from poplar.zero.nonfinite import SkipReport
from poplar.zero.runtime import ZeroRuntime
from poplar.emulation.cluster import ClusterError, ClusterSpec
from poplar.emulation.host_memory import host_memory_guard
from poplar.types.precision import MixedPrecision, Precision, precision_of, resolve_precision
from poplar.emulation.presets import GIB, DevicePreset, get_preset
from poplar.types.profiles import ProfileError
from poplar.zero.runtime import PlanCheck

TARGET_MIN_MBS = 8
MIN_STEP_S = 0.004
MARGIN = 0.6  # real compute, every rank at once, at most this share of the emulated time
TIMING_REPEATS = 3
BASE_BATCHES = (1, 2, 4, 8)


@dataclass
class Calibration:
    memory_scale: float
    time_scale: float
    state_bytes: int  # model states at the stage, one rank
    peak_batch1: int  # peak bytes of a batch-1 step
    bytes_per_sample: float
    real_s_per_step: tuple[float, float]  # one rank alone: seconds = a + b * batch
    predicted_mbs: dict[str, int]
    precision: str = "fp32"  # the run's precision (the numbers above are measured at it)
    margin: float = MARGIN
    concurrent_s: dict[str, dict[int, float]] = field(default_factory=dict)  # precision -> batch -> s
    ranks_timed: int = 1  # processes computing at once in the concurrent timing

    def to_dict(self) -> dict[str, Any]:
        d = dict(vars(self))
        d["concurrent_s"] = {p: {str(b): s for b, s in v.items()} for p, v in self.concurrent_s.items()}
        return d

    def load(self, presets: list[DevicePreset]) -> float | None:
        """The largest share of a device's curve (at the run's precision, batches up to its
        mbs) that the concurrent real compute takes at the chosen time scale: at most ``margin``
        when the scale was calibrated; None without a concurrent timing."""
        seconds = self.concurrent_s.get(self.precision)
        if not seconds:
            return None
        at = Precision(self.precision)
        return max(interpolate(seconds, b) / (p.time_s(b, precision=at) * self.time_scale)
                   for p in presets for b in range(1, self.predicted_mbs[p.name] + 1))


@dataclass
class CalibrationPass:
    """Trial steps of batch 1, 2, 4, 8 at one precision, one process: model states, peak bytes
    and the real CPU seconds per batch (the smallest of three)."""

    precision: Precision
    state_bytes: int
    peaks: dict[int, int]
    seconds: dict[int, float]

    @property
    def bytes_per_sample(self) -> float:
        return max((self.peaks[8] - self.peaks[1]) / 7, 1.0)

    @property
    def real_s_per_step(self) -> tuple[float, float]:
        """(a, b): one rank's real compute of a step of ``n`` samples is about a + b n seconds."""
        b = max((self.seconds[8] - self.seconds[1]) / 7, 0.0)
        return max(self.seconds[1] - b, 0.0), b

    def mbs(self, preset: DevicePreset, memory_scale: float, max_batch: int) -> int:
        """The batch that ``preset`` at ``memory_scale`` is predicted to fit."""
        room = preset.capacity_bytes(memory_scale) - self.peaks[1]
        return max(1, min(max_batch, int(room // self.bytes_per_sample) + 1))


@dataclass
class TimingJob:
    """What every rank needs to time trial steps together (picklable)."""

    model_fn: Callable
    loss_fn: Callable
    sample_fn: Callable[[int], Any]
    optimizer_fn: Callable
    world: int
    zero_stage: int
    policies: list[MixedPrecision | None]
    batches: list[int]
    repeats: int = TIMING_REPEATS
    options: dict[str, Any] = field(default_factory=dict)
    link: LinkSpec | NetworkSpec | None = None  # the cluster's emulated interconnect: time on a runtime paced by it


def _zero(job: TimingJob, process_group: Any = None) -> ZeroConfig:
    # trial steps train nothing: an fp16 overflow is counted, not logged (as ``ProfileJob.zero_config``)
    return ZeroConfig(job.zero_stage, job.options.get("bucket_size_mb", 25.0), job.options.get("wrap_policy"),
                      process_group, skip_report=SkipReport.COUNT)


def _runtime(job: TimingJob, rank: int, policy: MixedPrecision | None) -> Any:
    model = job.model_fn()
    return local_engine(model, job.optimizer_fn(model), world_size=job.world, rank=rank, zero_stage=_zero(job),
                        device=torch.device("cpu"), mixed_precision=policy,
                        activation_checkpointing=job.options.get("activation_checkpointing"))


def _linked_runtime(job: TimingJob, link: Any, policy: MixedPrecision | None, probe: VirtualDevice) -> Any:
    """A runtime on the job's process group whose collectives the cluster's link paces (through
    ``probe``, on the rank's one end of the link: a new end per precision would start its count
    of collectives again on a board that has them): its trial steps pay what a run's do, the
    collectives' CPU work and every rank released from each collective at once. Every rank runs
    the same plan, so they agree."""
    model = job.model_fn()
    probe.link = link
    return ZeroRuntime(model, job.optimizer_fn(model), zero_stage=_zero(job),
                       plan=Plan([RankPlan(1, 1, 0)] * job.world), mixed_precision=policy,
                       activation_checkpointing=job.options.get("activation_checkpointing"))


def _linked_trial(runtime: Any, job: TimingJob, batch: int) -> None:
    runtime.set_plan(Plan([RankPlan(batch, 1, 0)] * job.world), PlanCheck.LOCAL)
    runtime.train_step(job.sample_fn(batch), job.loss_fn)


def measure_pass(job: TimingJob, policy: MixedPrecision | None) -> CalibrationPass:
    """One single-process pass (``CalibrationPass``) on a LocalCommunicator runtime under ``policy``."""
    runtime = _runtime(job, 0, policy)
    probe = VirtualDevice("calibration", 2 ** 62)
    peaks: dict[int, int] = {}
    seconds: dict[int, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each spawned rank runs
    try:
        with probe.attach(runtime), host_memory_guard(lambda: runtime.module, "one process's trial steps"):
            search = CapacitySearch(runtime, probe, job.sample_fn, job.loss_fn, job.zero_stage)
            for b in BASE_BATCHES * 3:  # the smallest of 3: the first includes one-off set-up
                t0 = time.perf_counter()
                if not search.trial(b):
                    raise RuntimeError("calibration step failed")
                seconds[b] = min(seconds.get(b, math.inf), time.perf_counter() - t0)
                peaks[b] = probe.last_step.peak
            state = probe.static_bytes()
    finally:
        torch.set_num_threads(threads)
    return CalibrationPass(precision_of(policy), state, peaks, seconds)


def time_trials(job: TimingJob, rank: int, barrier: Callable[[], None]) -> dict[str, dict[int, list[float]]]:
    """On every rank at once: real compute seconds (forward + backward of one micro-step, the
    quantity a virtual device pads) of trial steps at ``job.batches``, each trial started by
    every rank together (``barrier``). Per precision, per batch, the repeats' seconds. A rank
    that fails still passes every barrier the others expect before it raises, so nobody hangs."""
    out: dict[str, dict[int, list[float]]] = {}
    total = len(job.policies) * (job.repeats + 1) * len(job.batches)
    passed = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    link = paced_link(job.link, rank) if job.link is not None else None
    try:
        for policy in job.policies:
            probe = VirtualDevice("calibration", 2 ** 62)
            runtime = _runtime(job, rank, policy) if link is None else _linked_runtime(job, link, policy, probe)
            seconds: dict[int, list[float]] = {b: [] for b in job.batches}
            with probe.attach(runtime), host_memory_guard(lambda: runtime.module, f"rank {rank}'s timed trial steps"):
                search = None if job.link else CapacitySearch(runtime, probe, job.sample_fn, job.loss_fn,
                                                                      job.zero_stage)
                for rep in range(job.repeats + 1):  # the first pass warms up
                    for b in job.batches:
                        barrier()
                        passed += 1
                        if search is None:
                            _linked_trial(runtime, job, b)
                        elif not search.trial(b):
                            raise RuntimeError(f"calibration step of batch {b} ran out of memory")
                        if rep > 0:
                            seconds[b].append(runtime.last_stats.compute_s)
            out[str(precision_of(policy))] = seconds
    except Exception:
        for _ in range(total - passed):
            barrier()
        raise
    finally:
        torch.set_num_threads(threads)
    return out


def combine(everyone: list[dict[str, dict[int, list[float]]]]) -> dict[str, dict[int, float]]:
    """Per precision and batch: the slowest rank's median over its repeats."""
    return {p: {b: max(statistics.median(r[p][b]) for r in everyone) for b in everyone[0][p]}
            for p in everyone[0]}


def _timing_rank(rank: int, world: int, job: TimingJob) -> dict[str, dict[int, list[float]]]:
    """Entry point of one spawned process of the concurrent timing."""
    from poplar.comm import Communicator

    comm = Communicator()
    token = torch.zeros(1)
    return time_trials(job, rank, lambda: comm.all_reduce(token, tag="calibrate:barrier"))


def spawn_timing(job: TimingJob, timeout_s: float = 600.0) -> dict[str, dict[int, float]]:
    """``time_trials`` on ``job.world`` spawned processes; ``combine``'s result."""
    from poplar.process.launch import spawn

    return combine(spawn(_timing_rank, job.world, (job,), timeout_s=timeout_s, collective_timeout_s=timeout_s))


def interpolate(seconds: dict[int, float], batch: int) -> float:
    """Seconds at ``batch`` from the measured batches: linear between them, the nearest
    segment's slope beyond them."""
    xs = sorted(seconds)
    ys = [seconds[x] for x in xs]
    if len(xs) == 1:
        return ys[0] * batch / xs[0]
    if batch <= xs[-1]:
        return float(np.interp(batch, xs, ys)) if batch >= xs[0] else ys[0]
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return ys[-1] + slope * (batch - xs[-1])


def time_scale_needed(presets: list[DevicePreset], mbs_at: dict[str, dict[str, int]],
                      concurrent: dict[str, dict[int, float]], margin: float, min_step_s: float) -> float:
    """The smallest time scale at which every preset's curve, at every measured precision, is
    slow enough (module doc): ``min_step_s`` at batch 1 on the fastest, the concurrent real
    compute at most ``margin`` of the curve at every batch up to the preset's mbs at that
    precision (``mbs_at[precision][preset]``)."""
    need = 0.0
    for precision, seconds in concurrent.items():
        p_ = Precision(precision)
        need = max(need, min_step_s / min(p.time_s(1, precision=p_) for p in presets))
        for p in presets:
            for b in range(1, mbs_at[precision][p.name] + 1):
                need = max(need, interpolate(seconds, b) / (margin * p.time_s(b, precision=p_)))
    return need


def batches_to_time(mbs: dict[str, int]) -> list[int]:
    """Batches of the concurrent timing: 1, 2, 4, 8 and every predicted mbs."""
    return sorted(set(BASE_BATCHES) | set(mbs.values()))


def pick_memory_scale(reference: CalibrationPass, presets: list[DevicePreset], target_min_mbs: int) -> float:
    smallest = min(presets, key=lambda p: p.memory_gb)
    capacity = reference.peaks[1] + (target_min_mbs - 1 + 0.5) * reference.bytes_per_sample
    return capacity / (smallest.memory_gb * GIB)


def check_cluster_precision(spec: ClusterSpec, policy: Any) -> None:
    """ProfileError naming the devices of ``spec`` that lack ``policy``'s precision."""
    try:
        spec.check_precision(policy)
    except ClusterError as e:
        raise ProfileError(str(e)) from None


@dataclass
class Prepared:
    """The single-process part of a calibration: the passes, the memory scale, and the timing
    every rank still has to run together (``job``; None when the time scale is given)."""

    presets: list[DevicePreset]
    passes: list[CalibrationPass]
    memory_scale: float
    mbs_at: dict[str, dict[str, int]]  # precision -> preset -> predicted mbs
    job: TimingJob | None
    time_scale: float | None


@dataclass(frozen=True)
class Scales:
    """How an emulated cluster's presets meet a CPU-sized model: every preset's memory times
    ``memory`` and its step time times ``time``; "auto": calibrated for the workload."""

    memory: float | str = "auto"
    time: float | str = "auto"

    def __post_init__(self) -> None:
        for name, value in (("memory", self.memory), ("time", self.time)):
            if value != "auto" and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"Scales.{name} must be a number > 0 or \"auto\" (calibrated), got {value!r}")

    @property
    def fixed(self) -> bool:
        """Both scales are given: nothing to calibrate."""
        return self.memory != "auto" and self.time != "auto"


def prepare(job: ProfileJob, cluster: ClusterSpec | str, *, scales: Scales = Scales(),
            target_min_mbs: int = TARGET_MIN_MBS, link: LinkSpec | NetworkSpec | None = None) -> Prepared:
    """The passes of one process (fp32, and the policy's precision if it has one) and the
    memory scale; the concurrent timing job for the time scale (on a runtime paced by ``link``
    when the cluster has an emulated one)."""
    spec = ClusterSpec.resolve(cluster)
    options = job.options
    policy = resolve_precision(options.mixed_precision)
    check_cluster_precision(spec, policy)
    presets = [get_preset(t) for t in dict.fromkeys(spec.rank_types())]
    policies = [None] if policy is None else [None, policy]
    timing = TimingJob(job.model_fn, job.loss_fn, job.sample_fn, job.optimizer_fn, spec.world_size,
                       options.zero_stage, policies, [],
                       options={"bucket_size_mb": options.bucket_size_mb, "wrap_policy": options.wrap_policy},
                       link=link)
    passes = [measure_pass(timing, p) for p in policies]
    memory = pick_memory_scale(passes[0], presets, target_min_mbs) if scales.memory == "auto" else float(scales.memory)
    mbs_at = {str(c.precision): {p.name: c.mbs(p, memory, options.max_batch) for p in presets} for c in passes}
    if scales.time != "auto":
        return Prepared(presets, passes, memory, mbs_at, None, float(scales.time))
    timing.batches = sorted({b for m in mbs_at.values() for b in batches_to_time(m)})
    return Prepared(presets, passes, memory, mbs_at, timing, None)


def finish(prep: Prepared, concurrent: dict[str, dict[int, float]], *, margin: float = MARGIN,
           min_step_s: float = MIN_STEP_S) -> Calibration:
    """The calibration from the prepared passes and every rank's concurrent timing."""
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    time_scale = prep.time_scale
    if time_scale is None:
        time_scale = time_scale_needed(prep.presets, prep.mbs_at, concurrent, margin, min_step_s)
    run = prep.passes[-1]
    return Calibration(prep.memory_scale, float(time_scale), run.state_bytes, run.peaks[1], run.bytes_per_sample,
                       run.real_s_per_step, prep.mbs_at[str(run.precision)], str(run.precision), margin,
                       concurrent, prep.job.world if prep.job is not None else 1)


def calibrate(job: ProfileJob, cluster: ClusterSpec | str, *, scales: Scales = Scales(), margin: float = MARGIN,
              link: LinkSpec | NetworkSpec | None = None, target_min_mbs: int = TARGET_MIN_MBS,
              min_step_s: float = MIN_STEP_S) -> Calibration:
    """Pick the scales for emulating ``cluster`` with ``job``'s model at its options' stage and
    precision (module doc), from one process: the concurrent timing runs on a spawned job of the
    cluster's world size (its collectives paced by ``link``, the cluster's emulated interconnect,
    if it has one)."""
    prep = prepare(job, cluster, scales=scales, target_min_mbs=target_min_mbs, link=link)
    concurrent = spawn_timing(prep.job) if prep.job is not None else {}
    return finish(prep, concurrent, margin=margin, min_step_s=min_step_s)


def calibrate_stages(job: ProfileJob, cluster: ClusterSpec | str, stages: list[int], **options: Any) -> Calibration:
    """One emulation for runs at several ZeRO stages: the memory scale of the lowest stage (a
    GPU's memory does not depend on the stage), and the largest time scale that any stage
    needs with it. A higher stage computes more per micro-step on the CPU (casting and copying
    shards, its hooks) and fits larger batches, so a time scale calibrated at ZeRO-0 alone can
    leave ZeRO-3's micro-steps late. ``options``: ``calibrate``'s."""
    low, *rest = sorted(set(stages))
    cal = calibrate(job.at(Configuration(low)), cluster, **options)
    if rest:  # the highest stage computes the most per micro-step
        given = options.pop("scales", Scales())
        fixed = Scales(cal.memory_scale, given.time)
        other = calibrate(job.at(Configuration(rest[-1])), cluster, scales=fixed, **options)
        cal = replace(cal, time_scale=max(cal.time_scale, other.time_scale))
    return cal
