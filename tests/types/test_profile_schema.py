"""Profiles on disk carry a schema version: a profile written before the typed records (schema
1, flat ``exposed_*`` fields and a ``meta`` dict) is converted, one of an unknown schema is refused
naming the file, and a profile written now reads back as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from poplar.planner import plan
from poplar.types.profiles import PROFILE_SCHEMA, Profile, ProfileError

OLD = Path(__file__).parent / "data" / "profile_schema1.json"  # written by the profiler's schema-1 format


def test_a_schema_1_profile_is_converted_field_by_field() -> None:
    raw = json.loads(OLD.read_text())
    got = Profile.load(OLD)
    c, x = raw["comm"], got.comm.exposure
    assert (got.comm.links.bandwidth_bytes_per_s, got.comm.links.latency_s, got.comm.links.backend) == \
        (c["bandwidth_bytes_per_s"], c["latency_s"], c["backend"])
    assert (x.micro_step_s, x.iteration_s, x.switch_s, x.overhead_s, x.error) == \
        (c["exposed_micro_step_s"], c["exposed_iteration_s"], c["exposed_switch_s"], c["iteration_overhead_s"],
         c["exposed_error"])
    assert list(x.step_compute_s) == c["exposed_step_compute_s"] and list(x.step_s) == c["exposed_step_s"]
    assert x.per_leader("micro_step_s") == c["exposed_micro_step_lead_s"]
    assert x.per_leader("iteration_s") == c["exposed_iteration_lead_s"]
    assert x.per_leader("small_lead") == c["exposed_small_lead"]
    assert x.per_leader("micro_step_small_lead_s") == c["exposed_micro_step_small_lead_s"]
    assert x.per_leader("iteration_small_lead_s") == c["exposed_iteration_small_lead_s"]
    meta = raw["meta"]
    emulated = got.provenance.emulated
    assert got.provenance.schema_version == 1 and emulated is not None
    assert (emulated.memory_scale, emulated.time_scale, emulated.cluster) == \
        (meta["memory_scale"], meta["time_scale"], meta["cluster"]["name"])
    assert got.measurement.requested_stage == meta["requested_stage"] and got.measurement.seconds == meta["seconds"]
    assert got.precision == "fp32" and not got.activation_checkpointing
    assert got.ranks[1].offload_cost is not None and got.ranks[1].points_past_mbs[0].batch == 6
    assert plan(got, 16).global_batch_size == 16


def test_a_converted_profile_is_written_at_this_schema(tmp_path: Path) -> None:
    again = tmp_path / "profile.json"
    Profile.load(OLD).save(again)
    d = json.loads(again.read_text())
    assert d["schema_version"] == PROFILE_SCHEMA and "meta" not in d and "exposed_micro_step_s" not in d["comm"]
    assert Profile.load(again) == Profile.load(OLD)


def test_an_unknown_schema_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "future.json"
    d = Profile.load(OLD).to_dict()
    d["schema_version"] = PROFILE_SCHEMA + 1
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=f"profile file {path} has profile schema {PROFILE_SCHEMA + 1}.*"
                                           "profile the cluster again"):
        Profile.load(path)


def test_a_schema_1_profile_that_cannot_be_converted_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    shutil.copy(OLD, path)
    d = json.loads(path.read_text())
    del d["meta"]["memory_scale"]  # emulated, but at no scale
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=f"malformed profile file {path} \\(schema 1\\).*memory_scale.*"
                                           "profile the cluster again"):
        Profile.load(path)
