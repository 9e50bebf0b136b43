"""The JSON config of ``poplar train``: DeepSpeed's keys where they mean the same thing, and a
``poplar`` section for the rest. Every key is checked; an unknown or unsupported one is an
error that names it (a typo must not silently change a run). Every problem of a config is said
at once, in one error (``ConfigProblems``): a bad key hides no other. Paths are relative to the
current directory, as DeepSpeed's are.

    {
      "train_batch_size": 64,                      global batch (samples per optimizer step)
      "train_micro_batch_size_per_gpu": 8,         optional; only for an even plan (see below)
      "gradient_accumulation_steps": 2,            optional; DeepSpeed's identity is checked
      "gradient_clipping": 1.0,
      "steps_per_print": 10,
      "seed": 0,
      "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7},  elements per gradient bucket, as DeepSpeed
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.01}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 3e-4,
                                                          "total_num_steps": 100}},
      "bf16": {"enabled": true},                   or "fp16": {"enabled": true, "loss_scale": 0, ...}
      "poplar": {
        "iterations": 100,                          train until this iteration
        "model": "llama-small",                     required (there is no default model): a built-in name,
                                                    {"name": "llama-small", "max_seq_len": 64, ...},
                                                    {"hf_config": "gpt2/config.json", "n_layer": 2} (a Hugging
                                                    Face config, randomly initialised), {"hf_pretrained": "dir"}
                                                    (fine-tune: from_pretrained weights, the dir's
                                                    tokenizer.json), or "pkg.mod:function"
                                                    / {"factory": "pkg.mod:function", ...keyword arguments}
        "data": {"path": null, "seq_len": 64,       .txt, .jsonl or a datasets save_to_disk dir; null: the shipped corpus
                 "tokenizer": null,                 null: byte-level; or a Hugging Face tokenizer.json
                 "packing": true,                   false: one padded sample per document, token-weighted loss
                 "text_key": "text",                the JSONL field holding the text
                 "eval_fraction": 0.1,              held out for evaluation (0: none), or "eval_path": a file
                 "eval_path": null},
        "eval_every": null,                         evaluate every k iterations (and always at the end)
        "tensorboard": null,                        event files in report_dir/tensorboard (null: if installed)
        "activation_checkpointing": "auto",         auto mode chooses (also when not given); false, true
                                                    (the layer stack), a class name or a list of them: binding
        "cluster": "B",                             CPU: emulate this cluster (built-in name or JSON file)
        "strategy": "poplar",                       or "even" / "flops"
        "shards": "auto",                           each rank's share of the sharded state: "auto" (chosen
                                                    with the batches), "even" or one weight per rank
        "offload": "none",                          "all", "auto" or rank indices [1, 2]: their optimizer state in host memory
        "plan": null,                               a plan JSON: use it, no profiling
        "profile": null,                            a profile JSON: plan from it, no profiling
        "checkpoint": {"dir": "runs/x/ckpt", "every": 50, "resume": true, "keep": 2},
        "report_dir": "runs/x",
        "output_dir": null,                         HF models: the finished run's from_pretrained folder (null: report_dir/model)
        "collective_timeout_s": 300,
        "topology": [[0, 1], [2, 3]],               the ranks of each node (null: torchrun's nodes, else one)
        "allow_lossy": false                        auto mode may quantize collectives across nodes (lossy)
      }
    }

Clusters that span nodes: ``poplar.topology`` declares the nodes (each a list of consecutive
ranks); without it the launcher's are used. DeepSpeed's ``zero_optimization.zero_hpz_partition_size``
(hpZ) maps to node-local secondary shards at ZeRO-3 (``Collectives.SECONDARY_SHARDS``, on hierarchical
collectives): 1 (DeepSpeed's default) is off; the size of every node is on; any other value is an
error, since Poplar's secondary shards are always one per node (ZeRO++'s hpZ partitions over the
ranks of a node too). It is a setting, as in DeepSpeed: a fixed plan (a plan file, DeepSpeed's even
plan) takes it as given, and auto mode's planner plans with secondary shards and no other way
(``AutoOptions.collectives``); at 1 auto mode's planner chooses the collectives.

Quantized collectives (lossy: the step is no longer exactly the step of the whole global batch;
``poplar.types.compression``): DeepSpeed's ``zero_optimization.zero_quantized_weights`` (ZeRO-3's
parameter gathers) and ``zero_quantized_gradients`` (ZeRO-2/3's gradient reduce-scatters), true or
false, map to ``CommPolicy(weights="int8")`` / ``CommPolicy(gradients="int8")``, across nodes. A
fixed plan takes them as given (``Plan.compression``; a plan file that says otherwise is an error
naming both); auto mode plans with them as given (``AutoOptions.compression``), choosing among the
stages they admit. ``poplar.allow_lossy`` (false by default) lets auto mode quantize where that is
predicted faster than exact by more than the plan's tie (``AutoOptions.allow_lossy``); the keys,
where given, win. A stage the keys cannot run at is an error naming the key.

How the plan is chosen: ``poplar.plan`` if given; otherwise auto mode (profile, then plan with
``poplar.strategy``) when there is something to profile — a GPU, ``poplar.cluster`` on CPU, or
a saved ``poplar.profile``; otherwise, on plain CPU, DeepSpeed's even plan from
``train_micro_batch_size_per_gpu``. In auto mode the micro-batch and accumulation keys are not
used: every rank gets its own. ``poplar.shards`` and ``poplar.offload`` mean the same whichever
the plan's source (``poplar.train.from_config``): a list is one entry per rank, applied to an
even plan, planned with in auto mode, and checked against a plan file (a disagreement is an
error naming both).

The stage means what it says: a given ``zero_optimization.stage`` (0-3) is the stage the job
runs at; in auto mode a stage where batch 1 does not fit some rank is an error that names the
lowest stage that would fit. ``"stage": "auto"``, or no stage at all, lets auto mode choose the
fastest stage that fits (without auto mode, no stage means DeepSpeed's default, 0). The same
holds for ``poplar.activation_checkpointing``: a value is binding, ``"auto"`` or none lets auto
mode choose.

DeepSpeed keys that only tune DeepSpeed's own runtime (``overlap_comm``,
``contiguous_gradients``, ``allgather_bucket_size``, ``reduce_scatter``, ...;
``poplar.train.deepspeed_hints``) are accepted and logged once, saying what Poplar does
instead. Any other unknown key is an error that names the closest known key.

``"auto"``, as the Hugging Face integration writes it (batch sizes and accumulation, clipping, the
optimizer's and scheduler's parameters, ``fp16`` / ``bf16`` ``enabled``, ``reduce_bucket_size``),
is read here: each rank's batches from the plan, the global batch from the other batch keys (else
8 per rank, the Trainer's default), the rest from Poplar's defaults; the run logs once what each
became (``poplar.train.deepspeed_auto``). ``offload_param`` ``{"device": "cpu"}`` (parameters in
host memory, which Poplar does not offload) becomes what Poplar offloads instead, every rank's
optimizer state and fp32 master weights, as ``offload_optimizer`` does, and the run says so once
(``poplar.train.placement_config``); ``{"device": "none"}`` moves nothing.

Precision (DeepSpeed's keys, DeepSpeed's meaning): ``"bf16": {"enabled": true}`` computes in
bf16; ``"fp16": {"enabled": true, ...}`` in fp16 with loss scaling: ``loss_scale`` 0 (default)
is dynamic, starting at 2 ** ``initial_scale_power`` (16), doubling after ``loss_scale_window``
(1000) overflow-free steps, halving (not below ``min_loss_scale``, 1) after ``hysteresis`` (2)
overflows; ``loss_scale`` > 0 is that fixed scale. Either way master weights and optimizer state
stay fp32 (``poplar.types.precision.MixedPrecision``). Both enabled, an unknown key or a bad
value is an error naming the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from poplar.process.timeouts import COLLECTIVE_TIMEOUT_S
from poplar.train.config_errors import ConfigError, ConfigProblems
from poplar.train.deepspeed_auto import GLOBAL_BATCH, OPTIMIZERS, TOTAL_STEPS, auto_global_batch, replace_autos
from poplar.train.deepspeed_hints import NOT_YET, TOP_HINTS, ZERO_HINTS, did_you_mean
from poplar.train.placement_config import PARAM_OFFLOAD, OffloadSetting, moves_parameters, read_offload, read_shards
from poplar.train.schedule import LRSchedule
from poplar.types.compression import CommPolicy
from poplar.types.plans import read_json
from poplar.types.precision import LossScaleConfig, MixedPrecision, Precision
from poplar.types.topology import Topology, TopologyError

SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
SCHEDULER_KEYS = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                  "warmup_min_ratio", "cos_min_ratio"}
DATA_KEYS = {"path", "seq_len", "tokenizer", "packing", "text_key", "eval_fraction", "eval_path"}
TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping", "steps_per_print", "seed", "zero_optimization", "optimizer", "scheduler", "poplar",
            "fp16", "bf16"}
ZERO_KEYS = {"stage", "reduce_bucket_size", "offload_optimizer", "offload_param", "zero_hpz_partition_size",
             "zero_quantized_weights", "zero_quantized_gradients"}
# DeepSpeed's quantized-communication keys -> the CommPolicy direction each turns to int8
QUANTIZED_KEYS = {"zero_quantized_weights": "weights", "zero_quantized_gradients": "gradients"}
BF16_KEYS = {"enabled"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}
POPLAR_KEYS = {"iterations", "model", "data", "cluster", "strategy", "shards", "plan", "profile", "checkpoint",
               "report_dir", "offload", "collective_timeout_s", "log_every", "eval_every", "tensorboard",
               "activation_checkpointing", "output_dir", "topology", "allow_lossy"}


NO_MODEL = ('the config names no model: add a "poplar" section with "model": a built-in name ("llama-small", '
            '"llama-tiny", "bert-tiny", ...), {"hf_config": "config.json"} (a Hugging Face config, randomly '
            'initialised), {"hf_pretrained": "dir"} (a save_pretrained directory, fine-tuned) or '
            '"package.module:function" (your own factory), e.g. "poplar": {"model": "llama-small", "iterations": 100}')


@dataclass
class TrainConfig:
    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    accum_steps: int | None = None
    gradient_clipping: float | None = None
    log_every: int = 10
    seed: int = 0
    zero_stage: int | None = None  # None ("auto" or not given): auto mode chooses; 0 with an even plan
    bucket_size_mb: float = 25.0
    optimizer: str = "AdamW"
    optimizer_params: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3})
    scheduler: str | None = None
    scheduler_params: dict[str, Any] = field(default_factory=dict)
    iterations: int = 100
    model: str | None = None  # a built-in name; None with no other kind: the config names no model (an error)
    model_overrides: dict[str, Any] = field(default_factory=dict)
    model_hf_config: str | None = None  # a Hugging Face config.json (then ``model`` is unused)
    model_hf_pretrained: str | None = None  # a save_pretrained directory: its weights and tokenizer
    model_factory: str | None = None  # "package.module:function" (then ``model`` is unused)
    data_path: str | None = None
    seq_len: int = 64
    tokenizer: str | None = None  # None: byte-level
    packing: bool = True
    text_key: str = "text"
    eval_fraction: float = 0.1
    eval_path: str | None = None
    eval_every: int | None = None
    tensorboard: bool | None = None
    activation_checkpointing: Any = None
    cluster: str | None = None
    strategy: str = "poplar"
    shards: str | tuple[float, ...] = "auto"  # "auto", "even" or one shard weight per rank
    offload: OffloadSetting | None = None  # ranks whose optimizer is in host memory (train.placement_config)
    plan: str | None = None
    profile: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_keep: int = 2  # the newest checkpoints kept in checkpoint_dir
    checkpoint_async: bool = False  # write checkpoints in the background (CheckpointOptions.async_save)
    resume: bool = True
    report_dir: str | None = None
    output_dir: str | None = None  # the finished run's Hugging Face folder (None: <report_dir>/model)
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    mixed_precision: MixedPrecision | None = None  # "bf16" / "fp16" sections; None: fp32
    topology: Topology | None = None  # "poplar.topology"; None: the launcher's nodes
    hpz_partition_size: int = 1  # DeepSpeed's zero_hpz_partition_size: 1 off, a node's size on
    compression: CommPolicy | None = None  # DeepSpeed's zero_quantized_* keys; None: neither given
    allow_lossy: bool = False  # "poplar.allow_lossy": auto mode may quantize collectives
    deepspeed_hints: dict[str, str] = field(default_factory=dict)  # DeepSpeed hint keys met -> what Poplar does
    auto_notes: dict[str, str] = field(default_factory=dict)  # keys given "auto" -> what each became (deepspeed_auto)
    # DeepSpeed keys Poplar has no equal of, mapped to the nearest thing it does -> what each became (logged once)
    deepspeed_mapped: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ reading
    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainConfig":
        """The config file of a run: read, and checked to name a model before any rank starts."""
        return cls.from_dict(read_json(path, "config file", ConfigError), require_model=True)

    @classmethod
    def from_dict(cls, raw: Any, *, require_model: bool = False) -> "TrainConfig":
        """The config of the JSON object ``raw``; ``require_model``: a config that names no model
        is a problem too. Every part is read, so one problem hides no other: a ``ConfigError``
        lists them all (``ConfigProblems``)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"the config must be a JSON object, got {type(raw).__name__}")
        cfg, problems = cls(), ConfigProblems()
        raw, cfg.auto_notes = replace_autos(raw)
        with problems.check():
            cfg.deepspeed_hints.update(_no_unknown(raw, TOP_KEYS, "the config", TOP_HINTS))
        with problems.check():
            cfg.mixed_precision = read_precision(raw)
        _read_batch_keys(cfg, raw, problems)
        zero, poplar = problems.section(raw, "zero_optimization", ""), problems.section(raw, "poplar", "")
        _read_zero(cfg, zero, problems)
        with problems.check():
            _read_optimizer(cfg, raw)
        with problems.check():
            _no_unknown(poplar, POPLAR_KEYS, '"poplar"')
        if "model" in poplar:
            with problems.check():
                _read_model(cfg, poplar["model"])
        with problems.check():
            _read_data(cfg, problems.section(poplar, "data", "poplar."))
        with problems.check():
            _read_poplar(cfg, poplar)
        with problems.check():
            cfg.offload = read_offload(zero, poplar, ConfigError)
            if moves_parameters(zero):
                cfg.deepspeed_mapped["zero_optimization.offload_param"] = PARAM_OFFLOAD
        if require_model and "model" not in poplar:  # a model given but bad is its own problem
            with problems.check():
                cfg.check_model()
        problems.raise_all()
        return cfg

    def check_model(self) -> None:
        """A run needs a model the config names: there is no default, since a DeepSpeed config
        without a ``poplar`` section would otherwise train some model the user never chose."""
        if self.model is None and self.model_hf_config is None and self.model_hf_pretrained is None \
                and self.model_factory is None:
            raise ConfigError(NO_MODEL)

    # ------------------------------------------------------------------ derived
    def global_batch_size(self, world_size: int) -> int:
        """``train_batch_size``, or DeepSpeed's micro x accumulation x world when only those are given
        (``"auto"``: ``deepspeed_auto``); DeepSpeed's identity is checked when all three are given
        and the plan is even."""
        tbs, mbs, gas = self.train_batch_size, self.micro_batch_size, self.accum_steps
        if tbs is None and GLOBAL_BATCH in self.auto_notes:
            return auto_global_batch(mbs, gas, world_size)
        if tbs is None:
            if mbs is None:
                raise ConfigError('give "train_batch_size" (the global batch: samples per optimizer step)')
            return mbs * (gas or 1) * world_size
        return tbs

    def lr_schedule(self) -> LRSchedule | None:
        """The ``scheduler`` section as an ``LRSchedule`` (None without one); ``WarmupCosineLR``
        scales the optimizer's lr, as DeepSpeed's does."""
        if self.scheduler is None:
            return None
        params = dict(self.scheduler_params)
        if TOTAL_STEPS in self.auto_notes:  # "auto": the run's iterations, --iterations included
            params["total_num_steps"] = self.iterations
        return LRSchedule.from_deepspeed(self.scheduler, params, self.optimizer_params.get("lr"))

    def lr_at(self, iteration: int) -> float | None:
        """The scheduler's learning rate for ``iteration`` (None without a scheduler)."""
        schedule = self.lr_schedule()
        return None if schedule is None else schedule(iteration)


