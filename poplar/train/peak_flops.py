"""Peak dense FLOP/s of a GPU per compute precision: the denominator of MFU (docs/design.md §9).

``fp32`` is the plain FP32 (CUDA core) rate: PyTorch does not run fp32 matmuls on TF32 tensor
cores unless asked (``torch.backends.cuda.matmul.allow_tf32``). ``fp16`` and ``bf16`` are dense
tensor-core rates with FP32 accumulate (no sparsity), as mixed precision runs them; None where the
GPU has no such arithmetic (bf16 before Ampere). A device is looked up by its device type first
(the short names cluster descriptions and plan rows use, e.g. ``A100-80G``; the emulator's
presets carry the same names, so an emulated cluster's MFU uses the card it emulates), then by a
substring of its CUDA name (``torch.cuda.get_device_name``).

Sources (TFLOPS, fp32 / fp16 / bf16):
- A100 40/80 GB, SXM4 and PCIe; A800 (A100 silicon): 19.5 / 312 / 312. NVIDIA A100 datasheet.
- V100 PCIe 14 / 112; V100 SXM2 15.7 / 125; V100S PCIe 16.4 / 130. NVIDIA V100 / V100S datasheets.
- T4: 8.1 / 65. NVIDIA T4 datasheet.
- RTX 3060: 12.7 / 25.5 / 25.5 (GeForce: FP32-accumulate tensor rate is half the FP16-accumulate
  rate). NVIDIA Ampere GA102 whitepaper, appendix (GA106 per-SM rates).
- RTX 4090: 82.6 / 165.2 / 165.2. NVIDIA Ada Lovelace whitepaper, appendix.
- H100 SXM and H200: 67 / 989.4 / 989.4; H100 PCIe: 51 / 756 / 756. NVIDIA H100 / H200 datasheets.
- L4: 30.3 / 121 / 121; A10: 31.2 / 125 / 125. NVIDIA L4 / A10 datasheets.
"""

from __future__ import annotations

from typing import Any

from poplar.types.precision import Precision, precision_of

TERA = 1e12

# device type -> (fp32, fp16, bf16) TFLOPS
DEVICE_TYPE_PEAK_TFLOPS: dict[str, tuple[float, float, float | None]] = {
    "A100-80G": (19.5, 312.0, 312.0),
    "A100-40G": (19.5, 312.0, 312.0),
    "A800-80G": (19.5, 312.0, 312.0),
    "V100-16G": (14.0, 112.0, None),
    "V100S-32G": (16.4, 130.0, None),
    "T4-16G": (8.1, 65.0, None),
    "RTX3060-12G": (12.7, 25.5, 25.5),
    "RTX4090-24G": (82.6, 165.2, 165.2),
}

# a substring of the CUDA device name -> (fp32, fp16, bf16) TFLOPS; the first match wins
CUDA_PEAK_TFLOPS: list[tuple[str, tuple[float, float, float | None]]] = [
    ("H100 PCIe", (51.0, 756.0, 756.0)),
    ("H100", (67.0, 989.4, 989.4)),
    ("H200", (67.0, 989.4, 989.4)),
    ("A100", (19.5, 312.0, 312.0)),
    ("A800", (19.5, 312.0, 312.0)),
    ("V100S", (16.4, 130.0, None)),
    ("V100-SXM2", (15.7, 125.0, None)),
    ("V100", (14.0, 112.0, None)),
    ("T4", (8.1, 65.0, None)),
    ("RTX 4090", (82.6, 165.2, 165.2)),
    ("RTX 3060", (12.7, 25.5, 25.5)),
    ("L4", (30.3, 121.0, 121.0)),
    ("A10", (31.2, 125.0, 125.0)),
]

def _pick(row: tuple[float, float, float | None], precision: Precision) -> float | None:
    return {Precision.FP32: row[0], Precision.FP16: row[1], Precision.BF16: row[2]}[precision]


def peak_flops(device_name: str | None, precision: Any = None) -> float | None:
    """Peak FLOP/s of ``device_name`` (a device type or a CUDA device name) computing in
    ``precision`` (None: fp32; a name, ``Precision`` or policy); None when unknown."""
    if not device_name:
        return None
    p = precision_of(precision)
    if device_name in DEVICE_TYPE_PEAK_TFLOPS:
        tflops = _pick(DEVICE_TYPE_PEAK_TFLOPS[device_name], p)
        return None if tflops is None else tflops * TERA
    for pattern, row in CUDA_PEAK_TFLOPS:
        if pattern in device_name and not (pattern == "L4" and "L40" in device_name):
            tflops = _pick(row, p)
            return None if tflops is None else tflops * TERA
    return None
