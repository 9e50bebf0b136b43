"""The virtual device in one process: memory accounting, the OOM it raises, recovery, padding."""

from __future__ import annotations

import time

import pytest
import torch

from poplar.zero.observers import StepObserver
from poplar.emulation import SaturatingCurve, VirtualDevice

from poplar.zero.failures import is_oom
from poplar.profiler.capacity import CapacitySearch
from poplar.profiler.local_comm import local_engine, search_plan
from poplar.emulation.memory import predicted_optimizer_bytes
from poplar.emulation.presets import PresetError
from poplar.profiler.profile_run import default_optimizer
from poplar.profiler.timing import Confirmation, MicroStepTimer, TimingGrid, breaks_curve, timing_batches, unconfirmed
from poplar.comm import DistributedError
from poplar.workloads import get_workload
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import PlanCheck
from tests.timing_reference import latest_wake_up, sleep_lateness

# bounds real wall time: make test runs these files alone, after the parallel pass
pytestmark = pytest.mark.timing

# the profiler's fast workload: the capacities and curves below are calibrated for it
WORKLOAD = get_workload("token-mlp")

MB = 10 ** 6


def engine_at(stage: int, world: int = 3, rank: int = 1, optimizer: str = "adamw"):
    model = WORKLOAD.model_fn()
    opt = default_optimizer(model) if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                 momentum=0.9)
    return local_engine(model, opt, world_size=world, rank=rank, zero_stage=ZeroConfig(stage, bucket_size_mb=0.03),
                        device=torch.device("cpu"))


def step(engine, batch: int) -> None:
    engine.set_plan(search_plan(engine.world_size, engine.rank, batch), PlanCheck.LOCAL)
    engine.train_step(WORKLOAD.sample_fn(batch), WORKLOAD.loss_fn)


def test_oom_error_is_the_cuda_type() -> None:
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    wrapped = DistributedError("iteration failed")
    wrapped.__cause__ = torch.OutOfMemoryError("virtual")
    assert is_oom(wrapped) and not is_oom(RuntimeError("other")) and not is_oom(None)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_and_activations_are_counted(stage: int) -> None:
    engine = engine_at(stage)
    device = VirtualDevice("d", 100 * MB)
    psi = sum(p.numel() for p in WORKLOAD.model_fn().parameters())  # (stage-3 parameters are empty between uses)
    with device.attach(engine):
        # before any step: optimizer state is predicted (AdamW: 8 bytes per parameter of the shard)
        states = {0: 16 * psi, 1: 8 * psi + 8 * psi / 3, 2: 4 * psi + 12 * psi / 3, 3: 16 * psi / 3}[stage]
        assert device.static_bytes() == pytest.approx(states, rel=0.02)
        peaks = []
        for b in (1, 2, 4, 8):
            step(engine, b)
            peaks.append(device.last_step.after_forward)  # (the peak may be in backward: stage-2 buckets)
            assert device.last_step.peak >= device.last_step.after_forward > device.last_step.before_forward
            assert device.saved_bytes == 0  # every saved activation was released by backward
        assert device.static_bytes() == pytest.approx(states, rel=0.02)  # prediction was right
        slopes = [(peaks[i + 1] - peaks[i]) / (b2 - b1) for i, (b1, b2) in enumerate([(1, 2), (2, 4), (4, 8)])]
        assert max(slopes) / min(slopes) < 1.05  # activations grow linearly with the batch
        assert device.memory_in_use() == device.static_bytes()


def test_optimizer_prediction_matches_the_first_step() -> None:
    for kind in ("adamw", "sgd"):
        engine = engine_at(1, optimizer=kind)
        predicted = predicted_optimizer_bytes(engine.optimizer)
        step(engine, 1)
        from poplar.zero.optim import optimizer_state_bytes
        assert predicted == optimizer_state_bytes(engine.optimizer) > 0


def test_over_capacity_raises_oom_and_memory_comes_back() -> None:
    engine = engine_at(2)
    device = VirtualDevice("d", 1 * MB)
    with device.attach(engine):
        step(engine, 2)
        before = device.memory_in_use()
        with pytest.raises(DistributedError) as info:
            step(engine, 64)
        assert is_oom(info.value) and "out of memory" in str(info.value)
        info = None
        device.release()
        assert device.memory_in_use() == before and device.saved_bytes == 0
        step(engine, 2)  # and the engine trains on