def _read_batch_keys(cfg: TrainConfig, raw: dict, problems: ConfigProblems) -> None:
    """The batch, clipping, logging and seed keys, each checked on its own."""
    with problems.check():
        cfg.train_batch_size = _int(raw, "train_batch_size", None)
    with problems.check():
        cfg.micro_batch_size = _int(raw, "train_micro_batch_size_per_gpu", None)
    with problems.check():
        cfg.accum_steps = _int(raw, "gradient_accumulation_steps", None)
    with problems.check():
        clip = raw.get("gradient_clipping")
        if clip is not None and (not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0):
            raise ConfigError(f'"gradient_clipping" must be a number >= 0, got {clip!r}')
        cfg.gradient_clipping = float(clip) if clip else None  # DeepSpeed: 0 means off
    with problems.check():
        cfg.log_every = _int(raw, "steps_per_print", 10, minimum=0)
    with problems.check():
        cfg.seed = _int(raw, "seed", 0, minimum=0)


def _read_zero(cfg: TrainConfig, zero: dict, problems: ConfigProblems) -> None:
    """The ``zero_optimization`` section but its offload keys (``read_offload``), each checked on its own."""
    with problems.check():
        for key in sorted(set(zero) & set(NOT_YET)):
            raise ConfigError(f'"zero_optimization.{key}": {NOT_YET[key]}')
        cfg.deepspeed_hints.update(_no_unknown(zero, ZERO_KEYS, '"zero_optimization"', ZERO_HINTS))
    with problems.check():
        stage = zero.get("stage", "auto")
        if stage != "auto" and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
            raise ConfigError(f'"zero_optimization.stage" must be 0, 1, 2, 3 or "auto" (auto mode chooses), '
                              f'got {stage!r}')
        cfg.zero_stage = None if stage == "auto" else int(stage)
    with problems.check():
        cfg.hpz_partition_size = _int(zero, "zero_hpz_partition_size", 1, where='"zero_optimization"')
    with problems.check():
        cfg.compression = read_compression(zero, cfg.zero_stage)
    with problems.check():
        if "reduce_bucket_size" in zero:  # DeepSpeed counts elements; a bucket holds fp32 gradients
            cfg.bucket_size_mb = _int(zero, "reduce_bucket_size", 0, minimum=1, where='"zero_optimization"') * 4 / 2**20


