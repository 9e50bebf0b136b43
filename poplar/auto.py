"""Auto mode: inside a running job, profile every rank's device, plan, and hand the plan to the
engine. ``PoplarEngine(model, optimizer, global_batch_size=..., loss_fn=..., profile_data=...)``
calls ``auto_plan``; every rank takes part (it is collective, like the engine's constructor).

Each rank's device:

- ``device=`` a profiler ``Device`` (``VirtualDevice``, or ``CudaDevice``, e.g. capped to a
  smaller card's memory);
- a model on a GPU: that GPU (``CudaDevice``);
- a model on the CPU: ``cluster=`` names a cluster (built-in name, JSON file or ``ClusterSpec``)
  with one device per rank; rank r emulates the r-th with a ``VirtualDevice``. The memory and
  time scales (a CPU-sized model filling a scaled-down GPU) are calibrated once, on rank 0, and
  shared, so every rank emulates the same cluster.

Profiling trains fresh copies of the model, built from a CPU snapshot taken before the engine
shards anything, with an optimizer of the user's class and hyper-parameters, on batches drawn
from ``profile_data``: a map-style dataset (its first samples, cycled) or ``sample_fn(b)``.
A measured profile can be reused (``AutoOptions.profile``: a path or a ``Profile``) to skip
profiling; ``AutoOptions.profile_output`` saves it (rank 0).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import default_collate

from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import Profile, ProfileError
from poplar.comm import Communicator
from poplar.profiler.devices import DeviceKind

from poplar.types.logs import log


@dataclass
class AutoOptions:
    """Knobs of auto mode; the defaults suit most runs."""

    strategy: str = "poplar"  # or "even" / "flops" (the baselines, for comparison)
    profile: Profile | str | os.PathLike | None = None  # reuse a measured profile instead of profiling
    profile_output: str | os.PathLike | None = None  # save the measured profile here (JSON)
    repeats: int = 3  # timing measurements per batch size
    max_batch: int = 4096  # the capacity search stops here
    escalate: bool = True  # raise the ZeRO stage when batch 1 does not fit somewhere
    require_all_ranks: bool = False  # every rank must get at least one sample
    max_micro_steps: int | None = None  # bound on micro-steps per rank per iteration
    memory_scale: float | str = "auto"  # emulation only: preset memory x this
    time_scale: float | str = "auto"  # emulation only: preset step time x this
    collate_fn: Callable[[list], Any] | None = None  # for profile_data given as a dataset
    progress: bool = True  # profiling progress lines (rank 0)


@dataclass
class AutoResult:
    plan: Plan
    profile: Profile
    device: Any  # this rank's profiler Device


class DatasetSamples:
    """``sample_fn(b)`` over a map-style dataset: its first ``b`` samples (cycled), collated."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any] | None = None) -> None:
        if len(dataset) < 1:
            raise ValueError("profile_data is an empty dataset; give one with samples")
        self.dataset, self.collate_fn = dataset, collate_fn or default_collate

    def __call__(self, batch: int) -> Any:
        n = len(self.dataset)
        return self.collate_fn([self.dataset[i % n] for i in range(batch)])


def sample_fn_of(profile_data: Any, collate_fn: Callable[[list], Any] | None = None) -> Callable[[int], Any]:
    if callable(profile_data) and not hasattr(profile_data, "__getitem__"):
        return profile_data
    if hasattr(profile_data, "__len__") and hasattr(profile_data, "__getitem__"):
        return DatasetSamples(profile_data, collate_fn)
    raise ValueError("auto mode needs profile_data: a map-style dataset or sample_fn(b) returning a batch of b "
                     f"samples, got {type(profile_data).__name__}")


