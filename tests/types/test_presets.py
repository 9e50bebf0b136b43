"""Device presets and cluster files."""

import json

import pytest

from poplar.types.cluster import BUILTIN_CLUSTERS, ClusterError, ClusterSpec
from poplar.types.presets import GIB, PRESETS, PresetError, get_preset

PAPER_GPUS = ["A100-80G", "A100-40G", "V100-16G", "T4-16G", "A800-80G", "V100S-32G", "RTX3060-12G", "RTX4090-24G"]


def test_the_papers_gpus_are_there():
    assert set(PAPER_GPUS) <= set(PRESETS)
    for name in PAPER_GPUS:
        p = get_preset(name)
        assert p.name == name and p.memory_gb > 0 and p.nominal_tflops > 0 and p.source


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(PresetError) as e:
        get_preset("H100")
    assert "H100" in str(e.value) and "T4-16G" in str(e.value)


@pytest.mark.parametrize("name", PAPER_GPUS)
def test_speed_rises_then_flattens(name):
    p = get_preset(name)
    speeds = [p.speed(b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert all(a < b for a, b in zip(speeds, speeds[1:]))
    gains = [b - a for a, b in zip(speeds, speeds[1:])]
    assert gains[-1] < gains[0] and speeds[-1] < p.peak_speed
    assert p.time_s(0) == 0 and p.time_s(8, speed_scale=2) == pytest.approx(p.time_s(8) / 2)


def test_speeds_are_measured_not_flops_ratios():
    per_tflop = [get_preset(n).peak_speed / get_preset(n).nominal_tflops for n in PAPER_GPUS]
    assert max(per_tflop) / min(per_tflop) > 2  # e.g. T4 and RTX 4090 vs A100
    assert get_preset("A100-80G").peak_speed > get_preset("A100-40G").peak_speed  # same FLOPS, different speed


def test_memory_scaling():
    p = get_preset("A100-80G")
    assert p.capacity_bytes() == 80 * GIB
    assert p.capacity_bytes(1e-3) == int(80 * GIB * 1e-3)
    with pytest.raises(ValueError):
        p.capacity_bytes(0)


@pytest.mark.parametrize("name", ["A", "B", "C", "C-1:3", "D"])
def test_builtin_clusters(name):
    c = ClusterSpec.builtin(name)
    assert c.name == name and len(c.rank_types()) == c.world_size
    assert c.rank_types() == [d.type for d in c.devices for _ in range(d.count)]
    assert ClusterSpec.from_dict(c.to_dict()) == c


def test_builtin_cluster_contents():
    assert ClusterSpec.builtin("B").rank_types() == ["V100-16G", "V100-16G", "T4-16G", "T4-16G"]
    assert ClusterSpec.builtin("C-1:3").rank_types() == ["A800-80G"] + ["V100S-32G"] * 3
    assert len({d.type for d in ClusterSpec.builtin("D").devices}) == 4
    assert set(BUILTIN_CLUSTERS) == {"A", "B", "C", "C-1:3", "D"}
    with pytest.raises(ClusterError, match="built-in: A, B"):
        ClusterSpec.builtin("E")


def test_cluster_file_round_trip(tmp_path):
    path = tmp_path / "c.json"
    c = ClusterSpec.from_dict({"name": "mine", "devices": [{"type": "T4-16G", "count": 3}]})
    c.save(path)
    again = ClusterSpec.load(path)
    assert again == c and again.rank_types() == ["T4-16G"] * 3
    assert ClusterSpec.resolve(str(path)) == c and ClusterSpec.resolve("B").name == "B"


@pytest.mark.parametrize("data,match", [
    ([1], "JSON object"),
    ({"name": "x"}, "missing key \"devices\""),
    ({"name": "x", "devices": {}}, "must be a list"),
    ({"name": "x", "devices": []}, "lists no devices"),
    ({"name": "x", "devices": [{"type": "T4-16G"}]}, "exactly \"type\" and \"count\""),
    ({"name": "x", "devices": [{"type": "T4-16G", "count": 0}]}, "count >= 1"),
    ({"name": "x", "devices": [{"type": "T4-16G", "count": "2"}]}, "count >= 1"),
    ({"name": "x", "devices": [{"type": "T5", "count": 1}]}, "known presets: A100-80G"),
    ({"name": "x", "devices": [{"type": 7, "count": 1}]}, "preset name"),
    ({"name": "x", "devices": [{"type": "T4-16G", "count": 1}], "gpus": 1}, "unknown keys"),
    ({"name": "x", "devices": [{"type": "T4-16G", "count": 1}], "bandwidth_gbps": 0}, "bandwidth_gbps"),
])
def test_malformed_cluster_files(data, match):
    with pytest.raises(ClusterError, match=match):
        ClusterSpec.from_dict(data)


def test_bad_cluster_paths(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ClusterError, match="not valid JSON"):
        ClusterSpec.load(bad)
    with pytest.raises(ClusterError, match="does not exist"):
        ClusterSpec.load(tmp_path / "none.json")
    with pytest.raises(ClusterError, match="neither a built-in"):
        ClusterSpec.resolve(str(tmp_path / "none.json"))
    assert json.loads(json.dumps(ClusterSpec.builtin("A").to_dict()))["devices"][0]["type"] == "A100-80G"
