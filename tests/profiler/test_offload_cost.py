"""What offload costs, as the profiler measures it (``poplar.profiler.offload_cost``), and the
profile field that carries it (``RankProfile.offload_cost``): JSON round trip, old profiles."""

from __future__ import annotations

import pytest
import torch

from poplar.emulation.synthetic import GIB, ModelSpec, synthetic_profile
from poplar.emulation.virtual_device import VirtualDevice
from poplar.profiler.offload_cost import measure_host_step, measure_offload_cost
from poplar.types.profiles import OffloadCost, Profile, ProfileError
from tests.scripted_device import Script, ScriptedClock, ScriptedDevice


def _model() -> torch.nn.Module:
    return torch.nn.Linear(8, 8)


def test_host_step_state_bytes_follow_the_optimizer() -> None:
    model = _model()
    seconds, adam = measure_host_step(torch.optim.AdamW(model.parameters(), lr=1e-3), elements=4096)
    assert seconds > 0 and adam == pytest.approx(8.0, abs=0.01)  # two fp32 moments (and a step counter)
    _, sgd = measure_host_step(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), elements=4096)
    assert sgd == pytest.approx(4.0)
    _, plain = measure_host_step(torch.optim.SGD(model.parameters(), lr=0.1), elements=4096)
    assert plain == 0.0


class StatedLink(ScriptedDevice):
    """A scripted device that states its host link, as an emulated GPU does from its preset."""

    def host_link_bytes_per_s(self) -> float | None:
        return 3e9


def test_a_device_that_states_its_host_link_is_taken_at_its_word() -> None:
    script = Script("stated", 10 ** 9, 0, 1, fixed_s=1.0, per_sample_s=0.1)
    model = _model()
    cost = measure_offload_cost(StatedLink(script, ScriptedClock()), torch.optim.AdamW(model.parameters()),
                                mixed_precision=True)
    assert cost.d2h_bytes_per_s == cost.h2d_bytes_per_s == 3e9  # no copy timed: a timing is never exact
    assert cost.master_bytes_per_element == 4.0 and cost.state_bytes_per_element == pytest.approx(8.0, abs=0.01)
    plain = measure_offload_cost(StatedLink(script, ScriptedClock()), torch.optim.AdamW(model.parameters()),
                                 mixed_precision=False)
    assert plain.master_bytes_per_element == 0.0


def test_a_cpu_device_times_real_copies() -> None:
    plain = VirtualDevice("cpu-like", 1 << 30)  # no preset: no stated link
    assert plain.host_link_bytes_per_s() is None
    cost = measure_offload_cost(plain, torch.optim.SGD(_model().parameters(), lr=0.1), mixed_precision=False)
    assert cost.d2h_bytes_per_s > 1e8 and cost.h2d_bytes_per_s > 1e8  # a memory copy: far above 100 MB/s
    assert cost.master_bytes_per_element == 0.0


def _profile() -> Profile:
    return synthetic_profile("B", 2, ModelSpec("m", int(125e6), 1.0 * GIB))


def test_profile_round_trips_offload_cost_and_old_profiles_load() -> None:
    prof = _profile()
    assert all(r.offload_cost is None for r in prof.ranks)
    old = Profile.from_dict(prof.to_dict())  # written without the field
    assert old.ranks[0].offload_cost is None
    for r in prof.ranks:
        r.offload_cost = OffloadCost(12e9, 13e9, 2e-9, 8.0, 4.0)
    back = Profile.from_dict(prof.to_dict())
    assert back.ranks[1].offload_cost == OffloadCost(12e9, 13e9, 2e-9, 8.0, 4.0)
    d = prof.to_dict()
    d["ranks"][0].pop("offload_cost")  # one rank without it still loads
    assert Profile.from_dict(d).ranks[0].offload_cost is None


def test_bad_offload_cost_is_named() -> None:
    d = _profile().to_dict()
    d["ranks"][1]["offload_cost"] = {"d2h_bytes_per_s": 0, "h2d_bytes_per_s": 1e9, "host_step_s_per_element": 1e-9,
                                     "state_bytes_per_element": 8}
    with pytest.raises(ProfileError, match=r"ranks\[1\].offload_cost"):
        Profile.from_dict(d)
    d["ranks"][1]["offload_cost"] = {"bandwidth": 1}
    with pytest.raises(ProfileError, match="malformed offload_cost"):
        Profile.from_dict(d)


def test_profile_round_trips_the_placement_it_was_measured_at() -> None:
    prof = _profile()
    prof.offloads = ["none", "optimizer", "none", "none"]
    assert Profile.from_dict(prof.to_dict()).offloads == ["none", "optimizer", "none", "none"]
    d = prof.to_dict()
    d["offloads"] = ["none", "cpu", "none", "none"]
    with pytest.raises(ProfileError, match="offloads"):
        Profile.from_dict(d)


def test_the_plan_trial_runs_at_the_plan_s_offload() -> None:
    """The trial that confirms a plan runs its ranks' optimizer where the plan keeps it: a step
    that fits only with AdamW's state in host memory fits there, and not on the device."""
    from poplar.profiler.profile_run import ProfileJob, ProfileOptions, Trial, search_capacity
    from poplar.types.plans import Offload
    from tests.toy import SEQ, VOCAB, loss_fn, make_model

    torch.set_num_threads(1)
    job = ProfileJob(make_model, loss_fn, lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)),
                     optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                     options=ProfileOptions(zero_stage=2))
    fitted = []
    for offloads in (None, (Offload.NONE, Offload.OPTIMIZER)):
        device = VirtualDevice("short", 18_000)  # batch 2 fits at ~16 kB offloaded, ~21 kB not
        device.pad = False
        fitted.append(search_capacity(job, device, world_size=2, rank=1, stage=2, trial=Trial(2, None, offloads)).mbs)
    assert fitted == [0, 2]
