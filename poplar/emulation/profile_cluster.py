"""Profile an emulated cluster on one CPU machine: one process per rank, each with the virtual
device of its GPU, spawned here (``poplar.process.launch.spawn``); the ``Profile`` is the one a
real cluster of those GPUs would give, with the scales it was emulated at in its provenance.

A cluster that spans nodes is profiled on its network (``cluster_network``): each rank's
collectives ride the emulated links, and the profiler measures each link on the cluster's nodes
(``ProfileOptions.topology``, the cluster's unless the options give one).

The functions must be importable by name (module-level), since they travel to the spawned
processes.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from poplar.process.launch import spawn
from poplar.emulation.calibration import Scales
from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.cluster_network import machine_floor
from poplar.emulation.emulate import emulate_cluster
from poplar.emulation.virtual_device import VirtualDevice
from poplar.emulation.virtual_network import NetworkSpec, paced_link
from poplar.profiler.job import model_size
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer, profile_rank
from poplar.types.profiles import Profile, ProfileError


def profile_cluster(model_fn: Callable[[], nn.Module], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                    sample_fn: Callable[[int], Any], *, cluster: ClusterSpec | str | None = None,
                    devices: list[VirtualDevice] | None = None, options: ProfileOptions | None = None,
                    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
                    scales: Scales = Scales(), timeout_s: float = 1800.0,
                    output: str | os.PathLike | None = None) -> Profile:
    """Profile ``model_fn()`` on ``cluster`` (a ``ClusterSpec``, a built-in name such as ``"B"``,
    or a cluster JSON file; its presets at ``scales``, calibrated for this model where "auto")
    or on ``devices`` (one ``VirtualDevice`` per rank). ``options``, ``optimizer_fn`` and
    ``output`` as for ``poplar.profile``; ``timeout_s`` bounds the spawned job."""
    if (cluster is None) == (devices is None):
        raise ProfileError("give either cluster= (a ClusterSpec, a built-in name or a cluster file) or devices= "
                           "(one VirtualDevice per rank) to emulate a cluster on CPU")
    options = options or ProfileOptions()
    if options.zero_stage not in (0, 1, 2, 3):
        raise ProfileError(f"zero_stage must be 0, 1, 2 or 3, got {options.zero_stage!r}")
    job = ProfileJob(model_fn, loss_fn, sample_fn, optimizer_fn or default_optimizer, options)
    network: NetworkSpec | None = None
    if cluster is not None:
        t0 = time.perf_counter()
        if options.progress and not scales.fixed:  # calibration is a timing run of its own: say so first
            print(f"[poplar profile] calibrating the emulated cluster's memory and time scales for "
                  f"{options.model_name or 'the model'} ...", file=sys.stderr, flush=True)
        emulated = emulate_cluster(cluster, job, scales)
        if options.progress and emulated.calibration is not None:
            print(f"[poplar profile] emulating {emulated.spec.describe()} on CPU: memory scale "
                  f"{emulated.memory_scale:.3g}, time scale {emulated.time_scale:.3g} (predicted mbs "
                  f"{emulated.calibration.predicted_mbs}; calibrated in {time.perf_counter() - t0:.1f} s); "
                  f"starting {len(emulated.devices())} ranks ...", file=sys.stderr, flush=True)
        devices = emulated.devices()
        options = replace(options, emulated=emulated.emulated())
        if emulated.topology.spans_nodes:
            network = _wire(emulated, devices, model_size(model_fn())[1], options.progress)
            options = replace(options, topology=options.topology or emulated.topology)
        job = replace(job, options=options)
    if not devices:
        raise ProfileError("devices is empty; give one VirtualDevice per rank")
    try:
        results = spawn(emulated_rank, len(devices), ({"job": job, "devices": list(devices)},), timeout_s=timeout_s,
                        collective_timeout_s=timeout_s)
    finally:
        if network is not None:
            network.remove()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise ProfileError(errors[0])
    profile = Profile.from_dict(results[0]["profile"])
    if output is not None:
        profile.save(output)
    return profile


def _wire(emulated: Any, devices: list[VirtualDevice], model_bytes: int, progress: bool) -> NetworkSpec:
    """The cluster's network at the emulation's scales, no faster than this machine's collectives
    (measured here on as many processes), each device on its end; the caller removes it."""
    network = emulated.network(model_bytes, machine_floor(len(devices), model_bytes))
    for rank, device in enumerate(devices):
        device.link = paced_link(network, rank)
    if progress:
        print(f"[poplar profile] collectives ride the emulated {network.describe()}", file=sys.stderr, flush=True)
    return network


def emulated_rank(rank: int, world: int, run: dict[str, Any]) -> dict[str, Any]:
    """Entry point of one spawned rank: profile with this rank's virtual device. Profile errors
    (the same on every rank, by agreement) come back as data, not as a crashed rank."""
    torch.manual_seed(rank)
    job: ProfileJob = run["job"]
    device = run["devices"][rank]
    try:
        profile = profile_rank(job.model_fn, job.loss_fn, job.sample_fn, device, optimizer_fn=job.optimizer_fn,
                               options=job.options, log=None if job.options.progress else (lambda m: None))
    except ProfileError as e:
        return {"error": str(e)}
    return {"profile": profile.to_dict(), "device": device.describe(), "late_steps": device.late_steps,
            "padded_steps": device.padded_steps}
