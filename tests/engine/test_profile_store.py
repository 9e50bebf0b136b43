"""The profile store: entries per device type keyed by what a profile depends on; a start that
finds every type reuses them without profiling, one that finds some profiles only the new types."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from poplar.auto import AutoOptions, DatasetSamples
from poplar.auto.stored import StoreUse, model_fingerprint, store_key
from poplar.process.launch import spawn
from poplar.emulation import cluster_device
from poplar.emulation.cluster import ClusterSpec
from poplar.engine import PoplarEngine
from poplar.planner import plan as make_plan
from poplar.profiler.store import ProfileStore, StoreKey, assemble
from poplar.types.profiles import (PROFILE_SCHEMA, CommProfile, Emulated, Exposure, LedExposure, Links, LinkSpeed,
                                   Profile, ProfilePoint, Provenance, RankProfile, StoreRecord)
from poplar.types.topology import Topology
from poplar.workloads.models import create_model, llama_loss_fn
from poplar.workloads.text import TextBlocks

KEY = StoreKey(model="m", structure="s", config="", zero_stage=1, stages=(0, 1, 2, 3), checkpointing="auto",
               rule="fastest", precision="fp32", sample="[[16], 'torch.int64']", bucket_size_mb=25.0,
               torch_version="2.0")


def _profile(types: list[str], stage: int = 1) -> Profile:
    ranks = [RankProfile(r, t, mbs=4 + r, points=[ProfilePoint(1, 0.01 * (r + 1)), ProfilePoint(4, 0.03 * (r + 1))],
                         device_identity=f"{t}, 16 bytes") for r, t in enumerate(types)]
    leaders = tuple(LedExposure(t, iteration_s=0.01) for t in dict.fromkeys(types))
    comm = CommProfile(Links(1e9, 1e-5, "gloo"), exposure=Exposure(leaders=leaders))
    emulated = Emulated(memory_scale=0.1, time_scale=2.0, cluster="x")
    return Profile(stage, len(types), 1000, 4000, ranks, comm, "m", provenance=Provenance(emulated=emulated))


def test_store_hit_miss_and_keying(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    assert store.lookup(KEY, ["V100-16G"]) == {}  # miss: nothing stored
    store.save(_profile(["V100-16G", "V100-16G", "T4-16G"]), KEY, checkpointed=False)
    found = store.lookup(KEY, ["T4-16G", "V100-16G"])
    assert sorted(found) == ["T4-16G", "V100-16G"] and found["T4-16G"].rank.mbs == 6
    assert found["V100-16G"].cluster == ["V100-16G", "V100-16G", "T4-16G"]
    # every part of the key matters: another precision, stage, sample shape or version misses
    for change in ({"precision": "bf16"}, {"zero_stage": 2}, {"sample": "[[32]]"}, {"torch_version": "2.1"},
                   {"checkpointing": "on"}, {"model": "other"}, {"structure": "t"}, {"config": "c"}):
        assert ProfileStore(tmp_path).lookup(replace(KEY, **change), ["V100-16G", "T4-16G"]) == {}
    # a stale entry is no hit; a corrupt file is ignored with a warning
    assert ProfileStore(tmp_path, max_age_s=0.0).lookup(KEY, ["T4-16G"]) == {}
    assert list(ProfileStore(tmp_path, max_age_s=3600.0).lookup(KEY, ["T4-16G"])) == ["T4-16G"]
    store.path(KEY, "T4-16G").write_text("{not json")
    again = ProfileStore(tmp_path)
    assert list(again.lookup(KEY, ["T4-16G", "V100-16G"])) == ["V100-16G"]
    assert again.warnings[0].startswith(f"profile store: skipping an entry: stored profile {store.path(KEY, 'T4-16G')} "
                                        "is not JSON")


def test_assemble_for_another_mix(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    store.save(_profile(["V100-16G", "T4-16G"]), KEY, checkpointed=False)
    entries = store.lookup(KEY, ["T4-16G", "V100-16G"])
    profile = assemble(entries, ["T4-16G", "T4-16G", "T4-16G", "V100-16G"])
    assert profile.world_size == 4 and [r.rank for r in profile.ranks] == [0, 1, 2, 3]
    assert [r.mbs for r in profile.ranks] == [5, 5, 5, 4]  # each rank has its type's stored part
    assert profile.store.comm_from == ["V100-16G", "T4-16G"] and profile.provenance.emulated.memory_scale == 0.1
    assert profile.provenance.emulated.cluster == ""  # the storing run's cluster is not this mix
    only_t4 = assemble(entries, ["T4-16G", "T4-16G"])
    assert only_t4.comm.exposure.per_leader("iteration_s") == {"T4-16G": 0.01}  # V100-led exposure does not apply
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


def test_every_bucket_that_holds_the_whole_model_has_one_key() -> None:
    """A bucket as large as the model runs the job a larger one runs (one bucket); a smaller one
    cuts the gradients and is another job."""
    model = create_model("llama-tiny", max_seq_len=16)
    opt = torch.optim.AdamW(model.parameters())
    model_mb = sum(p.numel() for p in model.parameters()) * 4 / 2 ** 20
    samples = DatasetSamples(TextBlocks(seq_len=16))

    def key(bucket_mb: float) -> str:
        return store_key(model, opt, samples, policy=None, zero_stage=2, stages=(2,), checkpointing=None,
                         rule="fastest", bucket_size_mb=bucket_mb).digest()

    assert key(25.0) == key(6.25) == key(model_mb) != key(model_mb / 2) != key(model_mb / 4)


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
    assert new.store == StoreRecord(reused=["V100-16G"], profiled=["A100-40G"])
    assert vars(new.ranks[0])["points"] == vars(first.ranks[0])["points"] and new.ranks[0].mbs == first.ranks[0].mbs
    assert r0["new"]["trial_steps"] == 0 and r1["new"]["trial_steps"] > 0
    assert new.ranks[1].mbs > first.ranks[1].mbs  # an A100-40G holds more than a T4-16G
    assert new.provenance.emulated.memory_scale == first.provenance.emulated.memory_scale  # at the stored scales
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
    assert mixed.store == StoreRecord(reused=["roomy"], profiled=["short"])
    short = mixed.ranks[1]
    assert short.points_past_mbs and all(p.batch > short.mbs for p in short.points_past_mbs)
    assert mixed.measurement.past_mbs.batches[1] == [p.batch for p in short.points_past_mbs]


# ---------------------------------------------------------------- the store as a cache (what it keys on, what it skips)

def _key_of(model: torch.nn.Module) -> StoreKey:
    return store_key(model, torch.optim.AdamW(model.parameters()), lambda b: torch.zeros(b, 16, dtype=torch.long),
                     zero_stage=2, stages=(2,), checkpointing=None, rule="single", bucket_size_mb=25.0, policy=None)


def test_a_model_whose_heads_change_but_not_its_shapes_gets_another_key() -> None:
    """A GPT-2 of 32 heads and eager attention has the parameter shapes of one of 2 heads, but
    not its activation memory: the store must not take one's profile for the other's."""
    transformers = pytest.importorskip("transformers")

    def gpt2(heads: int, attention: str | None = None) -> torch.nn.Module:
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=heads, n_positions=128, vocab_size=128)
        if attention is not None:
            config._attn_implementation = attention
        return transformers.GPT2LMHeadModel(config)

    two, many = gpt2(2), gpt2(32, "eager")
    opt = torch.optim.AdamW(two.parameters())
    assert model_fingerprint(two, opt) == model_fingerprint(many, opt)  # the same shapes
    assert _key_of(two).config != _key_of(many).config and _key_of(two).digest() != _key_of(many).digest()
    assert _key_of(gpt2(2)).digest() == _key_of(two).digest()  # another copy of the same model: the same key
    assert _key_of(gpt2(2, "eager")).digest() != _key_of(two).digest()  # the attention kernel alone


class _Configured(torch.nn.Module):
    """A model with a plain configuration object and its activation as a module."""

    def __init__(self, heads: int, activation: type[torch.nn.Module] = torch.nn.ReLU) -> None:
        super().__init__()
        self.config = {"heads": heads}
        self.body = torch.nn.Sequential(torch.nn.Embedding(128, 8), torch.nn.Linear(8, 8), activation())


def test_a_models_configuration_and_module_classes_are_in_the_key() -> None:
    base = _key_of(_Configured(2))
    assert _key_of(_Configured(2)).digest() == base.digest()
    assert _key_of(_Configured(32)).config != base.config  # the same parameters, another configuration
    assert _key_of(_Configured(2, torch.nn.GELU)).structure != base.structure  # the same parameters, another module
    assert base.torch_version == torch.__version__


def test_an_entry_of_another_schema_is_measured_again_with_a_line_saying_why(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    store.save(_profile(["V100-16G", "T4-16G"]), KEY, checkpointed=False)
    path = store.path(KEY, "T4-16G")
    old = json.loads(path.read_text())
    old["schema_version"] = PROFILE_SCHEMA - 1
    path.write_text(json.dumps(old))
    again = ProfileStore(tmp_path)
    assert list(again.lookup(KEY, ["V100-16G", "T4-16G"])) == ["V100-16G"]
    assert again.warnings == [] and again.take_misses() == {
        "T4-16G": f"its entry {path} was written by profile schema {PROFILE_SCHEMA - 1}, this Poplar's is {PROFILE_SCHEMA}"}
    del old["schema_version"]  # an entry from before schema versions (its "format": 1)
    path.write_text(json.dumps(old))
    assert list(again.lookup(KEY, ["T4-16G"])) == [] and "written by profile schema 1," in again.misses["T4-16G"]
    old["schema_version"] = str(PROFILE_SCHEMA)  # text, not a number: a bad field, said as such
    path.write_text(json.dumps(old))
    assert list(again.lookup(KEY, ["T4-16G"])) == []
    assert again.warnings == [f"profile store: skipping an entry: stored profile {path} has a bad field: field "
                              f"\"schema_version\" must be an integer (the profile schema that wrote it), got "
                              f"'{PROFILE_SCHEMA}' (str)"]


def test_an_entry_with_a_bad_field_is_skipped_naming_the_file(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    store.save(_profile(["V100-16G", "T4-16G"]), KEY, checkpointed=False)
    path = store.path(KEY, "T4-16G")
    bad = json.loads(path.read_text())
    bad["rank"]["mbs"] = "5"
    path.write_text(json.dumps(bad))
    again = ProfileStore(tmp_path)
    assert list(again.lookup(KEY, ["V100-16G", "T4-16G"])) == ["V100-16G"]
    assert len(again.warnings) == 1 and str(path) in again.warnings[0]
    assert "ranks[0].mbs must be an integer" in again.warnings[0]


def test_an_entry_measured_on_another_device_of_the_type_is_not_reused(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    store.save(_profile(["V100-16G", "T4-16G"]), KEY, checkpointed=False)
    devices = {"V100-16G": "V100-16G, 16 bytes", "T4-16G": "T4-16G, 8 bytes"}  # a T4 of less memory
    assert list(store.lookup(KEY, ["V100-16G", "T4-16G"], devices)) == ["V100-16G"]
    assert store.misses == {"T4-16G": "its entry was measured on T4-16G, 16 bytes, this job's is T4-16G, 8 bytes"}


@pytest.mark.parametrize("field, value, needle", [
    ("saved_at", "2026-11-28", 'field "saved_at" must be a number (seconds since the epoch), got \'2026-11-28\' (str)'),
    ("cluster", 7, 'field "cluster" must be a non-empty list of device type names, got 7 (int)'),
    ("cluster", ["V100-16G"], 'field "cluster" must list the device type of every rank of the run that stored the '
                              "entry, 'T4-16G' among them"),
    ("activation_checkpointing", "yes", 'field "activation_checkpointing" must be true or false, got \'yes\' (str)'),
    ("zero_stage", 9, 'field "zero_stage" must be an integer, 0 to 3, got 9'),
    ("device", None, 'field "device" must be a string'),
    ("mixed_precision", [], 'field "mixed_precision" must be an object or null'),
    ("key.zero_stage", "1", 'field "key.zero_stage" must be an integer, got \'1\' (str)'),
    ("key.stages", [1, "2"], 'field "key.stages[1]" must be an integer'),
    ("param_count", True, 'field "param_count" must be an integer, got True (bool)'),
    ("surprise", 1, 'unknown field "surprise"'),
])
def test_every_field_of_an_entry_is_checked_where_it_is_read(tmp_path: Path, field: str, value: Any,
                                                              needle: str) -> None:
    """A bad field skips its entry with one warning naming the file and the field; the job
    profiles that type (a string saved_at once reached the profile's assembly, a TypeError on
    every rank)."""
    store = ProfileStore(tmp_path)
    store.save(_profile(["V100-16G", "T4-16G"]), KEY, checkpointed=False)
    path = store.path(KEY, "T4-16G")
    bad = json.loads(path.read_text())
    head, _, tail = field.partition(".")
    (bad[head] if tail else bad)[tail or head] = value
    path.write_text(json.dumps(bad))
    again = ProfileStore(tmp_path)
    found = again.lookup(KEY, ["V100-16G", "T4-16G"])
    assert list(found) == ["V100-16G"]
    warned = again.take_warnings()
    assert len(warned) == 1 and warned[0].startswith(f"profile store: skipping an entry: stored profile {path} has a "
                                                     f"bad field: {needle}"), warned
    assert again.misses == {"T4-16G": "its entry was skipped (a bad field)"}
    assemble(found, ["V100-16G", "V100-16G"])  # the good entry serves


def test_an_entry_of_a_run_that_spans_nodes_reads_back(tmp_path: Path) -> None:
    """The communication profile of a run on two nodes names its nodes: the entry is checked as
    that run's ranks, not as a run of one (which refused every such entry), and a job of another
    world size assembles from it."""
    two = _profile(["V100-16G", "V100-16G", "T4-16G", "T4-16G"])
    link = LinkSpeed(1e9, 1e-5)
    two.comm = replace(two.comm, links=Links.tiered(Topology.of_sizes([2, 2]), (link, link), LinkSpeed(1e8, 1e-4)))
    store = ProfileStore(tmp_path)
    store.save(two, KEY, checkpointed=False)
    found = ProfileStore(tmp_path).lookup(KEY, ["V100-16G", "T4-16G"])
    assert sorted(found) == ["T4-16G", "V100-16G"] and store.take_warnings() == []
    assert assemble(found, [r.device_type for r in two.ranks]).comm.links == two.comm.links
    # another world (a mix of other sizes, or the stored types alone beside new ones): the stored
    # run's nodes are not its ranks, and its flat ring stands for its collectives
    other = assemble(found, ["T4-16G", "V100-16G"]).comm.links
    assert not other.spans_nodes and other.flat == two.comm.links.flat


def test_a_type_measured_again_is_said_with_what_changed(tmp_path: Path) -> None:
    """The line of a start that profiles a stored type says why: the nearest stored key and what
    differs from the job's (its model fingerprint, each setting with both values), or that
    nothing of the type is stored."""
    store = ProfileStore(tmp_path)
    store.save(_profile(["V100-16G", "T4-16G"]), KEY, checkpointed=False)
    store.save(_profile(["T4-16G"], stage=2), replace(KEY, zero_stage=2, precision="bf16"), checkpointed=False)
    assert store.lookup(replace(KEY, model="other"), ["T4-16G", "A100-40G"]) == {}
    assert store.take_misses() == {
        "T4-16G": "stored for other jobs only, the nearest differs in model fingerprint (parameters, buffers, "
                  "optimizer class)",
        "A100-40G": "nothing stored for this device type"}
    job = replace(KEY, zero_stage=3, precision="bf16", bucket_size_mb=6.25)
    assert store.lookup(job, ["T4-16G"]) == {}
    assert store.take_misses() == {"T4-16G": "stored for other jobs only, the nearest differs in ZeRO stage 2 "
                                             "(this job's 3); bucket MB 25 (this job's 6.25)"}


@pytest.mark.parametrize("where", ["under_a_file", "entry_path_is_a_directory"])
def test_a_store_that_cannot_be_read_or_written_is_a_warning(tmp_path: Path, where: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a regular file")
    if where == "under_a_file":
        store = ProfileStore(blocker / "store")
        assert store.lookup(KEY, ["T4-16G"]) == {}
        assert store.save(_profile(["V100-16G", "T4-16G"]), KEY, checkpointed=False) == []
        assert [w.split(" (")[0] for w in store.take_warnings()] == [
            f"profile store: cannot write {store.path(KEY, t)}" for t in ("V100-16G", "T4-16G")]
    else:  # the entry's path is a directory: no entry to read, and none can be written
        store = ProfileStore(tmp_path / "store")
        store.path(KEY, "T4-16G").mkdir(parents=True)
        assert store.lookup(KEY, ["T4-16G"]) == {} and store.save(_profile(["T4-16G"]), KEY, False) == []
        assert any(f"cannot write {store.path(KEY, 'T4-16G')}" in w for w in store.take_warnings())


def cache_rank(rank: int, world: int, root: str) -> dict:
    """Auto mode with the toy model on two roomy cards: with a store under a regular file, then
    with a store whose entries a profiler of another schema wrote."""
    import logging

    from poplar.emulation import VirtualDevice
    from tests.log_lines import Lines
    from tests.toy import SEQ, VOCAB, make_model

    torch.set_num_threads(1)
    lines, logger = Lines(), logging.getLogger("poplar")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    out = {}
    try:
        for run, store in (("unwritable", Path(root) / "file" / "store"), ("first", Path(root) / "store"),
                           ("stale", Path(root) / "store")):
            if run == "stale" and rank == 0:  # the entries, as a profiler of the schema before wrote them
                for path in (Path(root) / "store").glob("*/*.json"):
                    entry = json.loads(path.read_text())
                    entry["schema_version"] = PROFILE_SCHEMA - 1
                    path.write_text(json.dumps(entry))
            device = VirtualDevice("roomy", CAPACITY["roomy"], time_fn=lambda b: 0.02 + 0.001 * b)
            model = make_model()
            del lines.lines[:]
            engine = _toy_auto_engine(model, device, 8, AutoOptions(max_batch=8, store=str(store)))
            loss = engine.train_step(torch.randint(0, VOCAB, (engine.plan.ranks[rank].num_samples, SEQ + 1)))
            out[run] = {"use": engine.auto_result.store_use, "lines": list(lines.lines), "loss": float(loss)}
            engine.close()
    finally:
        logger.removeHandler(lines)
        logger.level = level
    return out


@pytest.mark.multiprocess
def test_the_store_is_a_cache_the_job_goes_on_without(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a regular file where the store's directory would be")
    r0, r1 = spawn(cache_rank, 2, (str(tmp_path),), timeout_s=300, collective_timeout_s=150)
    said = r0["unwritable"]["lines"]
    assert r0["unwritable"]["use"] is StoreUse.MEASURED
    assert any(line.startswith(f"profile store: cannot write {tmp_path / 'file' / 'store'}") for line in said), said
    assert not any(line.startswith("profile store: kept") for line in said)
    assert r0["first"]["use"] is StoreUse.MEASURED
    assert any("profile store: kept roomy" in x for x in r0["first"]["lines"])
    assert f"profile store {tmp_path / 'store'}: nothing to reuse (roomy: nothing stored for this device type); " \
           "profiling" in r0["first"]["lines"]
    stale = r0["stale"]["lines"]
    assert r0["stale"]["use"] is StoreUse.MEASURED
    why = [x for x in stale if "profile schema" in x]
    assert len(why) == 1 and why[0].startswith(f"profile store {tmp_path / 'store'}: nothing to reuse (roomy: its "
                                               f"entry {tmp_path / 'store'}") and why[0].endswith(
        f"was written by profile schema {PROFILE_SCHEMA - 1}, this Poplar's is {PROFILE_SCHEMA}); profiling"), stale
    assert not any("profile store" in x for run in r1.values() for x in run["lines"])  # said once: rank 0
    assert all(r["loss"] == r["loss"] for r in r0.values())  # every job trained


def _toy_auto_engine(model: torch.nn.Module, device: Any, global_batch_size: int, options: AutoOptions) -> PoplarEngine:
    """The toy model at ZeRO-3 in auto mode on ``device``, with ``options``' store, batch bound and
    shards, profiled at the least cost (one repeat, no steady rounds)."""
    from tests.toy import SEQ, VOCAB, loss_fn

    auto = replace(options, profile_data=lambda b: torch.randint(0, VOCAB, (b, SEQ + 1)), device=device, repeats=1,
                   exposure_precision=0, progress=True)
    return PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), zero_stage=3,
                        global_batch_size=global_batch_size, loss_fn=loss_fn, activation_checkpointing=False, auto=auto)


# ---------------------------------------------------------------- a reused profile is checked by one real step

def check_rank(rank: int, world: int, root: str) -> dict:
    """Auto mode on a roomy and a short card (the toy model at ZeRO-3, even shards): the store
    filled, reused as it is, then reused after the roomy card's entry was made to claim four
    times its mbs."""
    import logging

    from poplar.emulation import VirtualDevice
    from tests.log_lines import Lines
    from tests.toy import SEQ, VOCAB, make_model

    torch.set_num_threads(1)
    lines, logger = Lines(), logging.getLogger("poplar")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.INFO
    types, out = ("roomy", "short"), {}
    try:
        for run in ("first", "right", "lying"):
            if run == "lying" and rank == 0:  # the roomy card's entry says it holds four times what it does
                path = next(Path(root).glob("*/roomy.json"))
                entry = json.loads(path.read_text())
                entry["rank"]["mbs"] *= 4
                path.write_text(json.dumps(entry))
            device = VirtualDevice(types[rank], CAPACITY[types[rank]], time_fn=lambda b: 0.02 + 0.001 * b)
            model = make_model()
            del lines.lines[:]
            engine = _toy_auto_engine(model, device, 64, AutoOptions(max_batch=32, shards="even", store=root))
            row = engine.plan.ranks[rank]
            loss = engine.train_step(torch.randint(0, VOCAB, (row.num_samples, SEQ + 1)))
            out[run] = {"use": engine.auto_result.store_use, "lines": list(lines.lines), "loss": float(loss),
                        "mbs": [r.mbs for r in engine.profile.ranks], "b": [r.micro_batch_size for r in engine.plan.ranks],
                        "trial_steps": engine.profile.ranks[rank].trial_steps}
            engine.close()
    finally:
        logger.removeHandler(lines)
        logger.level = level
    out["stored_mbs"] = json.loads(next(Path(root).glob("*/roomy.json")).read_text())["rank"]["mbs"]
    return out


@pytest.mark.multiprocess
def test_a_reused_profile_that_does_not_fit_a_step_is_measured_again(tmp_path: Path) -> None:
    r0, r1 = spawn(check_rank, 2, (str(tmp_path),), timeout_s=300, collective_timeout_s=150)
    first, right, lying = r0["first"], r0["right"], r0["lying"]
    assert first["use"] is StoreUse.MEASURED and right["use"] is StoreUse.REUSED
    roomy_mbs = first["mbs"][0]
    assert right["mbs"] == first["mbs"] and right["b"] == first["b"]
    assert not any("does not fit" in x for x in right["lines"]) and right["trial_steps"] == first["trial_steps"]
    # the lie: planned past what the roomy card holds, caught by the check step, that type profiled again
    said = [x for x in lying["lines"] if x.startswith("profile store: one step of the plan's largest micro-batch")]
    assert said == ["profile store: one step of the plan's largest micro-batch does not fit on ranks [0] (roomy): "
                    "their stored profiles do not describe this job; profiling roomy again"], lying["lines"]
    assert lying["use"] is StoreUse.PARTIAL and lying["mbs"] == first["mbs"] and lying["b"][0] <= roomy_mbs
    assert r0["lying"]["trial_steps"] > 0 and r1["lying"]["trial_steps"] == 0  # the short card kept its entry
    assert r0["stored_mbs"] == roomy_mbs  # the fresh entry replaced the lie
    for r in (r0, r1):
        assert all(r[run]["loss"] == r[run]["loss"] for run in ("first", "right", "lying"))  # trained: a finite loss
