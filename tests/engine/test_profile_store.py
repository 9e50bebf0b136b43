"""The profile store: entries per device type keyed by what a profile depends on; a start that
finds every type reuses them without profiling, one that finds some profiles only the new types."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from poplar.auto import AutoOptions, DatasetSamples
from poplar.auto.stored import StoreUse, model_fingerprint, store_key
from poplar.comm.launch import spawn
from poplar.emulation import cluster_device
from poplar.emulation.cluster import ClusterSpec
from poplar.engine import PoplarEngine
from poplar.planner import plan as make_plan
from poplar.profiler.store import ProfileStore, StoreKey, assemble, entries_of
from poplar.types.profiles import CommProfile, Profile, ProfilePoint, RankProfile
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks

KEY = StoreKey(model="m", zero_stage=1, stages=(0, 1, 2, 3), checkpointing="auto", rule="fastest",
               precision="fp32", sample="[[16], 'torch.int64']", bucket_size_mb=25.0, poplar_version="0.1.0")


def _profile(types: list[str], stage: int = 1) -> Profile:
    ranks = [RankProfile(r, t, mbs=4 + r, points=[ProfilePoint(1, 0.01 * (r + 1)), ProfilePoint(4, 0.03 * (r + 1))])
             for r, t in enumerate(types)]
    comm = CommProfile(1e9, 1e-5, "gloo", exposed_iteration_lead_s={t: 0.01 for t in types})
    return Profile(stage, len(types), 1000, 4000, ranks, comm, "m", {"emulated": True, "memory_scale": 0.1,
                                                                     "time_scale": 2.0, "cluster": {"name": "x"}})


def test_store_hit_miss_and_keying(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    assert store.lookup(KEY, ["V100-16G"]) == {}  # miss: nothing stored
    store.save(_profile(["V100-16G", "V100-16G", "T4-16G"]), KEY, checkpointed=False)
    found = store.lookup(KEY, ["T4-16G", "V100-16G"])
    assert sorted(found) == ["T4-16G", "V100-16G"] and found["T4-16G"].rank.mbs == 6
    assert found["V100-16G"].cluster == ["V100-16G", "V100-16G", "T4-16G"]
    # every part of the key matters: another precision, stage, sample shape or version misses
    for change in ({"precision": "bf16"}, {"zero_stage": 2}, {"sample": "[[32]]"}, {"poplar_version": "0.2.0"},
                   {"checkpointing": "on"}, {"model": "other"}):
        assert ProfileStore(tmp_path).lookup(replace(KEY, **change), ["V100-16G", "T4-16G"]) == {}
    # a stale entry is no hit; a corrupt file is ignored with a warning
    assert ProfileStore(tmp_path, max_age_s=0.0).lookup(KEY, ["T4-16G"]) == {}
    assert list(ProfileStore(tmp_path, max_age_s=3600.0).lookup(KEY, ["T4-16G"])) == ["T4-16G"]
    store.path(KEY, "T4-16G").write_text("{not json")
    again = ProfileStore(tmp_path)
    assert list(again.lookup(KEY, ["T4-16G", "V100-16G"])) == ["V100-16G"]
    assert "ignoring the stored profile" in again.warnings[0]


def test_assemble_for_another_mix(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    store.save(_profile(["V100-16G", "T4-16G"]), KEY, checkpointed=False)
    entries = store.lookup(KEY, ["T4-16G", "V100-16G"])
    profile = assemble(entries, ["T4-16G", "T4-16G", "T4-16G", "V100-16G"])
    assert profile.world_size == 4 and [r.rank for r in profile.ranks] == [0, 1, 2, 3]
    assert [r.mbs for r in profile.ranks] == [5, 5, 5, 4]  # each rank has its type's stored part
    assert profile.meta["store"]["comm_from"] == ["V100-16G", "T4-16G"] and profile.meta["emulated"]
    assert "cluster" not in profile.meta  # the storing run's cluster is not this mix
    only_t4 = assemble(entries, ["T4-16G", "T4-16G"])
    assert only_t4.comm.exposed_iteration_lead_s == {"T4-16G": 0.01}  # V100-led exposure does not apply
    make_plan(profile, 32, profile.zero_stage)  # plannable
    with pytest.raises(Exception, match="missing"):
        assemble(entries, ["A100-80G", "T4-16G"])


def test_key_follows_model_precision_and_sample() -> None:
    model = create_model("llama-tiny", max_seq_len=16)
    opt = torch.optim.AdamW(model.parameters())
    data = TextBlocks(seq_len=16)
    args = {"zero_stage": 1, "stages": (0, 1, 2, 3), "checkpointing": None, "rule": "fastest", "bucket_size_mb": 25.0}
    samples = DatasetSamples(data)
    key = store_key(model, opt, samples, policy=None, **args)
    assert key == store_key(create_model("llama-tiny", max_seq_len=16, seed=3), opt, samples, policy=None,
                            **args)  # the weights do not matter
    assert store_key(model, opt, samples, policy="bf16", **args).digest() != key.digest()
    assert key.precision == "fp32" and key.checkpointing == "auto"
    wider = torch.nn.Linear(4, 5)
    assert model_fingerprint(torch.nn.Linear(4, 4), opt) != model_fingerprint(wider, opt)
    assert model_fingerprint(model, opt) != model_fingerprint(model, torch.optim.SGD(model.parameters(), lr=0.1))
    longer = store_key(model, opt, lambda b: torch.zeros(b, 32, dtype=torch.long), policy=None, **args)
    assert longer.digest() != key.digest()


PAIR = ClusterSpec("pair", [{"type": "V100-16G", "count": 1}, {"type": "T4-16G", "count": 1}])
NEW = ClusterSpec("new", [{"type": "V100-16G", "count": 1}, {"type": "A100-40G", "count": 1}])
GBS = 24


def store_rank(rank: int, world: int, store: str) -> dict:
    torch.set_num_threads(1)
    data = TextBlocks(seq_len=16)
    out = {}
    for run, cluster in (("first", PAIR), ("warm", PAIR), ("new", NEW)):
        model = create_model("llama-tiny", max_seq_len=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = PoplarEngine(model, opt, zero_stage=1, global_batch_size=GBS, loss_fn=llama_loss_fn,
                              auto=AutoOptions(profile_data=data, device=cluster_device(cluster), repeats=1, exposure_precision=0,
                                               choose="first_fit", store=store, progress=False))
        out[run] = {"use": engine.auto_result.store_use, "profile": engine.profile.to_dict(),
                    "plan": engine.plan.to_dict(), "trial_steps": engine.profile.ranks[rank].trial_steps}
        engine.close()
    return out


@pytest.mark.multiprocess
def test_second_start_reuses_and_a_new_type_alone_is_profiled(tmp_path: Path) -> None:
    r0, r1 = spawn(store_rank, 2, (str(tmp_path),), timeout_s=300, collective_timeout_s=150)
    assert r0["first"]["use"] is StoreUse.MEASURED and r0["warm"]["use"] is StoreUse.REUSED
    first, warm = Profile.from_dict(r0["first"]["profile"]), Profile.from_dict(r0["warm"]["profile"])
    assert [r.to_dict() if hasattr(r, "to_dict") else vars(r) for r in warm.ranks] == \
        [vars(r) for r in first.ranks]
    assert r0["warm"]["plan"]["ranks"] == r0["first"]["plan"]["ranks"]
    assert r1["warm"]["plan"] == r0["warm"]["plan"]
    # the new mix: the V100 keeps its stored part, the A100 alone was searched and timed
    assert r0["new"]["use"] is StoreUse.PARTIAL
    new = Profile.from_dict(r0["new"]["profile"])
    assert new.meta["store"] == {"reused": ["V100-16G"], "profiled": ["A100-40G"]}
    assert vars(new.ranks[0])["points"] == vars(first.ranks[0])["points"] and new.ranks[0].mbs == first.ranks[0].mbs
    assert r0["new"]["trial_steps"] == 0 and r1["new"]["trial_steps"] > 0
    assert new.ranks[1].mbs > first.ranks[1].mbs  # an A100-40G holds more than a T4-16G
    assert new.meta["memory_scale"] == first.meta["memory_scale"]  # emulated at the stored scales
    digest = next(tmp_path.iterdir())
    assert sorted(p.name for p in digest.iterdir()) == ["A100-40G.json", "T4-16G.json", "V100-16G.json"]
    assert json.loads((digest / "A100-40G.json").read_text())["cluster"] == ["V100-16G", "A100-40G"]


def test_a_profile_at_uneven_shard_weights_is_not_kept(tmp_path: Path) -> None:
    profile = _profile(["V100-16G", "T4-16G"])
    profile.shard_weights = [2.0, 1.0]
    with pytest.raises(Exception, match="uneven shard weights"):
        ProfileStore(tmp_path).save(profile, KEY, checkpointed=False)
    assert not any(tmp_path.iterdir())


# the toy model at ZeRO-3 on 2 ranks (tests/profiler/test_points_past_mbs.py): the short card fits
# a sample or two at even shards, and far more where shard weights leave it no state
CAPACITY = {"roomy": 60_000, "short": 16_500}


def partial_rank(rank: int, world: int, store: str) -> dict:
    from poplar.emulation import VirtualDevice
    from tests.toy import SEQ, VOCAB, loss_fn, make_model

    torch.set_num_threads(1)
    out = {}
    for run, types in (("first", ("roomy", "roomy")), ("mixed", ("roomy", "short"))):
        device = VirtualDevice(types[rank], CAPACITY[types[rank]], time_fn=lambda b: 0.02 + 0.001 * b)
        model = make_model()
        engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), zero_stage=3,
                              global_batch_size=24, loss_fn=loss_fn, activation_checkpointing=False,
                              auto=AutoOptions(profile_data=lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)),
                                               device=device, repeats=1, max_batch=32, exposure_precision=0,
                                               store=store, progress=False))
        out[run] = {"use": engine.auto_result.store_use, "profile": engine.profile.to_dict()}
        engine.close()
    return out


@pytest.mark.multiprocess
def test_a_new_short_type_is_timed_past_its_mbs_beside_stored_ones(tmp_path: Path) -> None:
    """Profiling only the new device type still times the ranks past their mbs, as a whole
    profile does: the short card's points at the batches planned shards give it."""
    r0, _ = spawn(partial_rank, 2, (str(tmp_path),), timeout_s=300, collective_timeout_s=150)
    assert r0["first"]["use"] is StoreUse.MEASURED and r0["mixed"]["use"] is StoreUse.PARTIAL
    mixed = Profile.from_dict(r0["mixed"]["profile"])
    assert mixed.meta["store"] == {"reused": ["roomy"], "profiled": ["short"]}
    short = mixed.ranks[1]
    assert short.points_past_mbs and all(p.batch > short.mbs for p in short.points_past_mbs)
    assert mixed.meta["points_past_mbs"]["batches"][1] == [p.batch for p in short.points_past_mbs]
