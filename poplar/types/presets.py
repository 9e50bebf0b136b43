"""Device presets: the paper's GPUs as data, for the simulator and for emulated (virtual) devices.

Each preset gives a spec-sheet memory and FLOPS rating, and a speed curve for a *reference
workload* (the simulator's reference model, ``poplar.planner.synthetic.REFERENCE_MODEL``):

    time_s(b) = overhead_s + (b + half_batch) / peak_speed      speed(b) = b / time_s(b)

so speed rises with the batch and flattens towards ``peak_speed`` samples/s (it is half of
that, less the overhead, at ``b = half_batch``). ``overhead_s`` is a fixed per-micro-step cost
(launches, hooks); ``half_batch`` is larger on big GPUs, which need bigger batches to fill.

Relative peak speeds come from *measured* training throughput, not from FLOPS ratios (the
``flops`` baseline uses ``nominal_tflops``; Poplar must not). Unit: V100-SXM2-32GB = 1.0, and
``REFERENCE_SAMPLES_PER_S`` samples/s of the reference workload at 1.0. Sources:
[L] Lambda, "Deep Learning GPU Benchmarks", PyTorch training throughput, FP16, BERT-large SQuAD
    fine-tuning (github.com/lambdal/deeplearning-benchmark, pytorch-train-throughput-fp16.csv):
    V100 32GB 49, A100 40GB PCIe 91, A100 40GB SXM4 107, RTX 3090 47, RTX 4090 93 sequences/s.
[D] Dell HPC & AI Innovation Lab, "Deep Learning Performance on T4 GPUs with MLPerf Benchmarks"
    (March 2019): T4 vs V100-PCIe on the same server, MLPerf v0.5 training; the V100-PCIe is
    several times faster on every benchmark. Our 0.28 is a rounded reading of that gap.
[S] NVIDIA spec sheets / architecture whitepapers, dense FP16 Tensor Core TFLOPS with FP32
    accumulate: A100 (40/80 GB, and A800): 312; V100 PCIe 112, V100 SXM2 125, V100S PCIe 130;
    T4 65; RTX 4090 165.2 (Ada whitepaper); RTX 3060 ~25.5 (GA10x whitepaper per-SM rates:
    112 Tensor Cores at 1.78 GHz; GeForce runs FP32-accumulate at half the FP16-accumulate rate).
Where no measurement was found the ratio is an estimate and says so. These are planning
inputs for a simulator, good to tens of percent; measured profiles replace them.

For emulation on CPU, ``capacity_bytes(memory_scale)`` scales the spec memory down so that a
CPU-sized model fills it like a real model fills the real GPU; the device's speed is what the
emulator stretches compute to (optionally times a common ``speed_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30


class PresetError(ValueError):
    """An unknown device preset name."""

REFERENCE_SAMPLES_PER_S = 40.0  # reference workload on a V100-SXM2-32GB (relative speed 1.0)


@dataclass(frozen=True)
class DevicePreset:
    name: str
    memory_gb: float  # spec-sheet memory, GiB
    nominal_tflops: float  # dense FP16 tensor TFLOPS, FP32 accumulate [S]
    relative_speed: float  # measured training throughput, V100-SXM2-32GB = 1.0
    half_batch: float  # batch at which speed reaches half its peak (before overhead)
    overhead_s: float = 0.004  # fixed seconds per micro-step
    source: str = ""

    @property
    def peak_speed(self) -> float:
        """Samples/s of the reference workload at very large batch."""
        return self.relative_speed * REFERENCE_SAMPLES_PER_S

    def time_s(self, batch: int | float, speed_scale: float = 1.0) -> float:
        """Seconds for one micro-step (forward + backward) of ``batch`` samples; 0 for batch 0."""
        if batch <= 0:
            return 0.0
        return (self.overhead_s + (batch + self.half_batch) / self.peak_speed) / speed_scale

    def speed(self, batch: int | float, speed_scale: float = 1.0) -> float:
        """Samples/s at ``batch``."""
        return batch / self.time_s(batch, speed_scale)

    def capacity_bytes(self, memory_scale: float = 1.0) -> int:
        """Memory the device offers: memory_gb GiB times ``memory_scale`` (use < 1 to emulate a
        GPU on CPU with a small model: e.g. 1e-3 makes an 80 GB card an 82 MB device)."""
        if not memory_scale > 0:
            raise ValueError(f"memory_scale must be > 0, got {memory_scale}")
        return int(self.memory_gb * GIB * memory_scale)


PRESETS: dict[str, DevicePreset] = {p.name: p for p in (
    DevicePreset("A100-80G", 80, 312.0, 2.2, 4.0,
                 source="[L] A100 40GB SXM4 107/49 = 2.18; the 80 GB SXM4 card, more HBM bandwidth"),
    DevicePreset("A100-40G", 40, 312.0, 1.86, 4.0, source="[L] A100 40GB PCIe 91/49"),
    DevicePreset("A800-80G", 80, 312.0, 1.9, 4.0,
                 source="estimate: A100 80GB PCIe silicon with slower NVLink; [L] A100 PCIe 1.86 + HBM2e"),
    DevicePreset("V100-16G", 16, 112.0, 0.9, 2.0,
                 source="estimate: V100 PCIe vs SXM2 clocks/power (1380 vs 1530 MHz, 250 vs 300 W), [L] base"),
    DevicePreset("V100S-32G", 32, 130.0, 1.0, 2.0,
                 source="estimate: V100S PCIe clocks/bandwidth ~ V100 SXM2 (1601 MHz, 1134 GB/s), [L] base"),
    DevicePreset("T4-16G", 16, 65.0, 0.28, 1.0, source="[D] T4 vs V100-PCIe, MLPerf v0.5 training"),
    DevicePreset("RTX3060-12G", 12, 25.5, 0.35, 1.0,
                 source="estimate: [L] RTX 3090 47/49 = 0.96 scaled by bandwidth 360/936 GB/s and tensor cores"),
    DevicePreset("RTX4090-24G", 24, 165.2, 1.9, 3.0, source="[L] RTX 4090 93/49"),
)}


def get_preset(name: str) -> DevicePreset:
    """The preset called ``name``; a clear error listing the known names otherwise."""
    if isinstance(name, str) and name in PRESETS:
        return PRESETS[name]
    raise PresetError(f"unknown device preset {name!r}; known presets: {', '.join(PRESETS)}")
