"""The virtual link: paced collectives last the link's time from the last rank's issue, the
ranks leave them together, async collectives queue on the link, and a rank that skips a paced
collective is a clear error, not a hang."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import pytest
import torch

from poplar.comm import Communicator
from poplar.process.launch import RankFailure, spawn
from poplar.emulation.virtual_link import LinkSpec, VirtualLink
from tests.timing_reference import latest_wake_up, sleep_lateness

# bounds real wall time: make test runs these files alone, after the parallel pass
pytestmark = pytest.mark.timing

LATENCY = 0.1  # far above a 2-rank gloo all-reduce on a quiet machine, so the link sets the time
# a busy machine may only delay a paced collective: by half a link time at most (plus the latest
# wake-up a bare sleep showed right after), which still tells one link time from the next
SLACK = 0.5 * LATENCY


def paced_sync(rank: int, world: int, spec: LinkSpec) -> dict:
    torch.set_num_threads(1)
    link = VirtualLink(spec, rank)
    comm = Communicator()
    comm.all_reduce(torch.zeros(1))  # warm the group up, unpaced
    out = {"issue": [], "end": [], "lateness": []}
    with comm.observed(link):
        for i in range(4):
            time.sleep(0.03 * rank if i % 2 else 0.0)  # rank 1 arrives 30 ms late every other time
            out["issue"].append(time.perf_counter())
            t = torch.full((1000,), float(rank))
            comm.all_reduce(t)
            out["end"].append(time.perf_counter())
            assert t[0].item() == sum(range(world))
            out["lateness"].append(sleep_lateness(spec.latency_s))  # the reference: a bare sleep as long
    out["blocked"] = [r.seconds for r in comm.ledger.records if r.op == "all_reduce"][1:]
    out["late"], out["paced"] = link.late_collectives, link.paced_collectives
    return out


def paced_async(rank: int, world: int, spec: LinkSpec) -> tuple[list[float], float]:
    torch.set_num_threads(1)
    link = VirtualLink(spec, rank)
    comm = Communicator()
    comm.all_reduce(torch.zeros(1))
    with comm.observed(link):
        t0 = time.perf_counter()
        pending = [comm.all_gather(torch.zeros(2 * 1000), torch.zeros(1000), async_op=True) for _ in range(3)]
        ends = []
        for p in pending:
            p.wait()
            ends.append(time.perf_counter() - t0)
    return ends, latest_wake_up(spec.latency_s, 3)  # the reference: bare sleeps as long, right after


def one_rank_unpaced(rank: int, world: int, spec: LinkSpec) -> None:
    comm = Communicator()
    with comm.observed(VirtualLink(spec, rank) if rank == 0 else None):
        comm.all_reduce(torch.zeros(4))  # rank 1 issues it outside the link


def empty_part_gather(rank: int, world: int, spec: LinkSpec) -> tuple[float, float]:
    """Rank 1's part is empty: rank 0 sends alone, so its real all-gather is done before rank 1,
    asleep for ``DELAY``, has issued the collective."""
    comm = Communicator()
    comm.all_reduce(torch.zeros(1))  # start together (outside the link)
    with comm.observed(VirtualLink(spec, rank)):
        if rank == 1:
            time.sleep(DELAY)
        issue = time.perf_counter()
        comm.all_gather(torch.zeros(1000), torch.ones(1000 if rank == 0 else 0), sizes=[1000, 0])
        return issue, time.perf_counter()


DELAY = 0.1


@pytest.fixture
def spec() -> LinkSpec:
    s = LinkSpec.create(LATENCY, 1e12, 2)
    yield s
    s.remove()


@pytest.mark.multiprocess
def test_a_paced_collective_lasts_the_links_time_from_the_last_issue(spec: LinkSpec) -> None:
    ranks = spawn(paced_sync, 2, (spec,), timeout_s=60)
    late = max(x for r in ranks for x in r["lateness"])  # of a bare sleep after each collective
    for i in range(4):
        last_issue = max(r["issue"][i] for r in ranks)
        ends = [r["end"][i] - last_issue for r in ranks]
        # every rank leaves at the last issue + the link's time: never before, after by SLACK at most
        assert min(ends) > LATENCY - 0.001 and max(ends) < LATENCY + SLACK + late, (ends, late)
        assert max(ends) - min(ends) < 0.005 + late, (ends, late)  # together: they sleep to one end
    # the rank that issued first waited for its peer (which slept ~30 ms first): it was blocked
    # longer by the gap between their issues, as measured, and the ledger says so
    gap = ranks[1]["issue"][1] - ranks[0]["issue"][1]
    assert ranks[0]["blocked"][1] - ranks[1]["blocked"][1] == pytest.approx(gap, abs=0.01 + late)
    assert all(r["paced"] == 4 for r in ranks)


@pytest.mark.multiprocess
def test_async_collectives_queue_on_the_link(spec: LinkSpec) -> None:
    for ends, late in spawn(paced_async, 2, (spec,), timeout_s=60):
        # issued together, carried one after another: done at 1, 2 and 3 link times, never before;
        # after by SLACK at most
        for k, end in enumerate(ends, start=1):
            assert k * LATENCY - 0.001 < end < k * LATENCY + SLACK + late, (ends, late)


@pytest.mark.multiprocess
def test_a_collective_outside_the_link_on_one_rank_is_a_clear_error(spec: LinkSpec) -> None:
    with pytest.raises(RankFailure, match="was not issued on ranks \\[1\\]"):
        spawn(one_rank_unpaced, 2, (dataclasses.replace(spec, issue_wait_s=1.0),), timeout_s=60)


@pytest.mark.multiprocess
def test_a_rank_done_before_an_empty_part_was_issued_waits_for_its_issue(spec: LinkSpec) -> None:
    (issue0, end0), (issue1, end1) = spawn(empty_part_gather, 2, (spec,), timeout_s=60)
    # both leave at rank 1's issue + the link's time, not at rank 0's real end (long before)
    assert end0 > issue1 + LATENCY - 0.001 and abs(end0 - end1) < 0.005 + SLACK, (issue0, end0, issue1, end1)


def test_the_link_prices_collectives_like_the_profilers_ring_fit(spec: LinkSpec) -> None:
    wide = LinkSpec(0.001, 1e9, 4, spec.board_path)
    assert wide.seconds("all_reduce", 10 ** 6) == pytest.approx(0.001 + 1.5e-3)
    assert wide.seconds("all_gather", 10 ** 6) == pytest.approx(0.001 + 0.75e-3)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        LinkSpec(0.001, 0.0, 4, spec.board_path)


def engine_on_link(rank: int, world: int, spec: LinkSpec) -> dict:
    """A ZeRO-0 engine whose virtual device has the link: its gradient all-reduce takes the link's time."""
    from poplar.engine import PoplarEngine
    from poplar.emulation import SaturatingCurve, VirtualDevice
    from poplar.profiler.profile_run import default_optimizer
    from poplar.types.plans import Plan, RankPlan
    from poplar.workloads import get_workload

    torch.set_num_threads(1)
    workload = get_workload("token-mlp")
    device = VirtualDevice("d", 10 ** 9, time_fn=SaturatingCurve(0.01, 0.0, 1e9))
    device.link = VirtualLink(spec, rank)
    model = workload.model_fn()
    engine = PoplarEngine(model, default_optimizer(model), zero_stage=0, plan=Plan([RankPlan(2, 1)] * 2),
                          loss_fn=workload.loss_fn)
    with device.attach(engine):
        engine.train_step(workload.sample_fn(2))
        t0 = time.perf_counter()
        engine.train_step(workload.sample_fn(2))
        wall = time.perf_counter() - t0
    records = [r for r in engine.comm_ledger.of(iteration=engine.iteration - 1) if r.op == "all_reduce"]
    return {"seconds": [r.seconds for r in records], "paced": device.link.paced_collectives, "wall": wall}


