"""Device presets: the paper's GPUs as data, for the simulator and for emulated (virtual) devices.

Each preset gives a spec-sheet memory and FLOPS rating, and a speed curve for a *reference
workload* (the simulator's reference model, ``poplar.emulation.synthetic.REFERENCE_MODEL``):

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

Precision. The curve above is the fp32 curve. ``PrecisionSpeedup`` gives each preset's training
throughput at fp16 and bf16 (mixed precision: tensor-core math, fp32 master weights) relative
to fp32; the throughput part of the curve is divided by it, the fixed overhead is not:

    time_s(b, precision) = overhead_s + (b + half_batch) / (peak_speed * speedup(precision))

A preset with ``bf16=None`` has no bf16 arithmetic (Volta and Turing: V100, T4; bf16 needs
compute capability 8.0, Ampere or newer): asking it for bf16 is an error that suggests fp16
(``precision_unsupported_message``). Sources of the factors:
[LP] Lambda, same repository, pytorch/pytorch-train-throughput-fp16.csv / -fp32.csv (2023 runs,
    NGC PyTorch 22.10: "fp16" is AMP, "fp32" on Ampere/Ada is TF32 as the NGC container enables
    it): single GPU, median of fp16/fp32 over the five NLP workloads (bert_base_squad,
    bert_large_squad, gnmt, transformerxlbase, transformerxllarge). V100 16GB 3.28, A100 40GB
    PCIe 1.84, A100 80GB PCIe 1.85, A100 80GB SXM4 1.85, RTX 3090 1.92, RTX 4090 1.89.
[N] NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 README: T4 throughput at batch 64/128/256,
    AMP vs FP32 (1165/428, 1190/426, 1198/415; mean 2.80). Inference: NVIDIA publishes no T4
    training table there, so the T4 factor is an estimate.
[W] NVIDIA A100 / Ada whitepapers: dense BF16 tensor-core rate = FP16 rate (A100 312, RTX 4090
    165.2 TFLOPS, FP32 accumulate), so bf16 factors equal the fp16 ones (an estimate: [LP] has no
    bf16 runs).
All are planning estimates good to tens of percent (real gains depend on the model: large
matmuls gain most); measured profiles replace them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poplar.types.precision import Precision, precision_of, precision_unsupported_message

GIB = 2 ** 30


class PresetError(ValueError):
    """An unknown device preset name, or a precision a preset does not support."""


@dataclass(frozen=True)
class PrecisionSpeedup:
    """Training throughput at fp16 and bf16 relative to fp32 on one GPU (> 1: faster);
    ``bf16`` None: the GPU has no bf16 arithmetic. ``source`` names where the numbers come from."""

    fp16: float
    bf16: float | None
    source: str = ""

    def __post_init__(self) -> None:
        if not self.fp16 > 0 or (self.bf16 is not None and not self.bf16 > 0):
            raise ValueError(f"precision speed-ups must be > 0, got fp16={self.fp16}, bf16={self.bf16}")

    def supports(self, precision: Precision) -> bool:
        return precision is not Precision.BF16 or self.bf16 is not None

    def factor(self, precision: Precision) -> float | None:
        """Throughput at ``precision`` / throughput at fp32 (None: not supported)."""
        return {Precision.FP32: 1.0, Precision.FP16: self.fp16, Precision.BF16: self.bf16}[precision]


# Host links, bytes/s: nominal figures of large pinned copies over PCIe x16 (not measured here):
# PCIe 3.0 (V100 PCIe, T4) about 12 GB/s, PCIe 4.0 (A100, A800, RTX 30xx/40xx) about 24 GB/s
# (the links' 16 / 32 GB/s raw, less protocol overhead). Offloaded optimizer copies ride them.
PCIE_GEN3_X16 = 12e9
PCIE_GEN4_X16 = 24e9

NO_SPEEDUP = PrecisionSpeedup(1.0, 1.0, "no data: low precision is emulated at fp32 speed")

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
    precision_speedup: PrecisionSpeedup = field(default=NO_SPEEDUP)  # fp16 / bf16 vs fp32
    host_link_bytes_per_s: float = PCIE_GEN4_X16  # nominal host link (PCIE_GEN3_X16 / PCIE_GEN4_X16)

    @property
    def peak_speed(self) -> float:
        """Samples/s of the reference workload at very large batch (fp32)."""
        return self.relative_speed * REFERENCE_SAMPLES_PER_S

    def supports(self, precision: Any) -> bool:
        """Whether the GPU computes in ``precision`` (see ``precision_of``)."""
        return self.precision_speedup.supports(precision_of(precision))

    def dtype_factor(self, precision: Any) -> float:
        """Training throughput at ``precision`` relative to fp32; PresetError if unsupported."""
        p = precision_of(precision)
        factor = self.precision_speedup.factor(p)
        if factor is None:
            raise PresetError(precision_unsupported_message(p, {self.name: []}))
        return factor

    def time_s(self, batch: int | float, speed_scale: float = 1.0, precision: Any = None) -> float:
        """Seconds for one micro-step (forward + backward) of ``batch`` samples computed in
        ``precision`` (default fp32); 0 for batch 0."""
        if batch <= 0:
            return 0.0
        peak = self.peak_speed * self.dtype_factor(precision)
        return (self.overhead_s + (batch + self.half_batch) / peak) / speed_scale

    def speed(self, batch: int | float, speed_scale: float = 1.0, precision: Any = None) -> float:
        """Samples/s at ``batch``."""
        return batch / self.time_s(batch, speed_scale, precision)

    def capacity_bytes(self, memory_scale: float = 1.0) -> int:
        """Memory the device offers: memory_gb GiB times ``memory_scale`` (use < 1 to emulate a
        GPU on CPU with a small model: e.g. 1e-3 makes an 80 GB card an 82 MB device)."""
        if not memory_scale > 0:
            raise ValueError(f"memory_scale must be > 0, got {memory_scale}")
        return int(self.memory_gb * GIB * memory_scale)


# the factors of [LP], [N], [W] (module doc); the same silicon shares one row
_AMPERE_DC = PrecisionSpeedup(1.85, 1.85, "[LP] A100 80GB SXM4/PCIe 1.85; bf16 = fp16 rate [W] (estimate)")
_VOLTA = PrecisionSpeedup(3.28, None, "[LP] V100 16GB 3.28 (no fp32 tensor cores on Volta); no bf16 (Volta)")
PRESETS: dict[str, DevicePreset] = {p.name: p for p in (
    DevicePreset("A100-80G", 80, 312.0, 2.2, 4.0,
                 source="[L] A100 40GB SXM4 107/49 = 2.18; the 80 GB SXM4 card, more HBM bandwidth",
                 precision_speedup=_AMPERE_DC),
    DevicePreset("A100-40G", 40, 312.0, 1.86, 4.0, source="[L] A100 40GB PCIe 91/49",
                 precision_speedup=PrecisionSpeedup(1.84, 1.84, "[LP] A100 40GB PCIe 1.84; bf16 = fp16 rate [W] "
                                                                "(estimate)")),
    DevicePreset("A800-80G", 80, 312.0, 1.9, 4.0,
                 source="estimate: A100 80GB PCIe silicon with slower NVLink; [L] A100 PCIe 1.86 + HBM2e",
                 precision_speedup=PrecisionSpeedup(1.85, 1.85, "estimate: A100 80GB PCIe silicon, [LP] 1.85; "
                                                                "bf16 = fp16 rate [W]")),
    DevicePreset("V100-16G", 16, 112.0, 0.9, 2.0,
                 source="estimate: V100 PCIe vs SXM2 clocks/power (1380 vs 1530 MHz, 250 vs 300 W), [L] base",
                 precision_speedup=_VOLTA, host_link_bytes_per_s=PCIE_GEN3_X16),
    DevicePreset("V100S-32G", 32, 130.0, 1.0, 2.0,
                 source="estimate: V100S PCIe clocks/bandwidth ~ V100 SXM2 (1601 MHz, 1134 GB/s), [L] base",
                 precision_speedup=PrecisionSpeedup(3.28, None, "estimate: Volta as [LP] V100 16GB; no bf16"),
                 host_link_bytes_per_s=PCIE_GEN3_X16),
    DevicePreset("T4-16G", 16, 65.0, 0.28, 1.0, source="[D] T4 vs V100-PCIe, MLPerf v0.5 training",
                 precision_speedup=PrecisionSpeedup(2.8, None, "estimate: [N] T4 AMP/FP32 2.80 (inference "
                                                               "throughput); no bf16 (Turing)"),
                 host_link_bytes_per_s=PCIE_GEN3_X16),
    DevicePreset("RTX3060-12G", 12, 25.5, 0.35, 1.0,
                 source="estimate: [L] RTX 3090 47/49 = 0.96 scaled by bandwidth 360/936 GB/s and tensor cores",
                 precision_speedup=PrecisionSpeedup(1.92, 1.92, "estimate: GA10x as [LP] RTX 3090 1.92; bf16 = "
                                                                "fp16 rate (GA10x whitepaper)")),
    DevicePreset("RTX4090-24G", 24, 165.2, 1.9, 3.0, source="[L] RTX 4090 93/49",
                 precision_speedup=PrecisionSpeedup(1.89, 1.89, "[LP] RTX 4090 1.89; bf16 = fp16 rate [W] "
                                                                "(estimate)")),
)}


def get_preset(name: str) -> DevicePreset:
    """The preset called ``name``; a clear error listing the known names otherwise."""
    if isinstance(name, str) and name in PRESETS:
        return PRESETS[name]
    raise PresetError(f"unknown device preset {name!r}; known presets: {', '.join(PRESETS)}")


# Interconnects, as data: an emulated cluster's nodes and the network between them name these.
# ``bandwidth_gbps`` is a collective's bus bandwidth in GB/s (what NCCL's busbw reports, the
# ``poplar.planner.cost_model`` unit), ``latency_us`` a small collective's time. Nominal figures,
# not measured here: NVLink 3 on A100 SXM4 boards, NCCL all-reduce busbw about 230 GB/s on 8 GPUs
# (NVIDIA's A100 and NCCL-tests figures); GPUs on PCIe without a bridge ring through the host:
# PCIe 4.0 x16 about 16 GB/s and PCIe 3.0 x16 about 8 GB/s bus bandwidth (the links' 32 / 16 GB/s
# raw, each ring hop sharing the root complex; the figures built-in clusters A and B used for
# their single link); InfiniBand and Ethernet at their line rate per port and direction
# (100 Gbps = 12.5 GB/s), each node one port.
@dataclass(frozen=True)
class LinkPreset:
    """A link's nominal speed: bus bandwidth (GB/s) and latency (µs)."""

    name: str
    bandwidth_gbps: float
    latency_us: float
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("bandwidth_gbps", "latency_us"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    key == "bandwidth_gbps" and value == 0):
                raise PresetError(f"link {self.name!r}: {key} must be a positive number, got {value!r}")

    def describe(self) -> str:
        return f"{self.name} ({self.bandwidth_gbps:g} GB/s, {self.latency_us:g} us)"


