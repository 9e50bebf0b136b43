"""The one way to build a run from a ``TrainConfig``: ``Trainer.from_config(cfg)``. ``poplar
train`` calls it after parsing; a Python program may call it too. Every rank calls it together,
inside the job's process group.

The road, in order:

1. the run's parts (``poplar.train.run_parts``): model, optimizer, loss and data;
2. the plan's source: ``poplar.plan`` (a plan file), auto mode (a GPU to profile, an emulated
   cluster's device, or a saved ``poplar.profile``), or DeepSpeed's even plan on a plain CPU;
3. the global batch, checked once against that source (``global_batch``);
4. the placement keys, ``poplar.shards`` and ``poplar.offload`` (DeepSpeed's offload keys mapped to
   it), which mean the same whatever the
   plan's source (``placed``): a list is one entry per rank (another length is an error), auto
   mode plans with it, an even plan takes it, and a plan file must agree with it (a disagreement
   is an error naming both); ``"auto"`` asks auto mode to choose, and without auto mode keeps the
   plan's own placement;
5. the engine (``PoplarEngine``) on that plan or in auto mode, and a ``FitConfig`` of the
   config's loop keys.

The device auto mode profiles on is this rank's GPU; where the config names an emulated cluster
the command line builds that cluster's device (``poplar.emulation``) and passes it as
``auto_device``: the product never imports the emulator.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from poplar.train.config import ConfigError, TrainConfig, check_compression_stage, secondary_shards_of
from poplar.train.config_terms import CONFIG_REMEDIES, even_plan
from poplar.train.deepspeed_auto import auto_line, global_batch_source
from poplar.train.placement_config import offload_rows
from poplar.train.run_parts import RunParts
from poplar.logs import log
from poplar.types.plans import Offload, Plan, shares_of
from poplar.types.route import Collectives
from poplar.zero.config import job_topology

if TYPE_CHECKING:
    from poplar.engine import PoplarEngine
    from poplar.profiler.devices import Device
    from poplar.train.options import FitConfig


def world_and_rank() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def choose_plan(cfg: TrainConfig, world: int, device: torch.device, auto_device: Any = None) -> tuple[Plan | None, bool]:
    """(a fixed Plan or None, whether to run auto mode): a plan file, else auto mode where there
    is a device to profile (a GPU, ``auto_device``) or a saved profile, else an even plan. A fixed
    plan's global batch is checked here, once."""
    if cfg.plan:
        plan = Plan.load(cfg.plan)
        global_batch(cfg, plan, world)
        return plan, False
    if device.type == "cuda" or auto_device is not None or cfg.profile:
        return None, True
    if cfg.cluster:
        raise ConfigError(f'"poplar.cluster" {cfg.cluster!r} names an emulated cluster, which only the command line '
                          '(poplar train) builds; from Python, give auto mode its device: '
                          'Trainer.from_config(cfg, auto_device=poplar.emulation.cluster_device(...))')
    if cfg.micro_batch_size is None:
        auto = ' ("auto" is auto mode\'s choice, and here there is no auto mode)' \
            if "train_micro_batch_size_per_gpu" in cfg.auto_notes else ""
        raise ConfigError('on a CPU without a GPU to profile, give "poplar.cluster" (emulate a cluster of GPUs), '
                          '"poplar.plan" (a plan file) or "train_micro_batch_size_per_gpu" (an even plan) as a '
                          f'number{auto}')
    return even_plan(world, global_batch(cfg, None, world), cfg.micro_batch_size, ConfigError), False


def global_batch(cfg: TrainConfig, plan: Plan | None, world: int) -> int:
    """The run's global batch, checked once against the plan's source: a plan file's rows
    against ``train_batch_size`` (or, with none, against the run it resumes); an even plan's
    DeepSpeed identity micro x accumulation x world."""
    if plan is None:
        gbs = cfg.global_batch_size(world)
        mbs, gas = cfg.micro_batch_size, cfg.accum_steps
        if not cfg.plan and mbs is not None and gas is not None and cfg.train_batch_size is not None \
                and mbs * gas * world != gbs:
            raise ConfigError(f"train_batch_size {gbs} != train_micro_batch_size_per_gpu {mbs} x "
                              f"gradient_accumulation_steps {gas} x {world} ranks")
        return gbs
    if cfg.train_batch_size is not None and plan.global_batch_size != cfg.train_batch_size:
        raise ConfigError(f'the plan {cfg.plan} trains a global batch of {plan.global_batch_size} samples (the sum of '
                          f'its rows) but "train_batch_size" is {cfg.train_batch_size}; make them agree: set '
                          f'"train_batch_size": {plan.global_batch_size}, or make a plan for '
                          f'{cfg.train_batch_size} (poplar plan --gbs {cfg.train_batch_size})')
    if cfg.train_batch_size is None:
        _check_resumed_batch(cfg, plan)
    return plan.global_batch_size


