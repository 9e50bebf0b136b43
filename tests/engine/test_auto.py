"""Auto mode: the engine profiles an emulated cluster, plans and trains; bad set-ups fail on
every rank with the reason."""

from __future__ import annotations

import pytest

import json
from dataclasses import replace
from pathlib import Path

import torch

import poplar
from poplar.auto import AutoOptions, clone_optimizer
from poplar.emulation import cluster_device
from poplar.emulation.cluster import ClusterSpec
from poplar.engine import PoplarEngine
from poplar.process.launch import spawn
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.planner import plan as make_plan
from poplar.train import ReportOptions
from poplar.types.plans import Plan
from poplar.types.profiles import Profile
from poplar.workloads.text import TextBlocks

PAIR = ClusterSpec("pair", [{"type": "V100-16G", "count": 1}, {"type": "T4-16G", "count": 1}])
GBS = 24


def _parts(seed: int = 0) -> tuple:
    data = TextBlocks(seq_len=16)
    model = create_model("llama-tiny", seed=seed, max_seq_len=16)
    return data, model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def auto_rank(rank: int, world: int, tmp: str) -> dict:
    data, model, opt = _parts()
    engine = PoplarEngine(model, opt, zero_stage=1, global_batch_size=GBS, loss_fn=llama_loss_fn,
                          auto=AutoOptions(profile_data=data, device=cluster_device(PAIR), repeats=1, exposure_precision=0,
                                           profile_output=f"{tmp}/profile.json", progress=False))
    planned = engine.plan.to_dict()  # auto mode's plan (a drifting rank may get a new one during fit)
    fit = poplar.fit(engine, data, 3, report=ReportOptions(log_every=0, progress=False))
    out = {"plan": planned, "profile": engine.profile.to_dict(), "losses": fit.losses,
           "device": engine.device.describe(), "stage": engine.zero_stage, "fit_ranks": len(fit.ranks)}
    engine.close()
    # a second engine reuses the saved profile: no profiling, the same plan, the same emulated device
    data, model, opt = _parts()
    again = PoplarEngine(model, opt, zero_stage=1, global_batch_size=GBS, loss_fn=llama_loss_fn,
                         auto=AutoOptions(device=cluster_device(PAIR), profile=f"{tmp}/profile.json", progress=False))
    out["reused_plan"] = again.plan.to_dict()
    out["reused_device"] = again.device.describe()
    again.close()
    return out


@pytest.mark.multiprocess
def test_auto_mode_profiles_plans_and_trains(tmp_path: Path) -> None:
    results = spawn(auto_rank, 2, (str(tmp_path),), timeout_s=240, collective_timeout_s=120)
    r0, r1 = results
    profile = Profile.from_dict(r0["profile"])
    assert r0["plan"] == r1["plan"] and r0["profile"] == r1["profile"]
    assert [r.device_type for r in profile.ranks] == ["V100-16G", "T4-16G"]
    assert profile.provenance.emulated is not None and profile.provenance.emulated.memory_scale > 0
    plan = Plan.from_dict(json.loads(json.dumps(r0["plan"])))  # a copy: its choice is cleared below
    assert plan.global_batch_size == GBS and plan.strategy == "poplar" and plan.zero_stage == r0["stage"] >= 1
    chosen = [r for r in plan.choice.candidates if r.chosen]  # auto mode's choice, recorded
    assert len(chosen) == 1 and chosen[0].stage == plan.zero_stage and plan.choice.choice_rule == "fastest"
    assert plan.choice.profiling_s["capacity_s"] > 0
    plan.choice = replace(plan.choice, candidates=None, choice_rule=None, profiling_s=None)
    # what the planner says, shard weights chosen with the batches (auto mode's default)
    assert plan.to_dict() == make_plan(profile, GBS, plan.zero_stage, shards="auto").to_dict()
    assert plan.ranks[0].num_samples > plan.ranks[1].num_samples  # the V100 is ~3x the T4
    for rank, row in enumerate(plan.ranks):
        assert row.micro_batch_size <= profile.ranks[rank].mbs
    # each rank measured its share of the sharded state, so the planner can price shard weights;
    # two 16 GB cards have the same room: even shards stay
    assert all(r.shard_bytes and r.shard_bytes > 0 for r in profile.ranks) and plan.even_shards
    assert plan.choice.shard_candidates[0].name == "even"
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 3 and all(x == x for x in r0["losses"])
    assert r0["device"]["device_type"] == "V100-16G" and r1["device"]["device_type"] == "T4-16G"
    assert r0["fit_ranks"] == 2
    assert json.loads((tmp_path / "profile.json").read_text())["world_size"] == 2
    assert r0["reused_plan"] == r0["plan"] and r1["reused_plan"] == r1["plan"]
    assert r1["reused_device"]["capacity_bytes"] == r1["device"]["capacity_bytes"]