def test_record_mode_does_not_raise() -> None:
    engine = engine_at(0)
    device = VirtualDevice("d", 1 * MB, raise_oom=False)
    with device.attach(engine):
        step(engine, 64)
    assert device.overflows and device.overflows[0]["batch"] == 64


def test_capacity_search_finds_the_largest_batch() -> None:
    engine = engine_at(0)
    device = VirtualDevice("d", int(1.5 * MB))
    with device.attach(engine):
        search = CapacitySearch(engine, device, WORKLOAD.sample_fn, WORKLOAD.loss_fn, 0)
        result = search.run()
        assert result.mbs > 4 and result.oom_events
        assert all(e.memory_after == e.memory_before for e in result.oom_events)
        assert search.trial(result.mbs) and not search.trial(result.mbs + 1)


def test_padding_makes_compute_follow_the_curve() -> None:
    curve = SaturatingCurve(0.012, 2.0, 1000.0)
    engine = engine_at(0, world=1, rank=0)
    device = VirtualDevice("d", 100 * MB, time_fn=curve)
    lateness: list[float] = []  # of a bare sleep as long as the step, after each step: the reference
    with device.attach(engine), MicroStepTimer(engine, device) as timer:
        loss = WORKLOAD.loss_fn
        sizes = (1, 1, 1, 8, 8, 8, 32, 32, 32)
        for b in sizes:
            engine.set_plan(search_plan(1, 0, b), PlanCheck.LOCAL)
            engine.train_step(WORKLOAD.sample_fn(b), loss)
            lateness.append(sleep_lateness(curve(b)))
    for b in (1, 8, 32):  # the profiler's estimator: the smallest of a few
        best = min(c for (c, _), s in list(zip(timer.records, sizes))[1:] if s == b)
        # never shorter than the curve; longer by 5 % at most beyond what this machine added to a
        # bare sleep of the same length in between the steps
        assert curve(b) <= best <= curve(b) * 1.05 + max(lateness), (b, best, curve(b), lateness)


def test_slowdown_factor() -> None:
    engine = engine_at(0, world=1, rank=0)
    plain = VirtualDevice("fast", 100 * MB)
    slow = VirtualDevice("slow", 100 * MB, slowdown=4.0)
    times = {}
    for dev in (plain, slow):
        with dev.attach(engine), MicroStepTimer(engine, dev) as timer:
            loss = WORKLOAD.loss_fn
            for _ in range(7):
                engine.set_plan(search_plan(1, 0, 16), PlanCheck.LOCAL)
                engine.train_step(WORKLOAD.sample_fn(16), loss)
        times[dev.name] = sorted(c for c, _ in timer.records)[3]
    assert 2 < times["slow"] / times["fast"] < 8  # 4x, within the noise of a shared machine


def test_injected_oom_fires_once_at_the_asked_point() -> None:
    engine = engine_at(0)
    device = VirtualDevice("d", 100 * MB)
    device.inject_oom(batch=4, after_checks=3, where="saved")
    with device.attach(engine):
        step(engine, 2)
        with pytest.raises(DistributedError) as info:
            step(engine, 4)
        assert "injected" in str(info.value)
        assert device.last_failure["where"] == "saved" and device.last_failure["saved"] > 0
        info = None
        device.release()
        step(engine, 4)


def test_presets_and_bad_input() -> None:
    dev = VirtualDevice.from_preset("T4-16G", memory_scale=1e-3, time_scale=0.01)
    assert dev.capacity_bytes == int(16 * 2 ** 30 * 1e-3) and dev.device_type == "T4-16G"
    from poplar.emulation.presets import get_preset
    assert dev.time_s(8) == pytest.approx(get_preset("T4-16G").time_s(8) * 0.01)
    with pytest.raises(PresetError, match="unknown device preset 'H100'.*known presets"):
        VirtualDevice.from_preset("H100", 1e-3, 0.01)
    with pytest.raises(ValueError, match="capacity_bytes"):
        VirtualDevice("x", 0)
    with pytest.raises(ValueError, match="slowdown"):
        VirtualDevice("x", 10, slowdown=0.5)


