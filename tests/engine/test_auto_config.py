"""Activation checkpointing as seen by the profiler's virtual devices, and the candidate choice:
checkpointing at least doubles the largest micro-batch of the built-in Llama workload; the
recomputation's saved tensors are counted while they live; the model-guided capacity search of
auto mode finds what a full search finds; ``choose`` picks the fastest fitting row, or the first
fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar.planner.candidates import (CandidateRow, choose, estimate_profile, format_table, marked, optimistic_time,
                                        with_probe)
from poplar.profiler.capacity_model import guided_mbs
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer, search_capacity
from poplar.emulation.saved_tensors import SavedTensors
from poplar.emulation.virtual_device import VirtualDevice
from poplar.types.plans import PlanError
from poplar.types.profiles import CommProfile, Links, Profile, ProfilePoint, RankProfile
from poplar.workloads import get_workload
from poplar.zero.activation_checkpointing import ActivationCheckpointing


def test_checkpointing_doubles_llama_mbs_on_a_virtual_device() -> None:
    torch.set_num_threads(1)
    w = get_workload("llama-tiny")
    mbs = {}
    for setting in (None, True):
        device = VirtualDevice("X", 12 * 2 ** 20)
        result = search_capacity(ProfileJob(w.model_fn, w.loss_fn, w.sample_fn, default_optimizer, ProfileOptions(activation_checkpointing=setting, max_batch=512)), device, world_size=2, rank=0,
                                 stage=0,
                                 log=lambda m: None)
        mbs[setting] = result.mbs
    assert mbs[None] >= 1 and mbs[True] >= 2 * mbs[None], mbs


def test_recomputed_tensors_are_counted_until_freed() -> None:
    model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 4))
    peaks = []
    saved = SavedTensors(on_saved=lambda: None, on_recomputed=lambda: peaks.append(saved.bytes))
    ckpt = ActivationCheckpointing([("1", model[1]), ("2", model[2])])
    handle = ckpt.add_recompute_context(saved.recomputed)
    x = torch.randn(8, 4, requires_grad=True)
    model(x).sum().backward()
    handle.remove()
    assert peaks and max(peaks) >= 8 * 64 * 4  # the tanh output, recomputed, is one 8x64 fp32 tensor
    assert saved.bytes == 0


def test_choose_fastest_and_first_fit() -> None:
    rows = [CandidateRow(0, False, False, {"T4": 0}, reason="batch 1 does not fit"),
            CandidateRow(1, False, True, {"T4": 2}, 1.0, True),
            CandidateRow(2, True, True, {"T4": 9}, 0.7, True),
            CandidateRow(3, False, True, {"T4": 4}, 0.9, False)]
    assert choose(rows, "fastest").name == "ZeRO-2 +ckpt"
    rows = marked(rows, "fastest")  # the table's rows, the choice marked
    assert "slower" in rows[1].reason and "CHOSEN" in format_table(rows)
    assert choose(rows, "first_fit").name == "ZeRO-1"
    with pytest.raises(PlanError, match="no configuration fits"):
        choose([rows[0]], "fastest")


@pytest.mark.parametrize("capacity_mib", [4, 7])
def test_guided_capacity_equals_a_full_search_at_every_stage_and_checkpointing(capacity_mib: int) -> None:
    """Auto mode's search (one search per checkpointing setting, the other stages predicted from
    it and confirmed) against Algorithm 1's full search, on virtual devices."""
    torch.set_num_threads(1)
    w = get_workload("llama-tiny")
    trials = {"full": 0, "guided": 0}
    for setting in (None, True):
        options = ProfileOptions(activation_checkpointing=setting, max_batch=512)
        reference = None
        for stage in range(4):
            found = {}
            for kind in ("full", "guided"):
                result = search_capacity(ProfileJob(w.model_fn, w.loss_fn, w.sample_fn, default_optimizer, options), VirtualDevice("X", capacity_mib * 2 ** 20), world_size=2, rank=1, stage=stage, log=lambda m: None, guided=kind == "guided",
                                         reference=reference if kind == "guided" else None)
                found[kind] = result
                trials[kind] += result.trial_steps
            assert found["guided"].mbs == found["full"].mbs >= 1, (stage, setting, found["guided"].trials,
                                                                    found["full"].trials)
            if reference is None:
                reference = found["guided"]
            else:  # predicted from the reference: batch 1, then mbs and mbs + 1 when the prediction is right
                assert found["guided"].trial_steps <= 5, (stage, setting, found["guided"].trials)
    assert trials["guided"] < trials["full"], trials


def test_guided_mbs_is_exact_whatever_the_model_says() -> None:
    for mbs in range(0, 130):
        for guess in (None, 1, mbs - 3, mbs - 1, mbs, mbs + 1, mbs + 5, 3 * mbs, 10_000):
            calls: list[int] = []

            def trial(b: int) -> bool:
                calls.append(b)
                return b <= mbs
            got = guided_mbs(trial, lambda: guess, 1000)
            assert got == mbs, (mbs, guess, calls)
            assert len(set(calls)) == len(calls)  # no batch tried twice
            if guess == mbs and mbs >= 1:
                assert calls == [mbs, mbs + 1]


def _profile(times: list[dict[int, float]], stage: int = 0) -> Profile:
    ranks = [RankProfile(rank=i, device_type=f"T{i}", mbs=max(t), points=[ProfilePoint(b, s) for b, s in t.items()])
             for i, t in enumerate(times)]
    return Profile(zero_stage=stage, world_size=len(ranks), param_count=10, param_bytes=40, ranks=ranks,
                   comm=CommProfile(Links(bandwidth_bytes_per_s=1e9)))


def test_a_probe_at_mbs_replaces_the_plain_points_from_its_batch_up() -> None:
    plain = _profile([{1: 0.1, 2: 0.15, 4: 0.25}, {1: 0.2, 2: 0.3}])
    probe = _profile([{12: 0.5}, {2: 0.4}])
    base = with_probe(plain, probe)
    assert [(p.batch, p.compute_s) for p in base.ranks[0].points] == [(1, 0.1), (2, 0.15), (4, 0.25), (12, 0.5)]
    assert [(p.batch, p.compute_s) for p in base.ranks[1].points] == [(1, 0.2), (2, 0.4)]
    est = estimate_profile(base, 1, [16, 2])
    first = {p.batch: p.compute_s for p in est.ranks[0].points}
    # beyond the probe: from its point on, the smallest measured cost per added sample (4 -> 12)
    assert first[16] == pytest.approx(0.5 + 4 * (0.5 - 0.25) / 8)
    assert est.ranks[1].mbs == 2 and est.zero_stage == 1


def test_the_estimate_beyond_the_measured_batches_is_a_lower_bound_on_an_affine_curve() -> None:
    # a GPU-like curve, t(b) = 0.1 + 0.05 b, measured at 1 and 2 only: its speed keeps growing
    base = _profile([{1: 0.15, 2: 0.2}])
    est = {p.batch: p.compute_s for p in estimate_profile(base, 0, [8]).ranks[0].points}
    assert est[8] == pytest.approx(0.1 + 0.05 * 8)  # keeping the speed of batch 2 would say 0.8
    assert optimistic_time(base.ranks[0].points, 1) == pytest.approx(0.1)  # never slower than the best speed