LINKS: dict[str, LinkPreset] = {p.name: p for p in (
    LinkPreset("nvlink-a100", 230.0, 10.0, "NVLink 3, A100 SXM4: NCCL all-reduce busbw ~230 GB/s"),
    LinkPreset("pcie4", 16.0, 20.0, "PCIe 4.0 x16, no bridge: rings through the host"),
    LinkPreset("pcie3", 8.0, 30.0, "PCIe 3.0 x16, no bridge: rings through the host"),
    LinkPreset("ib-400g", 50.0, 15.0, "InfiniBand NDR, 400 Gbps per port"),
    LinkPreset("ib-200g", 25.0, 15.0, "InfiniBand HDR, 200 Gbps per port"),
    LinkPreset("ib-100g", 12.5, 15.0, "InfiniBand EDR / HDR100, 100 Gbps per port"),
    LinkPreset("eth-25g", 3.125, 40.0, "25 Gbps Ethernet (TCP)"),
    LinkPreset("eth-10g", 1.25, 50.0, "10 Gbps Ethernet (TCP)"),
)}
# the inter-node links an emulated cluster is usually run with: one where the network hardly
# matters beside the GPUs' compute, one where it binds
FAST_NETWORK, SLOW_NETWORK = "ib-100g", "eth-10g"


def get_link(name: str) -> LinkPreset:
    """The link preset called ``name``; a clear error listing the known names otherwise."""
    if isinstance(name, str) and name in LINKS:
        return LINKS[name]
    raise PresetError(f"unknown link {name!r}; known links: {', '.join(LINKS)} "
                      "(or give {\"bandwidth_gbps\": ..., \"latency_us\": ...})")