def _no_unknown(d: dict, known: set[str], where: str, hints: dict[str, str] | None = None) -> dict[str, str]:
    """Raise on a key neither ``known`` nor a DeepSpeed hint (naming the closest known key);
    returns the hints met, each with what Poplar does instead."""
    hints = hints or {}
    unknown = sorted(set(d) - known - set(hints))
    if unknown:
        raise ConfigError(f"{where} has keys Poplar does not know: {unknown}{did_you_mean(unknown, known | set(hints))}"
                          f"; known keys: {sorted(known)}")
    return {key: hints[key] for key in d if key in hints}


def _get(d: dict, key: str, kind: type, default: Any) -> Any:
    value = d.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise ConfigError(f'"{key}" must be a {kind.__name__}, got {value!r}')
    return value


def _int(d: dict, key: str, default: Any, *, minimum: int = 1, where: str = "the config") -> Any:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f'{where}: "{key}" must be an integer >= {minimum}, got {value!r}')
    return value


def _enabled(section: dict, name: str) -> bool:
    value = section.get("enabled", False)
    if not isinstance(value, bool):
        raise ConfigError(f'"{name}.enabled" must be true or false, got {value!r}')
    return value


def read_precision(raw: dict) -> MixedPrecision | None:
    """The precision policy of the ``bf16`` / ``fp16`` sections (DeepSpeed's keys, see the module
    doc); None for fp32. Every key is checked, enabled or not."""
    bf16 = _get(raw, "bf16", dict, {}) or {}
    fp16 = _get(raw, "fp16", dict, {}) or {}
    _no_unknown(bf16, BF16_KEYS, '"bf16"')
    _no_unknown(fp16, FP16_KEYS, '"fp16"')
    use_bf16, use_fp16 = _enabled(bf16, "bf16"), _enabled(fp16, "fp16")
    scaling = _loss_scale(fp16)
    if use_bf16 and use_fp16:
        raise ConfigError('"bf16.enabled" and "fp16.enabled" are both true: enable one of them (bf16 where every '
                          'GPU has it, Ampere or newer; fp16 otherwise)')
    if use_bf16:
        return MixedPrecision(param_dtype=Precision.BF16.dtype)
    if use_fp16:
        return MixedPrecision(param_dtype=Precision.FP16.dtype, loss_scale=scaling)
    return None