CASES = {
    "no_device": "pass AutoOptions(device=...)",
    "cluster_size": "has 3 devices",
    "no_loss": "auto mode needs loss_fn",
    "no_data": "rank 1: auto mode needs AutoOptions(profile_data=...)",
    "bad_gbs": "global_batch_size must be an int >= 1",
}


def bad_auto(rank: int, world: int) -> dict[str, str]:
    """Every case in one process group: each failure is agreed on, so the group stays usable."""
    seen = {}
    for case in CASES:
        data, model, opt = _parts()
        auto = {"profile_data": data, "device": cluster_device(PAIR), "progress": False}
        kwargs = {"global_batch_size": GBS, "loss_fn": llama_loss_fn}
        if case == "no_device":
            auto.pop("device")
        elif case == "cluster_size":
            auto["device"] = cluster_device(ClusterSpec("three", [{"type": "T4-16G", "count": 3}]))
        elif case == "no_loss":
            kwargs.pop("loss_fn")
        elif case == "no_data" and rank == 1:
            auto.pop("profile_data")
        elif case == "bad_gbs":
            kwargs["global_batch_size"] = 0
        kwargs["auto"] = AutoOptions(**auto)
        try:
            PoplarEngine(model, opt, **kwargs)
            seen[case] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
            seen[case] = f"{type(e).__name__}: {e}"
    return seen


@pytest.mark.multiprocess
def test_auto_mode_bad_setup_fails_on_every_rank() -> None:
    for rank, seen in enumerate(spawn(bad_auto, 2, timeout_s=90, collective_timeout_s=30)):
        for case, needle in CASES.items():
            assert needle in seen[case], (rank, case, seen[case])


def set_plan_rank(rank: int, world: int) -> list[str]:
    data, model, opt = _parts()
    engine = PoplarEngine(model, opt, zero_stage=2, plan=Plan.even(2, 8, 2), loss_fn=llama_loss_fn)
    out = []
    for new in (Plan.even(2, 8, 4), Plan.even(2, 8, 4) if rank == 0 else Plan.even(2, 8, 1)):
        try:
            engine.set_plan(new)
            engine.train_step(data[0].expand(4, -1).clone())  # the new plan's 4 samples
            out.append(f"ok {engine.rank_plan.micro_batch_size} {engine.iteration}")
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.multiprocess
def test_set_plan_switches_together_or_fails_on_every_rank() -> None:
    for same, differ in spawn(set_plan_rank, 2, timeout_s=60, collective_timeout_s=20):
        assert same == "ok 4 1"
        assert differ.startswith("DistributedError") and "different plans" in differ


def test_clone_optimizer_keeps_groups_and_settings() -> None:
    model = create_model("llama-tiny")
    mats = [p for p in model.parameters() if p.dim() > 1]
    vecs = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.SGD([{"params": mats, "lr": 0.5}, {"params": vecs, "momentum": 0.5}], lr=0.1, momentum=0.9)
    copy = create_model("llama-tiny")
    twin = clone_optimizer(opt, copy, model)
    assert type(twin) is torch.optim.SGD and len(twin.param_groups) == 2
    assert twin.param_groups[0]["lr"] == 0.5 and twin.param_groups[1]["lr"] == 0.1
    assert twin.param_groups[1]["momentum"] == 0.5 and twin.param_groups[0]["momentum"] == 0.9
    owned = {id(p) for p in copy.parameters()}
    assert all(id(p) in owned for g in twin.param_groups for p in g["params"])
    assert len(twin.param_groups[0]["params"]) == len(mats)
