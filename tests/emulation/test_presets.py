"""Device presets and cluster files."""

import json

import pytest
import torch

from poplar.emulation.cluster import BUILTIN_CLUSTERS, ClusterError, ClusterSpec
from poplar.emulation.presets import GIB, PCIE_GEN3_X16, PCIE_GEN4_X16, PRESETS, PresetError, get_preset
from poplar.emulation.virtual_device import VirtualDevice

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
    assert set(BUILTIN_CLUSTERS) == {"A", "B", "C", "C-1:3", "D", "A-4+4", "C-4+4"}
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


# ---------------------------------------------------------------------- precision
NO_BF16 = {"V100-16G", "V100S-32G", "T4-16G"}  # Volta and Turing: no bf16 arithmetic


@pytest.mark.parametrize("name", PAPER_GPUS)
def test_precision_factors_are_sourced_and_speed_up(name):
    from poplar.types.precision import Precision

    p = get_preset(name)
    source = p.precision_speedup.source
    assert "[LP]" in source or "estimate" in source  # measured, or marked as an estimate
    assert p.dtype_factor("fp32") == 1.0 and p.dtype_factor(None) == 1.0
    assert 1.5 < p.dtype_factor("fp16") < 4  # tensor cores: a measured gain, not the 8-16x peak ratio
    assert p.supports("fp16") and p.supports(Precision.FP32)
    assert p.supports("bf16") == (name not in NO_BF16)
    if name not in NO_BF16:  # Ampere / Ada: bf16 runs at the fp16 tensor-core rate
        assert p.dtype_factor(Precision.BF16) == p.dtype_factor("fp16")


@pytest.mark.parametrize("name", PAPER_GPUS)
def test_low_precision_curve_divides_the_throughput_not_the_overhead(name):
    p = get_preset(name)
    f = p.dtype_factor("fp16")
    for b in (1, 8, 64):
        fp32, fp16 = p.time_s(b), p.time_s(b, precision="fp16")
        assert fp16 < fp32
        assert fp16 - p.overhead_s == pytest.approx((fp32 - p.overhead_s) / f)
        assert p.time_s(b, 2.0, "fp16") == pytest.approx(fp16 / 2)
    assert p.speed(10 ** 6, precision="fp16") / p.speed(10 ** 6) == pytest.approx(f, rel=1e-3)  # the peak ratio
    assert p.time_s(0, precision="fp16") == 0


def test_volta_gains_more_than_ampere_from_fp16():
    # no fp32 tensor cores on Volta/Turing; Ampere's "fp32" already uses TF32 ([LP])
    assert get_preset("V100-16G").dtype_factor("fp16") > get_preset("A100-80G").dtype_factor("fp16")
    assert get_preset("T4-16G").dtype_factor("fp16") > get_preset("RTX4090-24G").dtype_factor("fp16")


@pytest.mark.parametrize("name", sorted(NO_BF16))
def test_bf16_on_volta_and_turing_is_refused_with_the_fix(name):
    p = get_preset(name)
    with pytest.raises(PresetError, match=rf"bf16 is not supported on {name}.*Use fp16 instead"):
        p.dtype_factor("bf16")
    with pytest.raises(PresetError, match="compute capability 8.0"):
        p.time_s(4, precision="bf16")


def test_precision_names():
    from poplar.types.precision import MixedPrecision, Precision
    from poplar.types.precision import precision_of

    assert precision_of(None) is Precision.FP32 and precision_of("BF16") is Precision.BF16
    assert precision_of(Precision.FP16) is Precision.FP16
    assert precision_of(MixedPrecision(param_dtype=torch.float16)) is Precision.FP16
    with pytest.raises(ValueError, match="'bf16', 'fp16'"):
        precision_of("int8")


def test_cluster_precision_check_names_devices_and_ranks():
    b = ClusterSpec.builtin("B")
    assert b.unsupported("bf16") == {"V100-16G": [0, 1], "T4-16G": [2, 3]} and b.unsupported("fp16") == {}
    with pytest.raises(ClusterError) as e:
        b.check_precision("bf16")
    message = str(e.value)
    assert "cluster 'B'" in message and "V100-16G (ranks 0, 1)" in message and "T4-16G (ranks 2, 3)" in message
    assert "Use fp16 instead" in message
    b.check_precision("fp16")
    b.check_precision(None)
    ClusterSpec.builtin("A").check_precision("bf16")  # A100s have bf16
    with pytest.raises(ClusterError, match=r"on V100S-32G \(ranks 2, 3\)\D"):
        ClusterSpec.builtin("C").check_precision("bf16")


def test_a_preset_device_states_its_host_link_at_the_emulation_scales():
    """What the profiler's offload cost takes instead of timing copies (``measure_offload_cost``)."""
    assert get_preset("T4-16G").host_link_bytes_per_s == PCIE_GEN3_X16
    for name, link in (("T4-16G", PCIE_GEN3_X16), ("A100-80G", PCIE_GEN4_X16)):
        device = VirtualDevice.from_preset(name, 1e-3, 2.0)
        assert device.host_link_bytes_per_s() == pytest.approx(link * 1e-3 / 2.0)
    assert VirtualDevice("cpu-like", 1 << 30).host_link_bytes_per_s() is None  # no preset: no stated link