def _check_resumed_batch(cfg: TrainConfig, plan: Plan) -> None:
    """A plan file with no ``train_batch_size`` beside it keeps the global batch of the run it
    resumes. Looks only; a damaged directory is left for the resume to report."""
    from poplar.checkpoint import CheckpointError, find_latest, read_index

    if cfg.checkpoint_dir is None or not cfg.resume:
        return
    try:
        latest = find_latest(cfg.checkpoint_dir)
        saved = read_index(latest.path).get("plan") if latest is not None else None
        resumed = Plan.from_dict(saved).global_batch_size if saved is not None else None
    except (CheckpointError, ValueError, KeyError, TypeError):
        return
    if resumed is not None and resumed != plan.global_batch_size:
        raise ConfigError(f"the plan {cfg.plan} trains a global batch of {plan.global_batch_size} samples but the run "
                          f"it resumes from {cfg.checkpoint_dir} trained {resumed}; use a plan for {resumed} samples, "
                          f'or set "train_batch_size": {plan.global_batch_size} to change the global batch on purpose')


def shard_setting(cfg: TrainConfig, world: int) -> str | tuple[float, ...]:
    """``poplar.shards`` for a job of ``world`` ranks: "auto", "even" or one weight per rank."""
    if isinstance(cfg.shards, tuple) and len(cfg.shards) != world:
        raise ConfigError(f'"poplar.shards" gives {len(cfg.shards)} weights {list(cfg.shards)} but the job has {world} '
                          f'ranks; give one weight per rank, "even" or "auto"')
    return cfg.shards


def offload_setting(cfg: TrainConfig, world: int, auto: bool) -> tuple[Offload, ...] | None:
    """``poplar.offload`` as one placement per rank; None where the config says nothing (a plan
    file keeps its rows) or says "auto" to auto mode (its planner chooses). "auto" without auto
    mode asks for a choice nothing makes: an error."""
    if cfg.offload is None or (auto and cfg.offload == "auto"):
        return None
    if cfg.offload == "auto":
        source = f"the plan file {cfg.plan}" if cfg.plan else "an even plan (train_micro_batch_size_per_gpu)"
        raise ConfigError(f'"poplar.offload": "auto" lets auto mode\'s planner choose, but this run trains on '
                          f'{source}, which no planner chooses: give "none", "all" or rank indices, or leave the '
                          "plan to auto mode")
    return offload_rows(cfg.offload, world, ConfigError)


def placed(cfg: TrainConfig, plan: Plan, world: int) -> Plan:
    """``plan`` (a plan file or an even plan) under the config's shard weights and offload; a plan
    file that says otherwise is an error naming both."""
    shards, offloads = shard_setting(cfg, world), offload_setting(cfg, world, auto=False)
    if plan.world_size != world:
        raise ConfigError(f"the plan {cfg.plan} has {plan.world_size} rows but the job has {world} ranks; launch "
                          f"{plan.world_size} ranks or make a plan for {world}")
    if shards != "auto":
        weights = (1.0,) * world if shards == "even" else tuple(shards)
        if cfg.plan and shares_of(weights) != shares_of(plan.shard_weights):
            raise ConfigError(f'"poplar.shards" {shards if shards == "even" else list(shards)} and the plan file '
                              f"{cfg.plan}'s shard weights {list(plan.shard_weights)} disagree; give the weights in "
                              'one place: drop "poplar.shards", or make the plan file\'s "shard_weight" rows agree')
        plan = replace(plan, ranks=[replace(r, shard_weight=w) for r, w in zip(plan.ranks, weights)],
                       meta=dict(plan.meta))
    if offloads is not None:
        if cfg.plan and offloads != plan.offloads:
            raise ConfigError(f'"poplar.offload" ({[o.value for o in offloads]} per rank) and the plan file '
                              f"{cfg.plan}'s offload rows {[o.value for o in plan.offloads]} disagree; give the "
                              'placement in one place: drop "poplar.offload", or make the plan file\'s "offload" '
                              "rows agree")
        plan = plan.with_offloads(offloads)
    return plan