def _loss_scale(fp16: dict) -> LossScaleConfig:
    """The ``fp16`` section's loss scaling, DeepSpeed's defaults for keys not given."""
    where = '"fp16"'
    scale = fp16.get("loss_scale", 0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
        raise ConfigError(f'{where}: "loss_scale" must be a number >= 0 (0: dynamic), got {scale!r}')
    power = _int(fp16, "initial_scale_power", 16, minimum=0, where=where)
    if power > 64:
        raise ConfigError(f'{where}: "initial_scale_power" must be at most 64, got {power}')
    window = _int(fp16, "loss_scale_window", 1000, where=where)
    hysteresis = _int(fp16, "hysteresis", 2, where=where)
    floor = fp16.get("min_loss_scale", 1)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0:
        raise ConfigError(f'{where}: "min_loss_scale" must be a number > 0, got {floor!r}')
    return LossScaleConfig(initial_scale=2.0 ** power, growth_interval=window, hysteresis=hysteresis,
                           min_scale=float(floor), static_scale=float(scale) if scale else None)


def _read_optimizer(cfg: TrainConfig, raw: dict) -> None:
    opt = _get(raw, "optimizer", dict, None)
    if opt is not None:
        _no_unknown(opt, {"type", "params"}, '"optimizer"')
        name = str(opt.get("type", "AdamW"))
        if name.lower() not in OPTIMIZERS:
            raise ConfigError(f'"optimizer.type" {name!r} is not supported; use one of {sorted(OPTIMIZERS.values())}')
        cfg.optimizer = OPTIMIZERS[name.lower()]
        cfg.optimizer_params = dict(_get(opt, "params", dict, {}) or {})
        if "betas" in cfg.optimizer_params:
            cfg.optimizer_params["betas"] = tuple(cfg.optimizer_params["betas"])
    sched = _get(raw, "scheduler", dict, None)
    if sched is not None:
        _no_unknown(sched, {"type", "params"}, '"scheduler"')
        if sched.get("type") not in SCHEDULERS:
            raise ConfigError(f'"scheduler.type" {sched.get("type")!r} is not supported; use one of {SCHEDULERS}')
        cfg.scheduler, cfg.scheduler_params = sched["type"], dict(_get(sched, "params", dict, {}) or {})
        _no_unknown(cfg.scheduler_params, SCHEDULER_KEYS, '"scheduler.params"')
        if cfg.scheduler_params.get("warmup_type", "log") not in ("log", "linear"):
            raise ConfigError('"scheduler.params.warmup_type" must be "log" or "linear"')
        if cfg.scheduler in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in cfg.scheduler_params \
                and TOTAL_STEPS not in cfg.auto_notes:
            raise ConfigError(f'"{cfg.scheduler}" needs "scheduler.params.total_num_steps"')


def _read_poplar(cfg: TrainConfig, p: dict) -> None:
    """The ``poplar`` section's keys but its model and data (``from_dict`` reads those)."""
    cfg.iterations = _int(p, "iterations", cfg.iterations, minimum=0, where='"poplar"')
    cfg.eval_every = _int(p, "eval_every", None, where='"poplar"')
    cfg.tensorboard = p.get("tensorboard")
    if cfg.tensorboard not in (None, True, False):
        raise ConfigError(f'"poplar.tensorboard" must be true, false or null, got {cfg.tensorboard!r}')
    ac = p.get("activation_checkpointing")
    if not (ac is None or isinstance(ac, (bool, str)) or (isinstance(ac, list) and all(isinstance(x, str) for x in ac))):
        raise ConfigError(f'"poplar.activation_checkpointing" must be true/false, a module class name or a list '
                          f'of them, got {ac!r}')
    if ac == "auto":
        ac = None
    cfg.activation_checkpointing = set(ac) if isinstance(ac, list) else ({ac} if isinstance(ac, str) else ac)
    for key in ("cluster", "plan", "profile", "report_dir", "output_dir"):
        value = p.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f'"poplar.{key}" must be a string (a name or a path), got {value!r}')
        setattr(cfg, key, value)
    cfg.strategy = str(p.get("strategy", cfg.strategy))
    if cfg.strategy not in ("poplar", "even", "flops"):
        raise ConfigError(f'"poplar.strategy" must be "poplar", "even" or "flops", got {cfg.strategy!r}')
    cfg.shards = read_shards(p.get("shards", cfg.shards), ConfigError)
    ckpt = _get(p, "checkpoint", dict, {}) or {}
    _no_unknown(ckpt, {"dir", "every", "resume", "keep", "async"}, '"poplar.checkpoint"')
    cfg.checkpoint_dir = ckpt.get("dir")
    cfg.checkpoint_every = _int(ckpt, "every", None, where='"poplar.checkpoint"')
    cfg.checkpoint_keep = _int(ckpt, "keep", 2, where='"poplar.checkpoint"')
    cfg.resume = bool(ckpt.get("resume", True))
    cfg.checkpoint_async = ckpt.get("async", False)
    if not isinstance(cfg.checkpoint_async, bool):
        raise ConfigError(f'"poplar.checkpoint.async" must be true or false (write checkpoints in the background '
                          f'while training goes on), got {cfg.checkpoint_async!r}')
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ConfigError('"poplar.checkpoint.every" needs "poplar.checkpoint.dir"')
    timeout = p.get("collective_timeout_s", cfg.collective_timeout_s)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ConfigError(f'"poplar.collective_timeout_s" must be a number > 0, got {timeout!r}')
    cfg.collective_timeout_s = float(timeout)
    if "log_every" in p:
        cfg.log_every = _int(p, "log_every", 10, minimum=0, where='"poplar"')
    cfg.topology = read_topology(p.get("topology"))
    cfg.allow_lossy = p.get("allow_lossy", False)
    if not isinstance(cfg.allow_lossy, bool):
        raise ConfigError(f'"poplar.allow_lossy" must be true (auto mode may quantize collectives across nodes, '
                          f'lossy) or false (every collective exact, the default), got {cfg.allow_lossy!r}')


