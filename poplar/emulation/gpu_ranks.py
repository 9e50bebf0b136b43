"""Ranks on GPUs for the CUDA tests and benches: one GPU per rank where there are enough, else
ranks share.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so where ranks
share a GPU each names itself a host of its own (``NCCL_HOSTID``) and NCCL joins them through its
socket transport over loopback: the collectives and the engine run as they do across machines,
only slower. That is a test arrangement, not a way to train.
"""

from __future__ import annotations

import os

import torch


def rank_gpu(rank: int, world: int) -> torch.device:
    """Rank ``rank``'s GPU, made current; call it before the rank's first collective (NCCL reads
    its settings then)."""
    gpus = torch.cuda.device_count()
    if world > gpus:
        os.environ["NCCL_HOSTID"] = f"poplar-test-rank-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    return device
