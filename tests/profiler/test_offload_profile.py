"""The profiler measures with optimizers offloaded to host memory: ``ProfileOptions(offloads=...)``
puts them there in the capacity searches and timing rounds and the profile records the placement
(``Profile.offloads``); with ``OffloadEscalation.SHORT_RANKS`` a rank that fits batch 1 at no
stage is searched again at ZeRO-3 with its optimizer offloaded, every rank deciding alike; without
it, the error names offload as a fix."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from poplar.process.launch import spawn
from poplar.emulation import VirtualDevice
from poplar.profiler.escalation import OffloadEscalation, escalate_offload, next_offloads
from poplar.profiler.profile_run import ProfileOptions, profile_rank
from poplar.planner import plan
from poplar.types.plans import Offload, PlanError
from poplar.types.profiles import ProfileError
from tests.toy import SEQ, VOCAB, loss_fn, make_model

NONE, OPT = Offload.NONE, Offload.OPTIMIZER


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)


def _profile(rank: int, capacity: int, options: ProfileOptions, optimizer_fn=None):
    device = VirtualDevice(f"card{rank}", capacity)
    device.pad = False
    return profile_rank(make_model, loss_fn, lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)), device,
                        optimizer_fn=optimizer_fn, options=options, log=lambda m: None)


def _options(**kw) -> ProfileOptions:
    return ProfileOptions(zero_stage=3, repeats=1, max_batch=64, measure_comm=False, progress=False, **kw)


def placed_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, offloads in (("device", None), ("offloaded", (NONE, OPT))):
        p = _profile(rank, 40_000, _options(offloads=offloads))  # AdamW: 8 bytes of state per element
        out[name] = {"mbs": [r.mbs for r in p.ranks], "offloads": p.offloads,
                     "points": [[pt.batch for pt in r.points] for r in p.ranks],
                     "shard_bytes": [r.shard_bytes for r in p.ranks]}
    return out


@pytest.mark.multiprocess
def test_offloaded_rank_measures_a_larger_mbs_and_the_profile_records_it() -> None:
    results = spawn(placed_worker, 2, timeout_s=240, collective_timeout_s=120)
    assert results[0] == results[1]
    device, offloaded = results[0]["device"], results[0]["offloaded"]
    assert device["offloads"] is None and offloaded["offloads"] == ["none", "optimizer"]
    assert offloaded["mbs"][0] == device["mbs"][0]  # the other rank's placement is not its memory
    assert offloaded["mbs"][1] > device["mbs"][1] >= 1, (device, offloaded)
    assert offloaded["shard_bytes"][1] < device["shard_bytes"][1]  # the moments left the device
    assert max(offloaded["points"][1]) == offloaded["mbs"][1]  # timed at the offloaded mbs


def escalation_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    capacity = (40_000, 14_000)[rank]  # the short card fits batch 1 at ZeRO-3 only with its momentum offloaded
    p = _profile(rank, capacity, _options(offload_escalation=OffloadEscalation.SHORT_RANKS), _sgd)
    out = {"mbs": [r.mbs for r in p.ranks], "offloads": p.offloads,
           "escalations": [asdict(e) for e in p.measurement.escalations],
           "stage": p.zero_stage, "planned": [r.offload.value for r in plan(p, 6, 3, offload="auto").ranks]}
    try:
        plan(p, 6, 3)
        out["kept_on_device"] = None
    except PlanError as e:
        out["kept_on_device"] = str(e)
    try:
        _profile(rank, capacity, _options(), _sgd)
        out["refused"] = None
    except ProfileError as e:
        out["refused"] = str(e)
    return out


@pytest.mark.multiprocess
def test_escalation_offloads_exactly_the_short_ranks() -> None:
    r0, r1 = spawn(escalation_worker, 2, timeout_s=240, collective_timeout_s=120)
    for res in (r0, r1):
        assert res["stage"] == 3 and res["offloads"] == ["none", "optimizer"], res
        assert res["mbs"][1] >= 1 and res["mbs"][0] > res["mbs"][1]
        (record,) = res["escalations"]
        assert record["from_stage"] == record["to_stage"] == 3 and record["ranks"] == [1]
        assert record["offload"] == ["none", "optimizer"] and "out of memory" in record["reasons"]["1"]
        assert res["planned"][1] == "optimizer"  # the planner keeps it offloaded: it fits no sample otherwise
        assert res["kept_on_device"] is not None  # and cannot plan every optimizer on its device
        refused = res["refused"]
        assert refused is not None and "even at ZeRO-3 on rank 1" in refused
        assert "offload" in refused and "OffloadEscalation.SHORT_RANKS" in refused, refused


def test_next_offloads_adds_the_short_ranks_once() -> None:
    assert next_offloads(None, [1], 3) == (NONE, OPT, NONE)
    assert next_offloads((NONE, OPT, NONE), [0, 1], 3) == (OPT, OPT, NONE)
    assert next_offloads((NONE, OPT, NONE), [1], 3) is None  # already offloaded: nothing more to try


def test_escalate_offload_searches_again_until_every_rank_fits_or_the_short_ones_already_offload() -> None:
    # a scripted agreed search: rank 1 fits batch 1 only offloaded; rank 2 fits nowhere
    fits_when = {0: lambda o: True, 1: lambda o: o is OPT, 2: lambda o: False}
    searched: list = []

    def search(at):
        searched.append(at)
        return [int(fits_when[r](o)) for r, o in enumerate(at)]

    def short(mbs):
        return [r for r, m in enumerate(mbs) if m < 1]

    said: list = []
    found, placed = escalate_offload([1, 0], None, short=short, search=search, world_size=2,
                                     announce=lambda mbs, ranks, more: said.append((mbs, ranks, more)))
    assert found == [1, 1] and placed == (NONE, OPT) and searched == [(NONE, OPT)]
    assert said == [([1, 0], [1], (NONE, OPT))]
    found, placed = escalate_offload([1, 0, 0], None, short=short, search=search, world_size=3,
                                     announce=lambda *a: None)
    assert found == [1, 1, 0] and placed == (NONE, OPT, OPT)  # rank 2, offloaded and still short, ends it
    assert searched[1:] == [(NONE, OPT, OPT)]
    fitting = [2, 1]
    assert escalate_offload(fitting, None, short=short, search=search, world_size=2,
                            announce=lambda *a: None) == (fitting, None)  # nothing short: no search


def test_profile_options_check_their_placements() -> None:
    assert _options(offloads=("none", "optimizer")).offloads == (NONE, OPT)
    assert _options(offload_escalation="short_ranks").offload_escalation is OffloadEscalation.SHORT_RANKS
    with pytest.raises(ValueError, match="offloads must be one Offload per rank"):
        _options(offloads=("disk",))
    with pytest.raises(ValueError, match="offload_escalation"):
        _options(offload_escalation="sometimes")