def test_timing_batches() -> None:
    assert timing_batches(1) == [1]
    assert timing_batches(13) == [1, 2, 3, 4, 6, 8, 12, 13]
    assert timing_batches(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert timing_batches(26, TimingGrid.SPARSE) == [1, 2, 4, 8, 16, 26]
    assert timing_batches(1, TimingGrid.SPARSE) == [1]


def test_a_reused_point_stands_in_for_the_grid_batch_below_it() -> None:
    from poplar.profiler.configurations import uncovered
    assert uncovered([1, 2, 4, 8, 16, 24], {20}, 24) == {1, 2, 4, 8, 24}  # 20 covers 16 (up to 24)
    assert uncovered([1, 2, 4, 8, 16, 26], {26}, 26) == {1, 2, 4, 8, 16}
    assert uncovered([1, 2, 4, 8, 16, 30], {1, 2, 4, 8, 16, 26}, 30) == {30}
    assert uncovered([1, 2, 4, 7], {9}, 7) == {1, 2, 4, 7}  # beyond mbs: no use


def test_a_single_measurement_is_trusted_only_where_it_keeps_the_curves_shape() -> None:
    best = {1: 1.0, 2: 1.8, 4: 3.2, 8: 6.0}
    assert not any(breaks_curve(b, best, 0.02) for b in best)
    assert breaks_curve(4, {**best, 4: 3.7}, 0.02)  # more per sample than batch 2 (0.925 > 0.9)
    assert breaks_curve(2, {**best, 2: 3.4}, 0.02)  # slower than batch 4
    once = {b: [t] for b, t in best.items()}
    assert unconfirmed(once, [1, 2, 4, 8], 0.02, Confirmation.CURVE) == []
    assert unconfirmed(once, [1, 2, 4, 8], 0.02, Confirmation.REPEAT) == [1, 2, 4, 8]
    disturbed = {**once, 4: [3.7]}
    assert unconfirmed(disturbed, [1, 2, 4, 8], 0.02, Confirmation.CURVE) == [4]
    # measured again: the minimum decides under CURVE; REPEAT needs two that agree
    assert unconfirmed({**once, 4: [3.7, 3.2]}, [4], 0.02, Confirmation.CURVE) == []
    assert unconfirmed({**once, 4: [3.9, 3.7]}, [4], 0.02, Confirmation.CURVE) == [4]  # two that agree are trusted, on shape or not
    assert unconfirmed({**once, 4: [3.7, 3.2]}, [4], 0.02, Confirmation.REPEAT) == [4]
    assert unconfirmed({**once, 4: [3.2, 3.21]}, [4], 0.02, Confirmation.REPEAT) == []


def _sleep_errors(rounds: int = 20) -> tuple[list[float], list[float]]:
    """Overshoots of ``sleep_until`` and of a bare ``time.sleep`` of 3 ms, taken in turn."""
    from poplar.emulation.speed_padding import sleep_until
    errors, bare = [], []
    for _ in range(rounds):
        target = time.perf_counter() + 0.003
        sleep_until(target)
        errors.append(time.perf_counter() - target)
        start = time.perf_counter()
        time.sleep(0.003)
        bare.append(time.perf_counter() - start - 0.003)
    return sorted(errors), sorted(bare)


def test_sleep_is_not_the_bottleneck() -> None:
    """``sleep_until`` wakes no later than a bare ``time.sleep`` of the same length, taken in turn
    with it, and never early. A busy machine can take the core from the final spin for a whole
    time slice, so the medians are compared over up to three sets of rounds: one set must show
    it; a ``sleep_until`` that is late by design is late in every set."""
    for _ in range(3):
        errors, bare = _sleep_errors()
        assert errors[0] >= 0
        if errors[10] <= bare[10] + 1e-4:
            return
    raise AssertionError((errors, bare))


class MicroStepStarts(StepObserver):
    """When each micro-step began on this rank (``perf_counter``: one clock for every process
    of the machine), so a test can tell how far apart two ranks started one."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def micro_step_start(self, step: object) -> None:
        self.starts.append(time.perf_counter())


def lockstep_rank(rank: int, world: int, stage: int) -> tuple[list[float], list[float], float, list[float]]:
    from poplar.engine import PoplarEngine
    from poplar.types.plans import Plan, RankPlan

    seconds = (0.02, 0.10)[rank]  # a fast and a slow device, 3 micro-steps each
    device = VirtualDevice("fast" if rank == 0 else "slow", 10 ** 9, time_fn=SaturatingCurve(seconds, 0.0, 1e9))
    model = WORKLOAD.model_fn()
    engine = PoplarEngine(model, default_optimizer(model), zero_stage=stage, plan=Plan([RankPlan(2, 3)] * 2),
                          loss_fn=WORKLOAD.loss_fn)
    starts = MicroStepStarts()
    handle = engine.add_observer(starts)
    with device.attach(engine), MicroStepTimer(engine, device) as timer:
        for _ in range(2):
            engine.train_step(WORKLOAD.sample_fn(6))
    handle.remove()
    late = latest_wake_up(0.10, 3)  # bare sleeps as long as a slow step, right after: the reference
    last = engine.iteration - 1
    # forward and backward: at stage 3 per-block pacing spreads the wait over both passes' gathers
    waits = [sum(engine.comm_ledger.seconds(iteration=last, micro_step=k, phase=phase)
                 for phase in ("forward", "backward")) for k in range(3)]
    return waits, [r.compute_s for r in timer.records[-3:]], late, starts.starts[-3:]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.multiprocess
def test_emulated_micro_steps_synchronise_like_gpus(stage: int) -> None:
    """At stages 2/3 each micro-step's collectives follow the emulated compute, so the fast rank
    waits for the slow one in every micro-step (not once at the iteration's end)."""
    from poplar.process.launch import spawn

    (fast, fast_compute, fast_late, fast_start), (slow, slow_compute, slow_late, slow_start) = spawn(
        lockstep_rank, 2, (stage,), timeout_s=120)
    late = max(fast_late, slow_late)
    for k in range(3):
        # each rank's compute is padded to its curve (20 and 100 ms): a busy machine adds, never removes
        assert fast_compute[k] >= 0.98 * 0.02 and slow_compute[k] >= 0.98 * 0.10, (k, fast_compute, slow_compute)
        # in every micro-step the fast rank waits out the gap between the two computes measured in
        # that micro-step, beyond what the slow one waits for the collectives themselves (more at
        # stage 3: one per block), less how much later the fast rank started the micro-step (both
        # end it together). Waiting once at the iteration's end instead would show 0 in the first
        # micro-steps and 3 gaps in the last, so half a gap either way tells the two apart, with
        # room for a busy machine's scheduling (plus the latest wake-up of a bare sleep after them)
        gap = slow_compute[k] - fast_compute[k] - (fast_start[k] - slow_start[k])
        assert abs(fast[k] - slow[k] - gap) < 0.5 * gap + late, (k, fast, slow, gap, late)


def test_zero3_blocks_are_paced_along_the_curve() -> None:
    """At ZeRO-3 the device pads at every block boundary, so a block's forward starts at its
    share of the emulated forward, not when the CPU got there; the micro-step still lasts the curve."""
    curve = SaturatingCurve(0.3, 2.0, 1000.0)  # far slower than the real compute
    engine = engine_at(3, world=1, rank=0)
    device = VirtualDevice("d", 100 * MB, time_fn=curve)
    starts: list[float] = []
    backward_starts: list[float] = []

    class Clock:  # forward start, then each block's forward start, seen after the device's hooks
        def __call__(self, module, args) -> None:
            if torch.is_grad_enabled():
                starts.append(time.perf_counter())

        def after(self, module, args, output) -> None:
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda g: backward_starts.append(time.perf_counter()))

    clock = Clock()
    for name in engine.stage.block_names():
        engine.module.get_submodule(name).register_forward_pre_hook(clock)
        engine.module.get_submodule(name).register_forward_hook(clock.after)
    with device.attach(engine), MicroStepTimer(engine, device) as timer:
        for _ in range(3):
            starts.clear(), backward_starts.clear()
            t0 = time.perf_counter()
            step(engine, 4)
            t1 = time.perf_counter()
    # the reference, after the steps (an idle gap between them would change what the device
    # learns of its real compute): how late bare sleeps as long as the step wake up
    late = latest_wake_up(curve(4), 3)
    forward = device.forward_fraction * curve(4)
    offsets = [s - t0 for s in starts]
    # three blocks spread over the forward: the last one starts well inside it, in order (its
    # share is learned from real compute, which a busy machine skews: 0.15 of the forward still
    # stands far above an unpaced start, a few ms of real compute)
    assert offsets == sorted(offsets) and offsets[-1] > 0.15 * forward and offsets[-1] < forward + late
    assert offsets[-1] - offsets[0] > 0.15 * forward
    # the backward's blocks begin spread over the backward too, not all at its end
    assert len(backward_starts) == 3 and backward_starts[-1] - backward_starts[0] > 0.1 * (curve(4) - forward)
    # the step and its micro-step last the curve: never less, and more by at most the margins the
    # test always allowed plus what this machine added to a bare sleep as long right after them
    assert curve(4) <= t1 - t0 <= curve(4) * 1.1 + late, (t1 - t0, late)
    assert curve(4) <= timer.records[-1][0] <= curve(4) * 1.05 + late, (timer.records[-1], late)
    assert device.late_steps == 0