def with_collectives(cfg: TrainConfig, plan: Plan, world: int, stage: Any) -> Plan:
    """A fixed plan with the config's hpZ setting (``zero_hpz_partition_size``): secondary shards
    on hierarchical collectives, on the config's topology or the launcher's; and with its
    quantized collectives (``zero_quantized_*``, ``with_compression``)."""
    plan = with_compression(cfg, plan, stage)
    topology = job_topology(cfg.topology, world)
    if not secondary_shards_of(cfg.hpz_partition_size, topology, stage):
        return plan
    return replace(plan, meta=dict(plan.meta), collectives=Collectives.SECONDARY_SHARDS)


def auto_collectives(cfg: TrainConfig, world: int) -> str:
    """Auto mode's ``AutoOptions.collectives`` under the config's hpZ. DeepSpeed's
    ``zero_hpz_partition_size`` is a setting, not a hint: where it asks for secondary shards
    (``secondary_shards_of``, on the config's topology or the launcher's) the planner plans with
    them and no other way; at 1 (DeepSpeed's default: off, what a config without the key says
    too) the planner chooses ("auto")."""
    if cfg.hpz_partition_size == 1:
        return "auto"
    secondary_shards_of(cfg.hpz_partition_size, job_topology(cfg.topology, world), cfg.zero_stage)
    return Collectives.SECONDARY_SHARDS.value


def with_compression(cfg: TrainConfig, plan: Plan, stage: Any) -> Plan:
    """A fixed plan with the config's ``zero_quantized_weights`` / ``zero_quantized_gradients``
    (none given: the plan's own); ``poplar.allow_lossy`` asks a planner for a choice that a fixed
    plan does not make: an error."""
    if cfg.allow_lossy:
        source = f"the plan file {cfg.plan}" if cfg.plan else "an even plan (train_micro_batch_size_per_gpu)"
        raise ConfigError(f'"poplar.allow_lossy" lets auto mode\'s planner choose quantized collectives, but this run '
                          f'trains on {source}, which no planner chooses: set "zero_optimization.zero_quantized_weights"'
                          ' / "zero_quantized_gradients" to say which, or leave the plan to auto mode')
    if cfg.compression is None:
        return plan
    if cfg.plan and plan.compression.lossy and plan.compression != cfg.compression:
        raise ConfigError(f"the zero_quantized_* keys ({cfg.compression.describe()}) and the plan file {cfg.plan}'s "
                          f'"compression" ({plan.compression.describe()}) disagree; say it in one place: drop the keys, '
                          'or edit the plan file\'s "compression"')
    check_compression_stage(cfg.compression, stage if isinstance(stage, int) else None)
    return replace(plan, meta=dict(plan.meta), compression=cfg.compression)


def profile_store_dir(cfg: TrainConfig) -> Any:
    """Where auto mode keeps profiles: $POPLAR_PROFILE_STORE when set, else beside the
    checkpoints (``<checkpoint dir>/../profiles``), else the user's cache (AutoOptions' default)."""
    from poplar.profiler.store import ENV_VAR

    if os.environ.get(ENV_VAR) is None and cfg.checkpoint_dir:
        return os.path.join(os.path.dirname(os.path.abspath(cfg.checkpoint_dir)), "profiles")
    return "default"


