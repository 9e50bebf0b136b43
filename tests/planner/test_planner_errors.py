"""Bad input gives a clear error that names the problem and the fix."""

import json

import pytest

from poplar.cli import main
from poplar.types.plans import PlanError
from poplar.planner import plan
from poplar.emulation.synthetic import synthetic_profile
from poplar.types.profiles import ProfileError


@pytest.fixture
def profile():
    return synthetic_profile("B", 2)


@pytest.mark.parametrize("gbs", [0, -3, 2.5, True, "8", None])
def test_bad_global_batch(profile, gbs):
    with pytest.raises(PlanError, match="global_batch_size"):
        plan(profile, gbs, 2)


def test_gbs_smaller_than_the_ranks_that_must_take_part(profile):
    with pytest.raises(PlanError, match="smaller than the 4 ranks"):
        plan(profile, 3, 2, require_all_ranks=True)
    p = plan(profile, 3, 2)  # by default a rank may sit out (it joins collectives with zeros)
    assert p.global_batch_size == 3 and sum(r.num_samples == 0 for r in p.ranks) >= 1


def test_gbs_that_cannot_be_met_within_memory(profile):
    most = 2 * sum(r.mbs for r in profile.ranks)
    assert plan(profile, most, 2, max_micro_steps=2).max_micro_steps <= 2
    with pytest.raises(PlanError, match="cannot be met within memory"):
        plan(profile, most + 1, 2, max_micro_steps=2)
    with pytest.raises(PlanError, match="max_micro_steps"):
        plan(profile, 10, 2, max_micro_steps=0)


def test_stage_and_strategy(profile):
    with pytest.raises(PlanError, match="zero_stage"):
        plan(profile, 8, 4)
    with pytest.raises(PlanError, match="measured at ZeRO-2"):
        plan(profile, 8, 1)  # a stage-2 mbs may not fit at stage 1
    assert plan(profile, 8, 3).zero_stage == 3  # a higher stage is safe
    with pytest.raises(PlanError, match="unknown strategy"):
        plan(profile, 8, 2, "fastest")


def test_flops_needs_nominal_tflops(profile):
    d = profile.to_dict()
    for r in d["ranks"]:
        if r["device_type"] == "T4-16G":
            r["nominal_tflops"] = None
    with pytest.raises(PlanError, match="T4-16G"):
        plan(d, 8, 2, "flops")
    assert plan(d, 8, 2, "poplar").global_batch_size == 8  # poplar never reads FLOPS


def test_empty_and_malformed_profiles(profile, tmp_path):
    d = profile.to_dict()
    with pytest.raises(ProfileError, match="no ranks"):
        plan({**d, "ranks": [], "world_size": 0}, 8, 2)
    with pytest.raises(ProfileError, match="malformed"):
        plan({k: v for k, v in d.items() if k != "comm"}, 8, 2)
    bad = json.loads(json.dumps(d))
    bad["ranks"][0]["points"] = []
    with pytest.raises(ProfileError, match="no timed points"):
        plan(bad, 8, 2)
    bad = json.loads(json.dumps(d))
    bad["ranks"][1]["rank"] = 0
    with pytest.raises(ProfileError, match="once each"):
        plan(bad, 8, 2)
    bad = json.loads(json.dumps(d))
    bad["ranks"][0]["points"][0]["compute_s"] = float("inf")
    with pytest.raises(ProfileError, match="finite"):
        plan(bad, 8, 2)
    with pytest.raises(ProfileError, match="expected a Profile"):
        plan([1, 2], 8, 2)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="JSON object"):
        plan(listed, 8, 2)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        plan(broken, 8, 2)
    with pytest.raises(ProfileError, match="does not exist"):
        plan(tmp_path / "missing.json", 8, 2)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(ProfileError):
        plan(str(empty), 8, 2)


def test_cli_reports_errors(tmp_path, capsys):
    assert main(["plan", "--profile", str(tmp_path / "none.json"), "--gbs", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = tmp_path / "p.json"
    synthetic_profile("B", 0).save(path)
    assert main(["plan", "--profile", str(path), "--gbs", "0"]) == 2
    assert "global_batch_size" in capsys.readouterr().err
    assert main(["simulate", "--cluster", "Z", "--gbs", "8", "--stage", "0"]) == 2
    assert "built-in" in capsys.readouterr().err
    assert main(["simulate", "--cluster", "B", "--gbs", "8"]) == 2
    assert "needs --stage" in capsys.readouterr().err
