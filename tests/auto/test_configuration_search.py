"""Auto mode's configuration search (``auto.choice.ConfigurationSearch``) on scripted profiles:
known profiles in (the synthetic ones of the device presets, checkpointing as 4/3 the compute at
twice the mbs), the profiler's part played by a loop that hands each timing request its
configuration's profile. The branch and bound's rules: the first fit timed first, a candidate
with no measurement of its compute probed before it is timed, every candidate left untimed bounded
at or above the best (less the noise), the fastest timed one chosen; where nothing fits, the
error names the lowest higher stage that would."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from poplar.auto.choice import Choice, ConfigurationSearch, PlanLimits
from poplar.emulation.synthetic import GIB, ModelSpec, synthetic_profile
from poplar.profiler.candidate_run import ChoiceRecord, TimingRequest
from poplar.profiler.configurations import ConfigCapacity, ShardMemory
from poplar.profiler.escalation import OffloadEscalation
from poplar.types.configuration import Configuration
from poplar.types.profiles import Profile

NOISE = 0.02
SPEC = ModelSpec("m", int(0.4e9), 1.0 * GIB)


def _profile(cluster: str, config: Configuration) -> Profile:
    prof = synthetic_profile(cluster, config.stage, SPEC)
    if config.checkpointed:  # recomputation: 4/3 the compute, twice the micro-batch
        for r in prof.ranks:
            top = max(p.batch for p in r.points)
            r.points = [replace(p, compute_s=p.compute_s * 4 / 3) for p in r.points]
            r.points += [replace(p, batch=p.batch + top) for p in r.points]
            r.mbs *= 2
    return prof


def _capacity(cluster: str, config: Configuration, short: tuple[int, ...] = ()) -> ConfigCapacity:
    mbs = [0 if r.rank in short else r.mbs for r in _profile(cluster, config).ranks]
    return ConfigCapacity(config, mbs, [""] * len(mbs), SimpleNamespace(trial_steps=0),
                          [ShardMemory(0, None, None)] * len(mbs))


def _search(cluster: str, checkpointing: object, gbs: int) -> tuple[ConfigurationSearch, list[TimingRequest]]:
    search = ConfigurationSearch(Choice(gbs, "fastest", checkpointing, (0, 1, 2, 3)), lambda m: None, PlanLimits(),
                                 noise=NOISE, progress=False)
    caps = [_capacity(cluster, c) for c in search.configurations()]
    search.start(caps, [r.device_type for r in _profile(cluster, Configuration(0)).ranks])
    requests = []
    while (request := search.next_timing()) is not None:
        requests.append(request)
        search.record(request, _profile(cluster, caps[request.index].config))
    return search, requests


@pytest.mark.parametrize("cluster,checkpointing,gbs", [("C", False, 64), ("A", None, 256), ("B", None, 16)])
def test_the_search_times_the_first_fit_bounds_the_rest_and_picks_the_fastest(cluster, checkpointing, gbs) -> None:
    search, requests = _search(cluster, checkpointing, gbs)
    index, profile = search.chosen()
    profile = search.finish(profile, ChoiceRecord({"capacity_s": 0.0, "timing_s": 0.0, "comm_s": 0.0}, 0, 0.0, []))
    first = search.candidates[requests[0].index]
    assert not requests[0].probe and (first.row.stage, first.row.checkpointing) == (0, False)
    timed = [c for c in search.candidates if c.profile is not None]
    best = min(c.row.predicted_s for c in timed)
    chosen = search.candidates[index]
    assert chosen in timed and chosen.row.predicted_s == best and chosen.row.chosen
    for c in search.fitting:
        if c.profile is None:  # decided by its bound: it could not beat the best by more than the noise
            assert c.row.predicted_s >= best * (1 - NOISE) and c.row.reason.startswith("not timed: lower bound")
    for r in requests:  # a probe comes only where nothing measured the candidate's compute before it
        if r.probe:
            before = search.candidates[r.index]
            assert before.row.checkpointing or before.row.stage == 3
    assert profile.auto_choice.timed == len(timed)
    assert [row.stage for row in profile.auto_choice.candidates] == [c.stage for c in search.rows]


def test_a_checkpointed_candidate_is_probed_before_it_is_timed() -> None:
    _, requests = _search("A", None, 256)
    probed = [r.index for r in requests if r.probe]
    assert probed, "the checkpointed candidates have no measurement of their compute: one is probed first"
    for index in probed:  # its probe before any timing of it
        kinds = [r.probe for r in requests if r.index == index]
        assert kinds[0] is True, kinds


def test_where_nothing_fits_the_error_names_the_lowest_higher_stage() -> None:
    search = ConfigurationSearch(Choice(64, "fastest", False, (0,)), lambda m: None, PlanLimits(), noise=NOISE,
                                 progress=False)
    caps = [_capacity("C", c, short=(2, 3)) for c in search.configurations()]
    search.start(caps, [r.device_type for r in _profile("C", Configuration(0)).ranks])
    assert search.fitting == []
    higher = [_capacity("C", c, short=(2, 3) if c.stage < 2 else ()) for c in search.configurations(higher=True)]
    message = str(search.none_fit(higher, OffloadEscalation.NEVER))
    assert "at the stage given" in message and "ZeRO-2 would fit" in message and "zero_stage=2" in message
    assert "on rank 2" in message and "and 1 more" in message