def clone_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                    template: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and param-group settings over ``model``, a copy of
    ``template`` (the model ``optimizer`` was built on): parameters are matched by position."""
    index = {id(p): i for i, p in enumerate(template.parameters())}
    params = list(model.parameters())
    groups = []
    for g in optimizer.param_groups:
        missing = [p for p in g["params"] if id(p) not in index]
        if missing:
            raise ValueError("the optimizer holds a parameter that is not the model's; build it on "
                             "model.parameters()")
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [params[index[id(p)]] for p in g["params"]]})
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in _ctor_keys(optimizer)})


def _ctor_keys(optimizer: torch.optim.Optimizer) -> set[str]:
    import inspect

    return set(inspect.signature(type(optimizer).__init__).parameters) - {"self", "params"}


def _agree(comm: Communicator, error: str | None, what: str) -> None:
    comm.agree(error, f"auto mode: {what}", error_type=ProfileError)


def emulated_device(comm: Communicator, cluster: Any, options: AutoOptions, calibrate_inputs: dict[str, Any]) -> Any:
    """This rank's ``VirtualDevice`` of ``cluster``, with scales agreed by every rank."""
    from poplar.types.cluster import ClusterSpec
    from poplar.profiler.emulate import calibrate
    from poplar.profiler.virtual_device import VirtualDevice

    error, spec = None, None
    try:
        spec = ClusterSpec.resolve(cluster)
        if spec.world_size != comm.world_size:
            error = (f"cluster {spec.name!r} has {spec.world_size} devices ({spec.describe()}) but the job has "
                     f"{comm.world_size} ranks; launch one rank per device")
    except (ValueError, OSError) as e:
        error = str(e)
    _agree(comm, error, "cluster")
    assert spec is not None
    scales: Any = None
    if comm.rank == 0:
        try:
            mem, tim = options.memory_scale, options.time_scale
            if mem == "auto" or tim == "auto":
                cal = calibrate(cluster=spec, memory_scale=mem, time_scale=tim, max_batch=options.max_batch,
                                **calibrate_inputs)
                mem, tim = cal.memory_scale, cal.time_scale
            scales = (float(mem), float(tim), None)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            scales = (None, None, f"calibrating the emulated cluster failed: {type(e).__name__}: {e}")
    memory_scale, time_scale, error = comm.all_gather_object(scales, tag="auto:calibrate")[0]
    if error:
        raise ProfileError(f"auto mode: {error}")
    device = VirtualDevice.from_preset(spec.rank_types()[comm.rank], memory_scale, time_scale)
    device.cluster = spec  # type: ignore[attr-defined]
    return device


def _measure(comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
             sample_fn: Any, zero_stage: int, home: torch.device, cluster: Any, device: Any, options: AutoOptions,
             bucket_size_mb: float, wrap_policy: Any, say: Callable[[str], None]) -> tuple[Profile, Any]:
    """The profile (measured, or loaded from ``options.profile``) and this rank's device."""
    from poplar.profiler.profile_run import ProfileOptions, profile_rank

    snapshot = copy.deepcopy(model)  # on the CPU: the caller moved the model there
    model_fn = lambda: copy.deepcopy(snapshot)  # noqa: E731
    optimizer_fn = lambda m: clone_optimizer(optimizer, m, model)  # noqa: E731

    profile = None
    if options.profile is not None:
        from poplar.planner.planning import load_profile
        error = None
        try:
            profile = load_profile(options.profile)
            if profile.world_size != comm.world_size:
                error = (f"the profile has {profile.world_size} ranks but the job has {comm.world_size}; "
                         "profile this cluster again")
        except (ProfileError, OSError, ValueError) as e:
            error = f"cannot use the profile {options.profile}: {e}"
        _agree(comm, error, "auto mode profile")
        say(f"using the profile {options.profile} (ZeRO-{profile.zero_stage})")
        if profile.meta.get("emulated") and options.memory_scale == "auto" and options.time_scale == "auto":
            options = replace(options, memory_scale=profile.meta["memory_scale"],
                              time_scale=profile.meta["time_scale"])  # emulate the devices it measured

    if device is None and cluster is not None:
        inputs = {"model_fn": model_fn, "loss_fn": loss_fn, "sample_fn": sample_fn, "zero_stage": zero_stage,
                  "optimizer_fn": optimizer_fn, "bucket_size_mb": bucket_size_mb, "wrap_policy": wrap_policy}
        device = emulated_device(comm, cluster, options, inputs)
    elif device is None and profile is None:
        error = None
        if home.type == "cuda":
            from poplar.profiler.cuda_device import CudaDevice
            device = CudaDevice(home)
        else:
            error = ("the model is on the CPU and neither cluster= nor device= was given: auto mode measures each "
                     "rank's device; pass cluster= (a cluster file or a built-in name) to emulate GPUs on CPU, "
                     "device=, AutoOptions(profile=...), or a plan")
        _agree(comm, error, "auto mode device")

    if profile is None:
        meta: dict[str, Any] = {}
        if hasattr(device, "cluster"):
            meta["cluster"] = device.cluster.to_dict()
        if device.kind is DeviceKind.VIRTUAL:
            meta.update(memory_scale=device.memory_scale, time_scale=device.time_scale, emulated=True)
        popts = ProfileOptions(zero_stage=zero_stage, escalate=options.escalate, max_batch=options.max_batch,
                               repeats=options.repeats, bucket_size_mb=bucket_size_mb, wrap_policy=wrap_policy,
                               model_name=type(model).__name__, progress=options.progress, meta=meta)
        say(f"profiling {comm.world_size} ranks at ZeRO-{zero_stage} ...")
        profile = profile_rank(model_fn, loss_fn, sample_fn, device, optimizer_fn=optimizer_fn, options=popts,
                               log=lambda m: say(m.removeprefix("[poplar profile] ")), process_group=comm.group)
        # rank 0's copy everywhere: the per-rank copies differ only in their own wall-clock notes
        profile = Profile.from_dict(comm.all_gather_object(profile.to_dict() if comm.rank == 0 else None,
                                                           tag="auto:profile")[0])
        if options.profile_output is not None and comm.rank == 0:
            profile.save(options.profile_output)
    return profile, device


