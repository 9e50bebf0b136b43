"""Throughput and model FLOPs utilisation (MFU) of a heterogeneous cluster, and peak memory.

Tokens. Each rank counts the tokens of its own batch every iteration (``count_tokens``: the
ones of an ``attention_mask`` when the batch has one, so padding is not counted; otherwise the
elements of ``input_ids`` or of an integer tensor batch; ``ThroughputOptions(tokens_fn=...)``
overrides it). The counts travel with the per-iteration stats ``fit`` already gathers.

Rates, over the measured iterations (warm-up excluded), with W_k the wall time of iteration k
(its slowest rank):

    tokens/s  = Σ_k tokens_k / Σ_k W_k          samples/s = Σ_k gbs / Σ_k W_k

MFU, for ranks with peaks P_r (FLOP/s of rank r's device at the run's compute precision,
``poplar.train.peak_flops``: the emulated card's for a virtual device, the GPU's own on CUDA):

    MFU = F · tokens/s / Σ_r P_r

where F = model FLOPs per token = 6·N (N trainable parameters, tied ones once: 2N for the
forward and 4N for the backward matmuls; attention's quadratic term is left out unless
``ThroughputOptions(flops_per_token=...)`` supplies a better F). Summing every rank's peak is
what a heterogeneous cluster could do at best: a slow card adds its own, smaller peak. A rank whose
peak is unknown (a CPU without an emulated device, an unlisted GPU) makes MFU None, never a
guess.

Peak memory per rank: the device's peak of each iteration (a virtual device's emulated bytes,
the CUDA allocator's maximum), or the process's peak resident set on a plain CPU; the report
says which.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from poplar.train.peak_flops import peak_flops


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: Σ ``attention_mask``, else the elements of ``input_ids``, else of an
    integer tensor; 0 when there is nothing to count."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if torch.is_tensor(mask):
            return int(mask.sum())
        ids = batch.get("input_ids")
        return int(ids.numel()) if torch.is_tensor(ids) else 0
    if torch.is_tensor(batch) and not batch.is_floating_point():
        return int(batch.numel())
    if isinstance(batch, (tuple, list)) and batch and torch.is_tensor(batch[0]):
        return count_tokens(batch[0])
    return 0


def model_flops_per_token(module: torch.nn.Module) -> float:
    """6·N: training FLOPs per token of a model with N trainable parameters."""
    return 6.0 * sum(p.numel() for p in module.parameters() if p.requires_grad)


@dataclass
class RankDevice:
    """What MFU and the memory report need to know about one rank's device."""

    rank: int
    device: str
    peak_flops: float | None
    memory_source: str  # "virtual device" (emulated bytes), "cuda allocator" or "process rss"
    capacity_bytes: int | None


def rank_device(engine: Any) -> RankDevice:
    """This rank's device, its peak FLOP/s at the engine's precision, and its memory source."""
    device = engine.device
    if device is not None:
        name, capacity = device.name, device.capacity_bytes
        source = "cuda allocator" if engine.comm.device.type == "cuda" else "virtual device"
    elif engine.comm.device.type == "cuda":
        name = torch.cuda.get_device_name(engine.comm.device)
        capacity = torch.cuda.get_device_properties(engine.comm.device).total_memory
        source = "cuda allocator"
    else:
        name, capacity, source = "cpu", None, "process rss"
    return RankDevice(engine.rank, name, peak_flops(name, engine.mixed_precision), source, capacity)


def peak_memory_bytes(engine: Any) -> int:
    """This rank's peak memory now (see the module doc for what is measured where)."""
    if engine.device is not None:
        return int(engine.device.peak())
    if engine.comm.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(engine.comm.device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


@dataclass
class Throughput:
    """The rates of a set of iterations and the figures MFU is made of."""

    tokens_per_s: float
    samples_per_s: float
    model_flops_per_s: float
    mfu: float | None
    flops_per_token: float
    cluster_peak_flops: float | None
    iterations: int
    formula: str = "MFU = flops_per_token * tokens_per_s / sum(peak_flops of every rank)"
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def throughput(records: list[dict[str, Any]], global_batch_size: int, flops_per_token: float,
               devices: list[RankDevice]) -> Throughput | None:
    """The rates of ``records`` (fit's per-iteration records with per-rank ``tokens``); None
    without records or time."""
    wall = sum(r["wall_s"] for r in records)
    if not records or wall <= 0:
        return None
    tokens = sum(rank.get("tokens", 0) for r in records for rank in r["ranks"])
    tps = tokens / wall
    peaks = [d.peak_flops for d in devices]
    cluster = None if any(p is None for p in peaks) else float(sum(peaks))  # type: ignore[arg-type]
    achieved = flops_per_token * tps
    ranks = []
    for d in devices:
        mem = [r["ranks"][d.rank].get("peak_bytes", 0) for r in records]
        ranks.append({**asdict(d), "peak_memory_bytes": max(mem) if mem else 0})
    return Throughput(tps, global_batch_size * len(records) / wall, achieved,
                      achieved / cluster if cluster else None, flops_per_token, cluster, len(records), ranks=ranks)


def describe(t: Throughput) -> str:
    """One log line: tokens/s, samples/s and MFU."""
    mfu = "MFU n/a (a device's peak is unknown)" if t.mfu is None else f"MFU {100 * t.mfu:.3g}%"
    return (f"{t.tokens_per_s:,.0f} tokens/s, {t.samples_per_s:.1f} samples/s, "
            f"{t.model_flops_per_s / 1e12:.3g} model TFLOP/s, {mfu}")
