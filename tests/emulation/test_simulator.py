"""The simulator: strategies compared on preset clusters and on profiles; the CLI commands."""

import json

import pytest

from poplar.cli import main
from poplar.emulation.cluster import ClusterSpec
from poplar.types.plans import Plan
from poplar.emulation import simulate
from poplar.emulation.synthetic import REFERENCE_MODEL, ModelSpec, synthetic_profile


@pytest.mark.parametrize("cluster", ["A", "B", "C", "C-1:3", "D"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_poplar_predicts_at_least_the_baselines(cluster, stage):
    for gbs in (64, 250, 1024):
        sim = simulate(cluster, gbs, stage)
        mine = sim.result("poplar").samples_per_s
        for other in ("even", "flops"):
            assert mine >= sim.result(other).samples_per_s * (1 - 1e-9), (gbs, other)
        for r in sim.results:
            assert r.plan.global_batch_size == gbs and len(r.idle_pct()) == sim.result("even").plan.world_size
            assert all(-1e-6 <= x < 100 for x in r.idle_pct())


def test_heterogeneity_pays_off_where_expected():
    # B: same memory, ~3x speed gap; even runs at the T4's pace, poplar shifts work to the V100s
    assert simulate("B", 256, 0).speedup("poplar") > 1.5
    # A: same FLOPS rating, so Whale-like shares are the even ones
    a = simulate("A", 256, 0)
    assert a.result("flops").samples_per_s == pytest.approx(a.result("even").samples_per_s, rel=1e-3)


def test_table_and_json(tmp_path):
    sim = simulate("C", 256, 2)
    text = sim.table()
    for word in ("poplar", "even", "flops", "samples/s", "idle%", "A800-80G", "V100S-32G"):
        assert word in text
    assert len(text.splitlines()) == 2 + 3 + 2 + 4
    path = tmp_path / "sim.json"
    sim.save(path)
    data = json.loads(path.read_text())
    assert [r["strategy"] for r in data["results"]] == ["poplar", "even", "flops"]
    assert Plan.from_dict(data["results"][0]["plan"]).to_dict() == sim.result("poplar").plan.to_dict()


def test_profile_cluster_and_file_sources_agree(tmp_path):
    by_name = simulate("B", 100, 3)
    prof = synthetic_profile("B", 3)
    by_profile = simulate(prof, 100)
    path = tmp_path / "p.json"
    prof.save(path)
    by_file = simulate(str(path), 100)
    cpath = tmp_path / "b.json"
    ClusterSpec.builtin("B").save(cpath)
    by_cluster_file = simulate(str(cpath), 100, 3)
    want = [r.iteration_s for r in by_name.results]
    for sim in (by_profile, by_file, by_cluster_file):
        assert [r.iteration_s for r in sim.results] == pytest.approx(want)


def test_what_if_more_devices():
    base = {"name": "x", "devices": [{"type": "V100-16G", "count": 2}]}
    more = {"name": "y", "devices": [{"type": "V100-16G", "count": 2}, {"type": "T4-16G", "count": 4}]}
    before = simulate(base, 512, 0).result("poplar").samples_per_s
    after = simulate(more, 512, 0).result("poplar").samples_per_s
    assert after > before


def test_synthetic_profile_memory_model():
    p0, p3 = synthetic_profile("C", 0), synthetic_profile("C", 3)
    mbs0 = {r.device_type: r.mbs for r in p0.ranks}
    assert mbs0["A800-80G"] > mbs0["V100S-32G"]
    assert all(r3.mbs >= r0.mbs for r0, r3 in zip(p0.ranks, p3.ranks))
    assert all(r.nominal_tflops for r in p0.ranks) and p0.param_bytes == REFERENCE_MODEL.param_bytes
    huge = ModelSpec("huge", 6_000_000_000, 1 << 30)
    with pytest.raises(ValueError, match="does not fit on"):
        synthetic_profile("B", 0, huge)
    assert synthetic_profile("A", 3, huge).world_size == 4  # ZeRO-3 shards it


def test_cli_plan_and_simulate(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    synthetic_profile("D", 2).save(prof)
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(prof), "--gbs", "300", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted" in text and "RTX3060-12G" in text
    plan = Plan.load(out)
    assert plan.global_batch_size == 300 and plan.strategy == "poplar" and plan.zero_stage == 2
    assert main(["plan", "--profile", str(prof), "--gbs", "300", "--strategy", "even", "--stage", "3"]) == 0
    assert "strategy even, ZeRO-3" in capsys.readouterr().out
    sim = tmp_path / "sim.json"
    assert main(["simulate", "--cluster", "B", "--gbs", "128", "--stage", "1", "--json", str(sim)]) == 0
    assert "vs even" in capsys.readouterr().out and json.loads(sim.read_text())["zero_stage"] == 1
    assert main(["simulate", "--profile", str(prof), "--gbs", "64", "--strategies", "poplar,even"]) == 0
    assert "flops" not in capsys.readouterr().out