def auto_plan(comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer, *, global_batch_size: int,
              zero_stage: int, loss_fn: Callable | None, profile_data: Any, cluster: Any = None, device: Any = None,
              options: AutoOptions | None = None, bucket_size_mb: float = 25.0, wrap_policy: Any = None) -> AutoResult:
    """Profile (or load a profile), plan, and log the plan: the engine's auto mode."""
    from poplar.planner import plan as make_plan

    options = options or AutoOptions()
    error = None
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        error = f"global_batch_size must be an int >= 1, got {global_batch_size!r}"
    elif loss_fn is None:
        error = "auto mode needs loss_fn(module, micro_batch) -> mean loss, to profile and to train"
    elif options.profile is None and profile_data is None:
        error = "auto mode needs profile_data (a dataset or sample_fn(b)) to profile on, or AutoOptions(profile=...)"
    sample_fn = None
    if error is None and profile_data is not None:
        try:
            sample_fn = sample_fn_of(profile_data, options.collate_fn)
        except ValueError as e:
            error = str(e)
    _agree(comm, error, "auto mode set-up")

    say = (lambda m: log.info(m)) if options.progress and comm.rank == 0 else (lambda m: None)
    home = next(model.parameters()).device
    if home.type != "cpu":
        model.to("cpu")  # profiling gets the whole GPU (the copies it trains live there); moved back below
    try:
        profile, device = _measure(comm, model, optimizer, loss_fn, sample_fn, zero_stage, home, cluster, device,
                                   options, bucket_size_mb, wrap_policy, say)
    finally:
        if home.type != "cpu":
            model.to(home)
    if profile.zero_stage != zero_stage:
        say(f"ZeRO-{zero_stage} does not fit batch 1 on every rank: running at ZeRO-{profile.zero_stage}")
    try:
        plan = make_plan(profile, global_batch_size, profile.zero_stage, options.strategy,
                         require_all_ranks=options.require_all_ranks, max_micro_steps=options.max_micro_steps)
    except (PlanError, ProfileError) as e:
        raise PlanError(f"auto mode: planning failed: {e}") from None
    say(f"plan ({plan.strategy}, ZeRO-{plan.zero_stage}, predicted "
        f"{plan.meta.get('predicted_samples_per_s', 0):.1f} samples/s):\n{plan.table()}")
    return AutoResult(plan, profile, device)
