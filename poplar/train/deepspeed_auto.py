"""What ``"auto"`` becomes in a DeepSpeed config. The Hugging Face integration writes ``"auto"``
for the values its ``TrainingArguments`` fill in (batch sizes, clipping, the optimizer's and the
scheduler's parameters, ``fp16`` / ``bf16`` ``enabled``, bucket sizes); ``poplar train`` reads
such a config as it is. Each ``"auto"`` is replaced here, at the config door, before the config
is parsed, and the run logs once (rank 0) what each became (``auto_line``):

- ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``: each rank's own, from the
  plan (auto mode chooses them per rank; an even plan needs a number);
- ``train_batch_size``: micro-batch x accumulation x ranks where those are numbers; with them
  ``"auto"`` too, 8 samples per rank (the Trainer's default ``per_device_train_batch_size``),
  which auto mode then splits by each GPU's speed; a plan file keeps its own global batch;
- ``gradient_clipping``: off (Poplar's default);
- ``optimizer.params``: ``lr`` Poplar's default (1e-3); any other parameter (``betas``, ``eps``,
  ``weight_decay``, ...) the optimizer's own torch default;
- ``scheduler.params``: ``warmup_min_lr`` 0, ``warmup_max_lr`` the optimizer's lr (as the Trainer
  fills both), ``warmup_num_steps`` 0 (no warm-up, the Trainer's default), ``total_num_steps``
  the run's iterations (``poplar.iterations``, or ``--iterations``);
- ``fp16.enabled`` / ``bf16.enabled``: false (Poplar's default, fp32);
- ``zero_optimization.reduce_bucket_size``: Poplar's default bucket (25 MB of fp32 gradients).

``zero_optimization.stage`` ``"auto"`` is auto mode's choice (``poplar.train.config``); the
``stage3_*`` sizes are runtime hints Poplar does not use (``poplar.train.deepspeed_hints``), so
their ``"auto"`` is accepted as any value is. An ``"auto"`` anywhere else is an error naming the key.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

AUTO = "auto"
# DeepSpeed's optimizer names (matched lower-case) -> torch.optim's classes
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}
DEFAULT_LR = 1e-3  # TrainConfig's optimizer lr
HF_PER_DEVICE_BATCH = 8  # transformers' TrainingArguments.per_device_train_batch_size default
DEFAULT_BUCKET_ELEMENTS = 25 * 2 ** 20 // 4  # TrainConfig.bucket_size_mb (25 MB) of fp32 gradients

# keys whose value depends on the run (the world size, the plan, the iterations): said at build time
GLOBAL_BATCH = "train_batch_size"
TOTAL_STEPS = "scheduler.params.total_num_steps"
PER_RANK = "each rank's own, from the plan (auto mode chooses per rank)"


def replace_autos(raw: dict) -> tuple[dict, dict[str, str]]:
    """(``raw`` with every ``"auto"`` this module knows replaced or removed, {key: what it
    became}); ``raw`` itself is left as it was. Keys depending on the run (``GLOBAL_BATCH``,
    ``TOTAL_STEPS``) are removed and noted; ``TrainConfig`` resolves them."""
    out, notes = copy.deepcopy(raw), {}
    for key in (GLOBAL_BATCH, "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if out.get(key) == AUTO:
            del out[key]
            notes[key] = "" if key == GLOBAL_BATCH else PER_RANK
    if out.get("gradient_clipping") == AUTO:
        del out["gradient_clipping"]
        notes["gradient_clipping"] = "off (Poplar's default)"
    lr = _optimizer_autos(out, notes)
    _scheduler_autos(out, notes, lr)
    for section in ("fp16", "bf16"):
        if isinstance(out.get(section), dict) and out[section].get("enabled") == AUTO:
            out[section]["enabled"] = False
            notes[f"{section}.enabled"] = "false (Poplar's default: fp32)"
    zero = out.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("reduce_bucket_size") == AUTO:
        del zero["reduce_bucket_size"]
        notes["zero_optimization.reduce_bucket_size"] = f"{DEFAULT_BUCKET_ELEMENTS} elements (25 MB of fp32, " \
                                                        "Poplar's default)"
    return out, notes


def _optimizer_autos(out: dict, notes: dict[str, str]) -> Any:
    """Replace the optimizer's ``"auto"`` parameters; returns its lr (for the scheduler)."""
    opt = out.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    if not isinstance(params, dict):
        return DEFAULT_LR
    if params.get("lr") == AUTO:
        params["lr"] = DEFAULT_LR
        notes["optimizer.params.lr"] = f"{DEFAULT_LR:g} (Poplar's default)"
    defaults = _torch_defaults(str(opt.get("type", "AdamW")))
    for key in sorted(k for k, v in params.items() if v == AUTO):
        if key not in defaults:  # left for the parser: torch.optim names the parameter it does not take
            continue
        del params[key]
        value = defaults[key]
        notes[f"optimizer.params.{key}"] = f"{list(value) if isinstance(value, tuple) else value} (torch's default)"
    return params.get("lr", DEFAULT_LR)


def _torch_defaults(name: str) -> dict[str, Any]:
    """The keyword defaults of ``torch.optim.<name>`` (matched as the config matches it), or {}."""
    import torch

    cls = getattr(torch.optim, OPTIMIZERS.get(name.lower(), ""), None)
    if cls is None:
        return {}
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _scheduler_autos(out: dict, notes: dict[str, str], lr: Any) -> None:
    sched = out.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) else None
    if not isinstance(params, dict):
        return
    fills = {"warmup_min_lr": (0.0, "0 (as the Hugging Face Trainer fills it)"),
             "warmup_max_lr": (lr, f"{lr} (the optimizer's lr)"),
             "warmup_num_steps": (0, "0 (no warm-up, the Hugging Face Trainer's default)")}
    for key, (value, note) in fills.items():
        if params.get(key) == AUTO:
            params[key] = value
            notes[f"scheduler.params.{key}"] = note
    if params.get("total_num_steps") == AUTO:
        del params["total_num_steps"]
        notes[TOTAL_STEPS] = ""


def auto_global_batch(micro: int | None, accum: int | None, world: int) -> int:
    """``train_batch_size`` ``"auto"``: micro x accumulation x ranks, 8 per rank where the
    micro-batch is ``"auto"`` too."""
    return (micro or HF_PER_DEVICE_BATCH) * (accum or 1) * world


def global_batch_source(micro: int | None, world: int, plan_file: str | None) -> str:
    """Where an ``"auto"`` global batch came from, in words."""
    if plan_file:
        return f"the plan file {plan_file}'s rows"
    if micro is not None:
        return f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x {world} ranks"
    return (f"{HF_PER_DEVICE_BATCH} per rank x {world} ranks, the Hugging Face Trainer's default per-device batch; "
            "auto mode splits it by each GPU's speed")


def auto_line(notes: dict[str, str], global_batch: int, source: str, iterations: int) -> str:
    """One log line saying what each ``"auto"`` became; ``source`` says where the global batch
    came from."""
    said = dict(notes)
    if GLOBAL_BATCH in said:
        said[GLOBAL_BATCH] = f"{global_batch} ({source})"
    if TOTAL_STEPS in said:
        said[TOTAL_STEPS] = f"{iterations} (the run's iterations)"
    return 'config: "auto" values became: ' + "; ".join(f"{key} {note}" for key, note in sorted(said.items()))