@pytest.mark.multiprocess
def test_a_virtual_device_paces_its_engines_collectives_on_its_link(spec: LinkSpec) -> None:
    for rank in spawn(engine_on_link, 2, (spec,), timeout_s=120):
        assert rank["paced"] >= 2 and len(rank["seconds"]) == 2
        # the link runs one collective at a time: the iteration's two all-reduces (the gradients',
        # issued during the last backward, and the status) take at least twice its time
        assert rank["wall"] > 2 * LATENCY - 0.001, rank
        # the status all-reduce waits for the link; the gradients' one overlaps the backward, so
        # the ledger (the seconds a rank was blocked) may hold less than the link's time for it
        assert max(rank["seconds"]) > LATENCY - 0.001, rank


def test_the_link_fit_takes_a_quantile_of_the_real_collectives_with_a_margin() -> None:
    from poplar.emulation.link_calibration import fit_link

    small = [("all_reduce", 4096, s) for s in np.linspace(0.001, 0.010, 10)]
    # large all-gathers: 10 ms more than the small ones at every quantile -> 10 ms of bus volume
    large = [("all_gather", 4 * 10 ** 6, s + 0.010) for s in np.linspace(0.001, 0.010, 10)]
    latency, bandwidth = fit_link(small + large, 4, quantile=0.9, margin=0.5)
    q = float(np.quantile(np.linspace(0.001, 0.010, 10), 0.9))
    assert latency == pytest.approx(q / 0.5)
    # bus volume 3/4 x 4 MB must take (q + 10 ms) / 0.5 - latency = 20 ms
    assert bandwidth == pytest.approx(3e6 / 0.020)
    with pytest.raises(ValueError, match="margin"):
        fit_link(small, 4, margin=0.0)
