"""A DeepSpeed config handed to another framework's trainer (``PoplarTrainer(deepspeed=...)``; the
Hugging Face ``TrainingArguments(deepspeed=...)`` is refused, since it starts DeepSpeed's own
engine in Accelerate, and needs DeepSpeed installed): Poplar reads
it through the JSON config's door (``poplar.train.config``: every key checked, ``"auto"`` read,
a bad value an error naming the key) and takes from it how ZeRO runs:

- ``zero_optimization.stage`` (unless the trainer is given a stage: then they must agree;
  ``"auto"`` or none: auto mode chooses, a fixed plan keeps its own) and ``reduce_bucket_size``;
- ``zero_hpz_partition_size``: secondary shards, as ``poplar train`` maps it, on
  ``poplar.topology`` or the launcher's nodes: a fixed plan's, and in auto mode the only way the
  planner plans (``AutoOptions.collectives``);
- ``zero_quantized_weights`` / ``zero_quantized_gradients``: the plan's quantized collectives
  (a fixed plan's ``Plan.compression``; in auto mode ``AutoOptions.compression``), and
  ``poplar.allow_lossy`` (``AutoOptions.allow_lossy``);
- ``offload_optimizer``, ``offload_param`` (its nearest in Poplar, said once: ``mapped_line``)
  and ``poplar.offload``: each rank's optimizer placement (a fixed plan's rows; in auto mode
  ``AutoOptions.offload``), as ``poplar train`` reads them.

The batch sizes, optimizer, scheduler and precision are the framework's own arguments' (the
Trainer's ``TrainingArguments``), as its DeepSpeed integration fills a config's ``"auto"`` from
them: what the config says of them is not used, and the trainer says so once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from poplar.auto import AutoOptions
from poplar.train.config import ConfigError, TrainConfig
from poplar.train.deepspeed_hints import mapped_line
from poplar.train.from_config import auto_collectives, offload_setting, with_collectives
from poplar.types.plans import Plan, read_json
from poplar.zero.config import ZeroConfig

# top-level sections whose values the framework's own arguments give instead
FRAMEWORK_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16")


@dataclass(frozen=True)
class DeepSpeedZero:
    """What Poplar takes from a DeepSpeed config (module doc): its parsed ``config`` and the
    top-level keys it gave that the framework's arguments decide (``unused``)."""

    config: TrainConfig
    unused: tuple[str, ...] = ()

    @classmethod
    def read(cls, source: str | os.PathLike | dict[str, Any]) -> "DeepSpeedZero":
        """A DeepSpeed config: a dict, or the path of its JSON file."""
        raw = source if isinstance(source, dict) else read_json(source, "DeepSpeed config", ConfigError)
        if not isinstance(raw, dict):
            raise ConfigError(f"a DeepSpeed config must be a JSON object or a dict, got {type(raw).__name__}")
        return cls(TrainConfig.from_dict(raw), tuple(k for k in FRAMEWORK_KEYS if k in raw))

    def zero_stage(self, given: int | ZeroConfig | None, plan: Plan | None) -> int | str | ZeroConfig:
        """The stage to run at: the trainer's (which must agree with the config's), else the
        config's, else the plan's (a fixed plan) or "auto" (auto mode); with the config's bucket
        size and topology."""
        said = self.config.zero_stage
        if given is not None:
            stage = given.stage if isinstance(given, ZeroConfig) else given
            if said is not None and stage != said:
                raise ConfigError(f'the DeepSpeed config\'s "zero_optimization.stage" is {said} but the trainer was '
                                  f"given zero_stage={stage}; give the stage in one place")
            if isinstance(given, ZeroConfig):
                return given
        else:
            stage = said if said is not None else "auto" if plan is None else (plan.zero_stage or 0)
        return ZeroConfig(stage, self.config.bucket_size_mb, topology=self.config.topology)

    def on_plan(self, plan: Plan, stage: Any) -> Plan:
        """A fixed plan with the config's secondary shards, quantized collectives and offload."""
        offloads = offload_setting(self.config, plan.world_size, auto=False)
        if offloads is not None:
            plan = plan.with_offloads(offloads)
        return with_collectives(self.config, plan, plan.world_size, stage)

    def on_auto(self, auto: AutoOptions, world_size: int) -> AutoOptions:
        """Auto mode's options for ``world_size`` ranks with the config's quantized collectives
        (where given), ``poplar.allow_lossy`` (either of the two allows), offload (where given)
        and hpZ's secondary shards (where asked for)."""
        given = self.config.compression
        offloads = offload_setting(self.config, world_size, auto=True)
        offload = offloads if offloads is not None else "auto" if self.config.offload == "auto" else auto.offload
        hpz = auto_collectives(self.config, world_size)
        return replace(auto, compression=given if given is not None else auto.compression,
                       allow_lossy=auto.allow_lossy or self.config.allow_lossy, offload=offload,
                       collectives=hpz if hpz != "auto" else auto.collectives)

    def notes(self) -> list[str]:
        """The lines that say which of the config's keys the framework's arguments decide, and
        what the keys Poplar has no equal of became."""
        said = [mapped_line(self.config.deepspeed_mapped)] if self.config.deepspeed_mapped else []
        if not self.unused:
            return said
        return [f"DeepSpeed config: {', '.join(self.unused)} come from the trainer's own arguments "
                "(TrainingArguments), not from the config; its zero_optimization section is Poplar's"] + said