def read_compression(zero: dict, zero_stage: int | None) -> CommPolicy | None:
    """The ``CommPolicy`` of DeepSpeed's ``zero_quantized_weights`` / ``zero_quantized_gradients``
    in a ``zero_optimization`` section (None: neither given), checked against ``zero_stage``
    (None: not given, auto mode chooses among the stages the policy admits)."""
    given = {key: zero[key] for key in QUANTIZED_KEYS if key in zero}
    if not given:
        return None
    for key, value in given.items():
        if not isinstance(value, bool):
            raise ConfigError(f'"zero_optimization.{key}" must be true (int8 across nodes, lossy) or false (exact), '
                              f"got {value!r}")
    policy = CommPolicy(**{QUANTIZED_KEYS[key]: "int8" if on else "none" for key, on in given.items()})
    check_compression_stage(policy, zero_stage)
    return policy


def check_compression_stage(policy: CommPolicy, zero_stage: int | None) -> None:
    """A ``ConfigError`` naming the ``zero_quantized_*`` key whose collectives ``zero_stage`` (the
    run's stage; None: auto mode chooses) does not have."""
    stages = {"weights": (3,), "gradients": (2, 3)}
    on = {"weights": policy.weights.bits > 0, "gradients": policy.gradients.bits > 0}
    for key, direction in QUANTIZED_KEYS.items():
        wanted = stages[direction]
        if on[direction] and zero_stage is not None and zero_stage not in wanted:
            raise ConfigError(f'"zero_optimization.{key}" quantizes collectives of ZeRO-{"/".join(map(str, wanted))} '
                              f'but the run\'s stage is {zero_stage}: set "stage": {wanted[-1]} (or "auto"), or set '
                              "the key to false")