def _auto_options(cfg: TrainConfig, parts: RunParts, world: int, auto_device: Device | None) -> tuple[Any, Any]:
    """(auto mode's options, the fingerprint its profile is saved with beside the checkpoints,
    or None)."""
    from poplar.auto import AutoOptions
    from poplar.train import run_parts
    from poplar.types.profiles import Profile

    profile: Any = cfg.profile
    fingerprint = None
    if profile is None:  # a restart plans from the profile saved with the checkpoints when nothing changed
        fingerprint = run_parts.profile_fingerprint(cfg, parts.model, parts.train_data[0], world, auto_device)
        saved = run_parts.reusable_profile(cfg, fingerprint, world_and_rank()[1])
        profile = Profile.from_dict(saved) if saved is not None else None
    offloads = offload_setting(cfg, world, auto=True)
    options = AutoOptions(profile_data=parts.train_data, device=auto_device, strategy=cfg.strategy,
                          shards=shard_setting(cfg, world), profile=profile, store=profile_store_dir(cfg),
                          offload=offloads if offloads is not None else "auto" if cfg.offload == "auto" else "none",
                          profile_output=os.path.join(cfg.report_dir, "profile.json") if cfg.report_dir else None,
                          remedies=CONFIG_REMEDIES, compression=cfg.compression, allow_lossy=cfg.allow_lossy,
                          collectives=auto_collectives(cfg, world))
    return options, fingerprint


def build_engine(cfg: TrainConfig, parts: RunParts, auto_device: Device | None = None) -> PoplarEngine:
    """The engine of ``cfg`` over ``parts``: on a fixed plan (a plan file or an even plan, under
    the config's placement) or in auto mode."""
    from poplar.engine import PoplarEngine
    from poplar.train import run_parts
    from poplar.zero.config import ZeroConfig

    world, rank = world_and_rank()
    device = next(parts.model.parameters()).device
    plan, auto = choose_plan(cfg, world, device, auto_device)
    # a stage not given: auto mode chooses; with a plan, the plan file's stage, else DeepSpeed's 0
    stage = cfg.zero_stage if cfg.zero_stage is not None else \
        "auto" if plan is None else (plan.zero_stage if plan.zero_stage is not None else 0)
    kwargs: dict[str, Any] = {"zero_stage": ZeroConfig(stage, cfg.bucket_size_mb, topology=cfg.topology),
                              "max_grad_norm": cfg.gradient_clipping, "loss_fn": parts.loss_fn,
                              "mixed_precision": cfg.mixed_precision}
    if cfg.activation_checkpointing is not None:
        kwargs["activation_checkpointing"] = cfg.activation_checkpointing
    fingerprint = None
    if plan is None:
        kwargs["global_batch_size"] = global_batch(cfg, None, world)
        kwargs["auto"], fingerprint = _auto_options(cfg, parts, world, auto_device)
    else:
        kwargs["plan"] = plan = with_collectives(cfg, placed(cfg, plan, world), world, stage)
    if rank == 0 and cfg.auto_notes:  # before profiling: every value is known by now
        gbs = plan.global_batch_size if plan is not None else kwargs["global_batch_size"]
        log.info(auto_line(cfg.auto_notes, gbs, global_batch_source(cfg.micro_batch_size, world, cfg.plan),
                           cfg.iterations))
    engine = PoplarEngine(parts.model, parts.optimizer, **kwargs)
    if fingerprint is not None:
        run_parts.save_profile(cfg, engine.profile, fingerprint, rank)
    if rank == 0 and plan is not None:
        log.info(f"plan ({plan.strategy or 'from file'}, ZeRO-{engine.zero_stage}):\n{plan.table()}")
    return engine


def fit_config(cfg: TrainConfig, parts: RunParts) -> FitConfig:
    """The loop's policies of ``cfg``: schedule, evaluation, checkpoints, reports; stops on signals."""
    from poplar.train.data import LoaderOptions
    from poplar.train.options import CheckpointOptions, EvalOptions, FitConfig, ReportOptions

    return FitConfig(
        lr_schedule=cfg.lr_schedule(),
        evaluation=None if parts.eval_data is None and cfg.eval_every is None
        else EvalOptions(parts.eval_data, every=cfg.eval_every),
        checkpoint=None if cfg.checkpoint_dir is None
        else CheckpointOptions(cfg.checkpoint_dir, every=cfg.checkpoint_every, keep_checkpoints=cfg.checkpoint_keep,
                               resume=cfg.resume, async_save=cfg.checkpoint_async),
        report=ReportOptions(cfg.report_dir, log_every=cfg.log_every, tensorboard=cfg.tensorboard),
        loader=LoaderOptions(seed=cfg.seed), stop_on_signals=True)
