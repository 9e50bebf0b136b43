"""What offloading a rank's optimizer to the host costs, measured on the rank (``OffloadCost``).

An offloading rank (``poplar.zero.offload``) copies its reduced gradient shard to the host, steps
the optimizer there and copies the updated shard back, every iteration. The planner prices that
from three measurements, each a median of a few repeats after a warm-up:

- the host link both ways: one copy of a buffer of ``TRANSFER_BYTES`` (a realistic shard bucket:
  copies this large run at the link's rate, not its latency) between the device and host memory,
  pinned when the device is a GPU, as the runtime's copies are. A device may state its link
  instead (``Device.host_link_bytes_per_s``: an emulated GPU's preset), so a CPU standing in for a
  GPU does not report the CPU's memory copy rate;
- the host optimizer step per parameter element: the user's optimizer class and group settings
  (``optimizer_like``, without fused or capturable kernels) stepping a CPU fp32 tensor of
  ``STEP_ELEMENTS`` elements, after one step that creates its state;
- the bytes per element that leave the device: the optimizer's state per element (counted after
  that first step: AdamW 8, SGD with momentum 4) and, under mixed precision, the fp32 master
  (4), whose device storage an offloading rank frees.

It costs tens of milliseconds on a CPU and copies of tens of MB on a GPU, well under a second.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from poplar.profiler.devices import Device
from poplar.types.profiles import OffloadCost
from poplar.zero.optim import optimizer_like, optimizer_state_bytes

TRANSFER_BYTES = {"cuda": 64 << 20, "cpu": 8 << 20}  # the buffer copied each way, by device type
STEP_ELEMENTS = 1 << 18  # the host step's tensor (1 MiB of fp32)
REPEATS = 3
FP32_BYTES = 4


def _median_seconds(run: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    """The median wall time of ``run`` (after one unmeasured call), waiting for queued work."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


def measure_link(torch_device: torch.device, repeats: int = REPEATS) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes/s of copies of ``TRANSFER_BYTES`` on ``torch_device``."""
    on_gpu = torch_device.type == "cuda" and torch.cuda.is_available()
    nbytes = TRANSFER_BYTES["cuda" if on_gpu else "cpu"]
    elements = nbytes // FP32_BYTES
    source = torch.ones(elements, dtype=torch.float32, device=torch_device)
    host = torch.empty(elements, dtype=torch.float32, pin_memory=on_gpu)
    back = torch.empty_like(source)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(torch_device)

    d2h = _median_seconds(lambda: host.copy_(source, non_blocking=on_gpu), sync, repeats)
    h2d = _median_seconds(lambda: back.copy_(host, non_blocking=on_gpu), sync, repeats)
    return nbytes / d2h, nbytes / h2d


def measure_host_step(optimizer: torch.optim.Optimizer, elements: int = STEP_ELEMENTS,
                      repeats: int = REPEATS) -> tuple[float, float]:
    """(seconds per element, state bytes per element) of ``optimizer``'s class and settings
    stepping a CPU fp32 tensor of ``elements`` elements (its first group's settings; the other
    groups get one element each)."""
    params = [[torch.zeros(elements if g == 0 else 1, dtype=torch.float32, requires_grad=True)]
              for g in range(len(optimizer.param_groups))]
    for group in params:
        for p in group:
            p.grad = torch.full_like(p, 1e-3)
    twin = optimizer_like(optimizer, params, for_cpu=True)
    per_element = _median_seconds(twin.step, lambda: None, repeats) / elements
    total = sum(p.numel() for group in params for p in group)
    return per_element, optimizer_state_bytes(twin) / total


def measure_offload_cost(device: Device, optimizer: torch.optim.Optimizer, mixed_precision: bool,
                         repeats: int = REPEATS) -> OffloadCost:
    """What offloading this rank's optimizer would cost (see the module's doc)."""
    stated = device.host_link_bytes_per_s()
    d2h, h2d = (stated, stated) if stated is not None else measure_link(device.torch_device, repeats)
    per_element, state_bytes = measure_host_step(optimizer, repeats=repeats)
    return OffloadCost(d2h_bytes_per_s=float(d2h), h2d_bytes_per_s=float(h2d),
                       host_step_s_per_element=float(per_element), state_bytes_per_element=float(state_bytes),
                       master_bytes_per_element=float(FP32_BYTES if mixed_precision else 0))