def read_topology(value: Any) -> Topology | None:
    """``poplar.topology``: a list of nodes, each a list of ranks (or ``{"nodes": [...]}``)."""
    if value is None:
        return None
    nodes = value.get("nodes") if isinstance(value, dict) else value
    if not isinstance(nodes, list) or not all(isinstance(n, list) and all(isinstance(r, int) and not
                                                                         isinstance(r, bool) for r in n) for n in nodes):
        raise ConfigError(f'"poplar.topology" must be a list of nodes, each a list of ranks, e.g. [[0, 1], [2, 3]], '
                          f"got {value!r}")
    try:
        return Topology(nodes=tuple(tuple(n) for n in nodes))
    except TopologyError as e:
        raise ConfigError(f'"poplar.topology": {e}') from None


def secondary_shards_of(hpz_partition_size: int, topology: Topology, zero_stage: int | None) -> bool:
    """Whether DeepSpeed's ``zero_hpz_partition_size`` asks for secondary shards on ``topology``
    (module doc); a value Poplar cannot honour is a ``ConfigError`` naming the fix."""
    if hpz_partition_size == 1:
        return False
    sizes = set(topology.sizes)
    if sizes != {hpz_partition_size} or not topology.spans_nodes:
        raise ConfigError(f'"zero_optimization.zero_hpz_partition_size" is {hpz_partition_size} but the nodes are '
                          f"{topology.describe()} ({', '.join(map(str, topology.sizes))} ranks); Poplar keeps one "
                          "secondary shard per node: give the size of every node (all nodes alike), or 1 (off)")
    if zero_stage != 3:
        given = "not given (auto mode would choose)" if zero_stage is None else zero_stage
        raise ConfigError(f'"zero_optimization.zero_hpz_partition_size" asks for secondary shards, which are '
                          f'ZeRO-3\'s, but "stage" is {given}: set "stage": 3, or drop the key')
    return True


