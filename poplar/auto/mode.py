"""Auto mode: inside a running job, profile every rank's device, plan, and hand the plan to the
engine. ``PoplarEngine(model, optimizer, global_batch_size=..., loss_fn=...,
auto=AutoOptions(profile_data=...))`` calls ``auto_plan``; every rank takes part (it is
collective, like the engine's constructor).

Each rank's device: ``AutoOptions.device`` (a profiler ``Device``: a ``CudaDevice``, e.g. capped
to a smaller card's memory, or a device emulated on CPU by ``poplar.emulation``), else the GPU
the model is on (``CudaDevice``). A device that observes profiling runs
(``poplar.profiler.phases.ProfileObserver``) prepares for the workload first, every rank
together (an emulated GPU calibrates its scales there), whether the profile is measured or reused.

Profiling trains fresh copies of the model, built from a CPU snapshot taken before the engine
shards anything, with an optimizer of the user's class and hyper-parameters, on batches drawn
from ``profile_data``: a map-style dataset (its first samples, cycled) or ``sample_fn(b)``.
A measured profile can be reused (``AutoOptions.profile``: a path or a ``Profile``) to skip
profiling; ``AutoOptions.profile_output`` saves it (rank 0).

Precision. ``auto_plan(..., mixed_precision=...)`` (the engine passes its own) profiles under
the run's policy: the copies trained run at that precision, emulated devices compute at their
presets' speed for it, and the profile records it. A device without it (bf16 on a V100 or T4) is
one clear error on every rank, before anything is profiled; a reused profile measured at another
precision is refused (its mbs and speeds are not this run's).
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from poplar.comm import Communicator
from poplar.planner import plan as make_plan
from poplar.planner.planning import batch_using_every_rank, load_profile
from poplar.types.route import Collectives
from poplar.planner.planning import CollectivesRequest
from poplar.auto.choice import Choice, ConfigurationSearch, PlanLimits
from poplar.auto.samples import sample_fn_of
from poplar.auto.stored import StoreUse, store_key
from poplar.planner.candidates import RULES, CandidateRow
from poplar.profiler.candidate_run import Candidates
from poplar.profiler.cuda_device import CudaDevice
from poplar.profiler.devices import Device
from poplar.profiler.escalation import OffloadEscalation
from poplar.profiler.job import ProfilingPolicy
from poplar.profiler.phases import observers_of
from poplar.profiler.precision import agree_precision_support, profile_precision
from poplar.profiler.profile_run import OneConfiguration, ProfileJob, ProfileOptions, ProfileRun, confirm_plan_memory
from poplar.profiler.store import ProfileStore, default_store_dir
from poplar.profiler.store_reuse import StoreRequest
from poplar.types.compression import CommPolicy
from poplar.types.configuration import Configuration, heaviest
from poplar.logs import log
from poplar.types.plans import Offload, Plan, PlanError
from poplar.types.precision import MixedPrecision, precision_of, resolve_precision
from poplar.types.profiles import Profile, ProfileError
from poplar.zero.config import ZeroConfig
from poplar.zero.optim import optimizer_like


@dataclass(frozen=True)
class Remedies:
    """How auto mode's messages name their fixes: in the Python API's terms by default; a door
    with terms of its own (the JSON config's keys) gives its own. ``require_all_ranks`` None: the
    door cannot set it, and the message leaves it out."""

    global_batch: str = "a global batch of {batch}"
    require_all_ranks: str | None = "AutoOptions(require_all_ranks=True)"


@dataclass
class AutoOptions(ProfilingPolicy):
    """Knobs of auto mode; the defaults suit most runs. The profiling knobs (``repeats``,
    ``exposure_precision``, ``max_batch``, ``escalate``, ``progress``) are its
    ``ProfilingPolicy``, handed to the profiler whole."""

    profile_data: Any = None  # what profiling trains on: a map-style dataset or sample_fn(b)
    device: Device | None = None  # this rank's device (default: the model's GPU)
    strategy: str = "poplar"  # or "even" / "flops" (the baselines, for comparison)
    # each rank's share of the sharded state: "auto" (chosen with the batches from the profile's
    # memory, poplar.planner.shards: even unless other weights are predicted faster by more than
    # the plan's tie, and those confirmed by one real step), "even", or one weight per rank
    shards: str | tuple[float, ...] = "auto"
    # where each rank's optimizer lives: "none" (on its device), "auto" (a rank offloads it to host
    # memory only where that lets the model fit or is predicted faster by more than the plan's tie,
    # poplar.planner.offload_pricing, confirmed by one real step) or one Offload per rank
    offload: str | tuple[Offload, ...] = "none"
    profile: Profile | str | os.PathLike | None = None  # reuse a measured profile instead of profiling
    profile_output: str | os.PathLike | None = None  # save the measured profile here (JSON)
    require_all_ranks: bool = False  # every rank must get at least one sample
    max_micro_steps: int | None = None  # bound on micro-steps per rank per iteration
    collate_fn: Callable[[list], Any] | None = None  # for profile_data given as a dataset
    # how the configuration (ZeRO stage x activation checkpointing) is chosen where the engine
    # leaves it open (zero_stage="auto", activation_checkpointing=None / "auto"): "fastest"
    # predicted iteration among those that fit every rank, or "first_fit" (the paper: the lowest
    # stage where batch 1 fits); a loaded profile keeps its own configuration
    choose: str = "fastest"
    stages: tuple[int, ...] = (0, 1, 2, 3)  # the stages zero_stage="auto" chooses among
    # how the plan's collectives cross nodes, on a job whose topology spans nodes (the profile
    # then measures each link): "auto" (the fastest predicted of flat, hierarchical and, at
    # ZeRO-3, secondary shards; poplar.planner.collective_choice), or one of them by name
    collectives: str = "auto"
    # quantized collectives (lossy: the step is no longer exactly the global batch's; docs/design.md
    # §5.2): ``compression`` a CommPolicy the plan uses as given (the stages auto mode may choose
    # are those it admits); with none given, ``allow_lossy`` lets the planner quantize where that is
    # predicted faster than exact by more than the plan's tie, on a job that spans nodes. Neither
    # (the default): every plan is exact.
    allow_lossy: bool = False
    compression: CommPolicy | None = None
    # where measured profiles are kept per device type and reused (poplar.profiler.store): a
    # directory, a ProfileStore, None (no store) or "default" ($POPLAR_PROFILE_STORE, "off" for
    # none, else ~/.cache/poplar/profiles)
    store: Any = "default"
    remedies: Remedies = Remedies()  # the words its messages use for their fixes

    @property
    def limits(self) -> PlanLimits:
        return PlanLimits(self.require_all_ranks, self.max_micro_steps)

    @property
    def collectives_request(self) -> CollectivesRequest:
        """How the plan's collectives may run and what they send, as the planner takes it."""
        return CollectivesRequest(self.collectives, self.compression, self.allow_lossy)


@dataclass
class AutoResult:
    """What auto mode hands the engine: the plan (its rows carry each rank's shard weight and
    optimizer placement), the profile it was planned from, this rank's profiler device (None with
    a loaded profile and no device to emulate), the chosen activation checkpointing, the
    configurations considered ("fastest" / "first_fit") and how the profile store served it
    (None: no store used)."""

    plan: Plan
    profile: Profile
    device: Device | None
    activation_checkpointing: Any = None
    candidates: list[CandidateRow] | None = None
    store_use: StoreUse | None = None

    @property
    def offloads(self) -> tuple[Offload, ...]:
        """Where each rank's optimizer lives in the plan."""
        return self.plan.offloads


@dataclass
class AutoJob:
    """What one auto mode start profiles and plans: the job's parts, its settings and the choice."""

    comm: Communicator
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    sample_fn: Any
    zero: ZeroConfig
    options: AutoOptions
    policy: MixedPrecision | None
    say: Callable[[str], None]
    choice: Choice


class Measurement(NamedTuple):
    """The profile auto mode plans from, this rank's device, the profiling job, how the store
    served it, and the configuration search (None: one configuration, or a loaded profile)."""

    profile: Profile
    device: Device | None
    job: ProfileJob
    store_use: StoreUse | None
    search: ConfigurationSearch | None


def store_of(options: AutoOptions) -> ProfileStore | None:
    """The profile store ``options.store`` names (None: none)."""
    if isinstance(options.store, ProfileStore) or options.store is None:
        return options.store
    directory = default_store_dir() if options.store == "default" else options.store
    return ProfileStore(directory) if directory is not None else None


def clone_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                    template: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and param-group settings over ``model``, a copy of
    ``template`` (the model ``optimizer`` was built on): parameters are matched by position."""
    index = {id(p): i for i, p in enumerate(template.parameters())}
    params = list(model.parameters())
    if any(id(p) not in index for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer holds a parameter that is not the model's; build it on "
                         "model.parameters()")
    return optimizer_like(optimizer, [[params[index[id(p)]] for p in g["params"]] for g in optimizer.param_groups])


def _profile_job(auto: AutoJob) -> ProfileJob:
    """The profiling job: fresh copies of the model (from its CPU snapshot: the caller moved the
    model there), an optimizer like the user's, the options for the choice."""
    snapshot = copy.deepcopy(auto.model)
    model_fn = lambda: copy.deepcopy(snapshot)  # noqa: E731
    optimizer_fn = lambda m: clone_optimizer(auto.optimizer, m, auto.model)  # noqa: E731
    choice, options, zero = auto.choice, auto.options, auto.zero
    binding = len(choice.stages) == 1  # a given stage: no escalation, an error naming the stage that fits
    policy = replace(options.policy(), escalate=options.escalate and not binding)
    popts = ProfileOptions(**vars(policy), zero_stage=min(choice.stages), bucket_size_mb=zero.bucket_size_mb,
                           wrap_policy=zero.wrap_policy, model_name=type(auto.model).__name__,
                           mixed_precision=auto.policy,
                           activation_checkpointing=None if choice.active else choice.checkpointing,
                           # "auto": ranks batch 1 fits at no stage may be profiled with their optimizer offloaded
                           offload_escalation=OffloadEscalation.SHORT_RANKS if options.offload == "auto"
                           else OffloadEscalation.NEVER,
                           # a card's speed past its even-shard mbs matters only to shard weights
                           time_past_mbs=options.shards != "even",
                           # the runtime's nodes: on a topology that spans nodes each link is measured
                           topology=auto.comm.topology if auto.comm.topology.spans_nodes else None)
    return ProfileJob(model_fn, auto.loss_fn, auto.sample_fn, optimizer_fn, popts,
                      heaviest(choice.configs()) if choice.active else None)


def _load_or_measure(auto: AutoJob, home: torch.device) -> Measurement:
    """The profile (loaded from ``options.profile``, or measured), this rank's device (``home``:
    where the model lives, moved to the CPU meanwhile) and the profiling job."""
    comm, options = auto.comm, auto.options
    pjob = _profile_job(auto)
    loaded = _load_profile(comm, options, auto.policy, auto.say, auto.choice.stages) if options.profile is not None \
        else None
    device = _rank_device(comm, options.device, home, needed=loaded is None)
    if loaded is not None:  # a reused profile: the device prepares for it, and must compute at its precision
        for observer in observers_of(device):
            observer.prepare_profiling(comm, pjob, loaded)
        if device is not None:
            agree_precision_support(comm, device, auto.policy, "auto mode precision")
        return Measurement(loaded, device, pjob, None, None)
    assert device is not None
    return _measure(auto, pjob, device)


def _measure(auto: AutoJob, pjob: ProfileJob, device: Device, refresh: frozenset[str] = frozenset()) -> Measurement:
    """The profiling run: from the store (but for the device types of ``refresh``, measured again),
    else at the one configuration or the search's choice; rank 0's copy on every rank (the
    per-rank copies differ only in their own wall-clock notes)."""
    comm, options, choice, say = auto.comm, auto.options, auto.choice, auto.say
    store, request = store_of(options), None
    if store is not None:
        key = store_key(auto.model, auto.optimizer, auto.sample_fn, zero_stage=auto.zero.stage,
                        stages=tuple(choice.stages), checkpointing=choice.checkpointing,
                        rule=options.choose if choice.active else "single", bucket_size_mb=auto.zero.bucket_size_mb,
                        policy=auto.policy)
        request = StoreRequest(store, key, choice.checkpointing, refresh)
    search = ConfigurationSearch(choice, say, options.limits, noise=pjob.options.tolerance,
                                 progress=options.progress and comm.rank == 0) if choice.active else None
    run = ProfileRun(pjob, device, process_group=comm.group, log=lambda m: say(m.removeprefix("[poplar profile] ")),
                     store=request)
    announce = f"profiling {comm.world_size} ranks at ZeRO-{pjob.options.zero_stage}, {precision_of(auto.policy)} ..."
    measured = run.measure(Candidates(search) if search is not None else OneConfiguration(announce))
    profile = measured.profile
    if measured.store_use is StoreUse.REUSED:
        agree_precision_support(comm, device, auto.policy, "auto mode precision")
        return Measurement(profile, device, pjob, measured.store_use, search)
    profile = Profile.from_dict(comm.all_gather_object(profile.to_dict() if comm.rank == 0 else None,
                                                       tag="auto:profile")[0])
    if options.profile_output is not None and comm.rank == 0:
        profile.save(options.profile_output)
    return Measurement(profile, device, pjob, measured.store_use, search)


class StaleProfiles(Exception):
    """A plan from stored profiles failed its check step on ``ranks`` (stored ranks): the stored
    profiles of their device types no longer describe the job."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"ranks {ranks}")
        self.ranks = ranks


def _plan(auto: AutoJob, measured: Measurement, checkpointing: Any) -> Plan:
    """The plan; one whose shards are not even, or whose ranks offload, or whose profile came
    (in part) from the store, is first confirmed by one real step of every rank's largest
    micro-batch at its weights and placement (while the model is off the device). Where that
    does not fit a rank whose profile was stored: ``StaleProfiles``; elsewhere the plan is
    replaced by the even-shard plan. A profile measured at uneven weights (the model fitted no
    even shards) plans at them unless ``options.shards`` chooses, and falls back to them."""
    comm, options, say, global_batch_size = auto.comm, auto.options, auto.say, auto.choice.gbs
    profile, device, job = measured.profile, measured.device, measured.job
    limits = {"require_all_ranks": options.require_all_ranks, "max_micro_steps": options.max_micro_steps}
    shards, fallback = options.shards, "even"
    weights = profile.shard_weights
    if weights is not None and len(set(weights)) > 1:  # the searches found no fit at even shards
        fallback = tuple(weights)
        if shards == "even":
            say(f"the model fits every rank only with uneven shards: planning at the measured weights {weights}")
            shards = fallback
    try:
        plan = make_plan(profile, global_batch_size, profile.zero_stage, options.strategy, shards=shards,
                         offload=options.offload, collectives=options.collectives_request, **limits)
        offloads = any(o is not Offload.NONE for o in plan.offloads)
        stored = profile.store.reused if profile.store is not None and \
            measured.store_use in (StoreUse.REUSED, StoreUse.PARTIAL) else []
        if (not plan.even_shards or offloads or stored) and device is not None and job.sample_fn is not None:
            configured = job.at(Configuration(profile.zero_stage, checkpointing))
            failed = confirm_plan_memory(configured, device, comm, plan)
            if any(profile.ranks[r].device_type in stored for r in failed):
                raise StaleProfiles([r for r in failed if profile.ranks[r].device_type in stored])
            if failed and fallback != "even" and plan.shard_weights == fallback:
                raise PlanError(f"one step of the planned micro-batches does not fit on ranks {failed} even at the "
                                f"shard weights the capacity searches found ({list(fallback)}); use a smaller model, "
                                "activation checkpointing or cards with more memory")
            if failed:
                say(f"the planned shard weights do not fit a step on ranks {failed}: planning with "
                    f"{'even shards' if fallback == 'even' else f'the measured weights {list(fallback)}'}")
                placed = [Offload(o) for o in profile.offloads] if profile.offloads is not None else "none"
                plan = make_plan(profile, global_batch_size, profile.zero_stage, options.strategy, shards=fallback,
                                 offload=placed, collectives=options.collectives_request, **limits)  # and every optimizer where the profile measured it
                plan.choice = replace(plan.choice, shard_trial_failed_on=failed)
    except (PlanError, ProfileError) as e:
        raise PlanError(f"auto mode: planning failed: {e}") from None
    idle = [r for r, row in enumerate(plan.ranks) if row.num_samples == 0]
    if idle and comm.rank == 0:
        log.warning(idle_ranks_line(profile, plan, idle, options))
    return plan


def _planned(auto: AutoJob, measured: Measurement) -> tuple[Measurement, Any, Plan]:
    """The measurement, the activation checkpointing and the plan. Where a plan from stored
    profiles fails its check step (``StaleProfiles``), the device types of the ranks it failed on
    are profiled again, then, if the next plan fails too, every type; the fresh profiles replace
    the stored ones."""
    refresh: frozenset[str] = frozenset()
    while True:  # at most twice more: the last profile is measured whole, with nothing to check against the store
        chosen = _chosen_checkpointing(auto, measured)
        try:
            return measured, chosen, _plan(auto, measured, chosen)
        except StaleProfiles as stale:
            profile, device = measured.profile, measured.device
            assert device is not None
            types = sorted({profile.ranks[r].device_type for r in stale.ranks})
            refresh = frozenset(profile.device_types()) if refresh else frozenset(types)
            if auto.comm.rank == 0:
                log.warning(f"profile store: one step of the plan's largest micro-batch does not fit on ranks "
                            f"{stale.ranks} ({', '.join(types)}): their stored profiles do not describe this job; "
                            f"profiling {', '.join(sorted(refresh))} again")
            measured = _measure(auto, measured.job, device, refresh)


def idle_ranks_line(profile: Profile, plan: Plan, idle: list[int], options: AutoOptions) -> str:
    """The warning for ranks the plan gives 0 samples: who, why, and the global batch that would
    give every rank samples."""
    names = ", ".join(f"{r} ({profile.ranks[r].device_type})" for r in idle)
    using = batch_using_every_rank(profile, plan.global_batch_size, plan.zero_stage, options.strategy,
                                   max_micro_steps=options.max_micro_steps)
    words = options.remedies
    remedy = (f"{words.global_batch.format(batch=using)} would give every rank samples" if using is not None
              else "no larger global batch would give every rank samples either")
    also = f", or {words.require_all_ranks} gives each at least one" if words.require_all_ranks else ""
    out = set(plan.left_out)
    role = ("they are left out of the training step: no samples, no shard, only the step's status agreement"
            if out >= set(idle) else "they hold their shard of the state and join every collective")
    return (f"ranks {names} get 0 samples at global batch {plan.global_batch_size} (the plan is predicted faster "
            f"without their compute; {role}): {remedy}" + also)


def _load_profile(comm: Communicator, options: AutoOptions, policy: MixedPrecision | None,
                  say: Callable[[str], None], stages: tuple[int, ...]) -> Profile:
    """``options.profile``, checked on every rank (its rank count and precision must be this run's,
    its stage one of ``stages``)."""
    error, profile = None, None
    try:
        profile = load_profile(options.profile)
        measured, wanted = profile_precision(profile), precision_of(policy)
        if profile.world_size != comm.world_size:
            error = (f"the profile has {profile.world_size} ranks but the job has {comm.world_size}; "
                     "profile this cluster again")
        elif measured is not wanted:
            error = (f"the profile was measured at {measured} but this run computes in {wanted}: its micro-batch "
                     f"sizes and speeds are not this run's; profile again with mixed_precision=\"{wanted}\" "
                     f"or run at {measured}")
        elif profile.zero_stage not in stages:
            asked = "/".join(str(s) for s in stages)
            error = (f"the profile was measured at ZeRO-{profile.zero_stage} but this run is to run at ZeRO-{asked}: "
                     f"give zero_stage={profile.zero_stage} or \"auto\" to run as profiled, or profile again")
    except (ProfileError, OSError, ValueError) as e:
        error = f"cannot use the profile {options.profile}: {e}"
    comm.agree(error, "auto mode profile", error_type=ProfileError)
    assert profile is not None
    say(f"using the profile {'given' if isinstance(options.profile, Profile) else options.profile} "
        f"(ZeRO-{profile.zero_stage})")
    return profile


def _rank_device(comm: Communicator, device: Device | None, home: torch.device, *, needed: bool) -> Device | None:
    """This rank's device: the one given, or, when there is still a profile to measure
    (``needed``), the GPU the model is on."""
    if device is not None or not needed:
        return device
    error = None
    if home.type == "cuda":
        device = CudaDevice(home)
    else:
        error = ("the model is on the CPU and no device was given: auto mode measures each rank's device; pass "
                 "AutoOptions(device=...) (on CPU, poplar.emulation.cluster_device(...) emulates a GPU of a "
                 "cluster), AutoOptions(profile=...), or a plan")
    comm.agree(error, "auto mode device", error_type=ProfileError)
    return device


def allowed_stages(stage: Any, choosable: Any) -> tuple[tuple[int, ...], str | None]:
    """(the stages auto mode may run at: the one given, or ``choosable`` for "auto"; what is
    wrong with them or None)."""
    if stage == "auto":
        stages = tuple(sorted(set(choosable)))
        if not stages or any(isinstance(s, bool) or s not in (0, 1, 2, 3) for s in stages):
            return (0,), f"AutoOptions.stages must be ZeRO stages among 0-3, got {choosable!r}"
        return stages, None
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        return (0,), f'zero_stage must be 0, 1, 2, 3 or "auto" (auto mode chooses), got {stage!r}'
    return (int(stage),), None


def lossy_line(plan: Plan) -> str:
    """The line auto mode logs where the plan's collectives are quantized or were priced so."""
    record = plan.choice.compression_choice
    if record is not None:
        return f"auto mode: {record.describe()}"
    return f"auto mode: {plan.compression.describe()} (as given): the step is no longer exactly the global batch's"


def lossy_stages(options: AutoOptions, stages: tuple[int, ...],
                 error: str | None) -> tuple[tuple[int, ...], str | None]:
    """(the stages auto mode may run at with ``options.compression``: those it admits; what is
    wrong with the lossy options or ``error``)."""
    try:
        options.collectives_request  # noqa: B018  (the request checks allow_lossy and compression)
    except PlanError as e:
        return stages, f"AutoOptions: {e}"
    given = options.compression
    if given is None or error is not None:
        return stages, error
    admitted = tuple(s for s in stages if given.problem(s) is None)
    if not admitted:
        return stages, f"AutoOptions.compression: {given.problem(stages[-1])}"
    return admitted, None


def _check_inputs(global_batch_size: Any, loss_fn: Callable | None, options: AutoOptions,
                  mixed_precision: Any) -> tuple[str | None, MixedPrecision | None, Callable[[int], Any] | None]:
    """(what is wrong with auto mode's inputs or None, the precision policy, ``sample_fn``)."""
    try:
        policy = resolve_precision(mixed_precision)
    except ValueError as e:
        return str(e), None, None
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        return f"global_batch_size must be an int >= 1, got {global_batch_size!r}", policy, None
    if loss_fn is None:
        return "auto mode needs loss_fn(module, micro_batch) -> mean loss, to profile and to train", policy, None
    if options.profile is None and options.profile_data is None:
        return ("auto mode needs AutoOptions(profile_data=...) (a dataset or sample_fn(b)) to profile on, or "
                "AutoOptions(profile=...)"), policy, None
    try:
        return None, policy, None if options.profile_data is None else sample_fn_of(options.profile_data,
                                                                                  options.collate_fn)
    except ValueError as e:
        return str(e), policy, None


def _auto_job(comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer, global_batch_size: int,
              zero_stage: int | str | ZeroConfig, loss_fn: Callable | None, options: AutoOptions,
              mixed_precision: Any, activation_checkpointing: Any) -> AutoJob:
    """Auto mode's inputs checked (one agreement: the same error on every rank) and its choice."""
    zero = ZeroConfig.of(zero_stage)
    error, policy, sample_fn = _check_inputs(global_batch_size, loss_fn, options, mixed_precision)
    stages, stage_error = allowed_stages(zero.stage, options.stages)
    stages, stage_error = lossy_stages(options, stages, stage_error)
    comm.agree(error or stage_error, "auto mode set-up", error_type=ProfileError)
    say = (lambda m: log.info(m)) if options.progress and comm.rank == 0 else (lambda m: None)
    if options.choose not in RULES:
        raise ValueError(f"AutoOptions.choose must be one of {RULES}, got {options.choose!r}")
    ways = ("auto",) + tuple(c.value for c in Collectives)
    if options.collectives not in ways:
        raise ValueError(f"AutoOptions.collectives must be one of {ways}, got {options.collectives!r}")
    if activation_checkpointing == "auto":
        activation_checkpointing = None
    choice = Choice(global_batch_size, options.choose, activation_checkpointing, stages,
                    active=options.choose == "fastest" and options.profile is None)
    return AutoJob(comm, model, optimizer, loss_fn, sample_fn, zero, options, policy, say, choice)


def _chosen_checkpointing(auto: AutoJob, measured: Measurement) -> Any:
    """The activation checkpointing to run with: the search's choice, the one given, or the
    reused profile's; and a line on the configuration chosen."""
    choice, profile, say, stages = auto.choice, measured.profile, auto.say, auto.choice.stages
    config = measured.search.chosen_config if measured.search is not None else None
    chosen = config.checkpointing if config is not None else choice.checkpointing
    if chosen is None and profile.activation_checkpointing:
        chosen = True  # a reused profile measured with checkpointing: train as it was measured
    if config is not None and len(choice.configs()) > 1:
        ckpt = " with activation checkpointing" if config.checkpointed else ""
        say(f"running at ZeRO-{profile.zero_stage}{ckpt}: the fastest configuration that fits (table above)")
    elif profile.zero_stage != min(stages) and measured.store_use in (StoreUse.REUSED, StoreUse.PARTIAL):
        say(f"running at ZeRO-{profile.zero_stage}: the configuration chosen when the stored profiles were measured")
    elif profile.zero_stage != min(stages):
        say(f"ZeRO-{min(stages)} does not fit batch 1 on every rank: running at ZeRO-{profile.zero_stage}, the "
            "lowest stage that fits")
    return chosen


def _with_record(plan: Plan, measured: Measurement) -> Plan:
    """The plan, saying how its configuration was chosen and how the store served the profile."""
    recorded = measured.profile.auto_choice
    if recorded:  # chosen now, or when the reused profile was measured: the plan says how
        plan.choice = replace(plan.choice, candidates=recorded.candidates, choice_rule=recorded.rule,
                              profiling_s=recorded.profiling_s)
    if measured.store_use is not None:
        plan.choice = replace(plan.choice, profile_store=measured.store_use.value)
    return plan


def auto_plan(comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer, *, global_batch_size: int,
              zero_stage: int | str | ZeroConfig, loss_fn: Callable | None, options: AutoOptions | None = None,
              mixed_precision: Any = None, activation_checkpointing: Any = None) -> AutoResult:
    """Load or measure the profile, choose the configuration, plan, and log the plan: the
    engine's auto mode. ``zero_stage``: the stage to run at (binding: a stage where batch 1 does
    not fit some rank is an error naming the lowest stage that would), or "auto" to choose among
    ``options.stages`` (with the runtime settings profiling uses, as a ``ZeroConfig``);
    ``activation_checkpointing`` likewise: a value is binding, None or "auto" lets auto mode
    choose. ``mixed_precision`` is the run's precision (the engine's argument: None, "fp32",
    "bf16", "fp16" or a ``MixedPrecision``); profiling runs under it. The result's plan carries
    every rank's shard weight and optimizer placement."""
    auto = _auto_job(comm, model, optimizer, global_batch_size, zero_stage, loss_fn, options or AutoOptions(),
                     mixed_precision, activation_checkpointing)
    home = next(model.parameters()).device
    if home.type != "cpu":
        model.to("cpu")  # profiling gets the whole GPU (the copies it trains live there); moved back below
    try:
        measured, chosen, plan = _planned(auto, _load_or_measure(auto, home))
    except BaseException:
        if home.type != "cpu":
            # the failed profiling's frames still hold its device memory until this error is
            # handled: where the model does not fit back beside them, that error is the one to report
            with contextlib.suppress(torch.OutOfMemoryError):
                model.to(home)
        raise
    if home.type != "cpu":
        model.to(home)
    auto.say(f"plan ({plan.strategy}, ZeRO-{plan.zero_stage}, predicted "
             f"{plan.predicted_samples_per_s or 0:.1f} samples/s):\n{plan.table()}")
    if comm.rank == 0 and (plan.compression.lossy or plan.choice.compression_choice is not None):
        log.info(lossy_line(plan))  # lossy steps are said whether or not progress is
    rows = measured.search.rows if measured.search is not None else None
    return AutoResult(_with_record(plan, measured), measured.profile, measured.device, chosen, rows,
                      measured.store_use)