def _read_model(cfg: TrainConfig, model: Any) -> None:
    """A built-in name, "package.module:function", or an object with one of "name", "hf_config",
    "factory" and keyword overrides."""
    if isinstance(model, str):
        model = {"factory": model} if ":" in model else {"name": model}
    if not isinstance(model, dict):
        raise ConfigError(f'"poplar.model" must be a name, "package.module:function" or an object, got {model!r}')
    model = dict(model)
    kinds = [k for k in ("name", "hf_config", "hf_pretrained", "factory") if k in model]
    if len(kinds) != 1:
        raise ConfigError('"poplar.model" as an object needs exactly one of "name" (built-in, e.g. "llama-small"), '
                          '"hf_config" (a Hugging Face config.json), "hf_pretrained" (a save_pretrained directory) '
                          f'or "factory" ("package.module:function"), got {sorted(model)}')
    value = model.pop(kinds[0])
    if not isinstance(value, str) or (kinds[0] == "factory" and ":" not in value):
        raise ConfigError(f'"poplar.model.{kinds[0]}" must be a string' +
                          (' of the form "package.module:function"' if kinds[0] == "factory" else "") +
                          f", got {value!r}")
    cfg.model_overrides = model
    cfg.model_hf_config, cfg.model_hf_pretrained, cfg.model_factory = None, None, None
    if kinds[0] == "name":
        _check_builtin(value)
        cfg.model = value
    elif kinds[0] == "hf_config":
        cfg.model_hf_config = value
    elif kinds[0] == "hf_pretrained":
        cfg.model_hf_pretrained = value
    else:
        cfg.model_factory = value


def _check_builtin(name: str) -> None:
    """A ``poplar.model`` name is a built-in model; any other name (a Hugging Face hub name such as
    "gpt2") gets the way to a Hugging Face model: a local directory, since a run never downloads."""
    from poplar.workloads.configs import BERT_SIZES, LLAMA_SIZES

    builtin = [f"llama-{s}" for s in LLAMA_SIZES] + [f"bert-{s}" for s in BERT_SIZES]
    if name in builtin:
        return
    local = name.rstrip("/").split("/")[-1] or "model"
    raise ConfigError(f'"poplar.model" {name!r} is not a built-in model ({", ".join(builtin)}). If it names a Hugging '
                      f"Face hub model: a run reads local files only, so where the hub can be reached, save it "
                      f'with from_pretrained({name!r}) and save_pretrained("{local}") (model and tokenizer), then give '
                      f'"model": {{"hf_pretrained": "{local}"}} to fine-tune its weights, or {{"hf_config": '
                      f'"{local}/config.json"}} for its architecture, randomly initialised')


def _read_data(cfg: TrainConfig, data: dict) -> None:
    where = '"poplar.data"'
    _no_unknown(data, DATA_KEYS, where)
    cfg.seq_len = _int(data, "seq_len", cfg.seq_len, where=where)
    for key in ("path", "tokenizer", "eval_path"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f'{where}: "{key}" must be a path (a string) or null, got {value!r}')
    cfg.data_path, cfg.tokenizer, cfg.eval_path = data.get("path"), data.get("tokenizer"), data.get("eval_path")
    cfg.packing = data.get("packing", True)
    if not isinstance(cfg.packing, bool):
        raise ConfigError(f'{where}: "packing" must be true or false, got {cfg.packing!r}')
    cfg.text_key = str(data.get("text_key", "text"))
    frac = data.get("eval_fraction", 0.1)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
        raise ConfigError(f'{where}: "eval_fraction" must be a number in [0, 1) (0: no held-out set), got {frac!r}')
    cfg.eval_fraction = float(frac)
