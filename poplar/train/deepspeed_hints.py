"""DeepSpeed config keys that only tune how DeepSpeed runs, never what a step computes, and
what Poplar does about each: its own equivalent, or nothing. ``poplar train`` accepts them so a
DeepSpeed config runs unchanged, and logs once which ones it met (``hint_line``).

Keys that change what is computed or where state lives (offload, communication dtype) are not
here: the config reads them (``poplar.train.config``: the quantized weights and gradients keys
become the plan's ``CommPolicy``; ``poplar.train.placement_config``: the offload keys), or they
are errors until Poplar does the same (``NOT_YET``).
"""

from __future__ import annotations

import difflib
from typing import Iterable

# "zero_optimization" keys (DeepSpeed's ZeRO config docs)
ZERO_HINTS = {
    "overlap_comm": "stage 2 reduce-scatters each gradient bucket during backward, stage 3 prefetches one "
                    "block ahead, always",
    "contiguous_gradients": "gradients always live in one flat buffer per group",
    "reduce_scatter": "the stage decides: all-reduce at 0, reduce-scatter at 1-3",
    "allgather_partitions": "updated shards are all-gathered per bucket",
    "allgather_bucket_size": "all-gathers use the gradient buckets (reduce_bucket_size)",
    "round_robin_gradients": "ignored (a CPU-offload ordering hint)",
    "stage3_prefetch_bucket_size": "stage 3 prefetches one block ahead by a fixed schedule",
    "stage3_max_live_parameters": "stage 3 releases each block after use",
    "stage3_max_reuse_distance": "stage 3 releases each block after use",
    "stage3_param_persistence_threshold": "ignored: stage 3 shards every parameter a block owns",
    "sub_group_size": "ignored: the optimizer steps a rank's whole shard at once",
    "elastic_checkpoint": "checkpoints load under any world size and stage",
    "load_from_fp32_weights": "checkpoints keep and load the fp32 master weights",
    "ignore_unused_parameters": "unused parameters get zero gradients",
    "use_multi_rank_bucket_allreduce": "ignored",
    "memory_efficient_linear": "ignored",
    "stage3_gather_16bit_weights_on_model_save": "a checkpoint holds the fp32 master weights sharded by rank, "
                                                 "in torch.distributed.checkpoint's format, at every stage; "
                                                 "the whole model is an export",
}

# "zero_optimization" keys that move state off the GPU in ways Poplar does not: an error says so
NOT_YET = {
    "cpu_offload": "the key of older DeepSpeed versions: write \"offload_optimizer\": {\"device\": \"cpu\"}",
}

# top-level keys
TOP_HINTS = {
    "wall_clock_breakdown": "per-rank compute, idle and comm times are logged every steps_per_print",
    "zero_allow_untested_optimizer": "any torch.optim optimizer the config names runs",
    "memory_breakdown": "ignored",
    "prescale_gradients": "each micro-batch's loss is scaled by its share of the global batch",
    "gradient_predivide_factor": "each micro-batch's loss is scaled by its share of the global batch",
}


def mapped_line(mapped: dict[str, str]) -> str:
    """One log line naming each DeepSpeed key Poplar has no equal of and what it became."""
    what = "; ".join(f"{key} {note}" for key, note in sorted(mapped.items()))
    return f"config: DeepSpeed keys mapped to the nearest thing Poplar does: {what}"


def hint_line(hints: dict[str, str]) -> str:
    """One log line naming each hint met and what Poplar does instead."""
    what = "; ".join(f"{key}: {note}" for key, note in sorted(hints.items()))
    return f"config: DeepSpeed performance hints that Poplar does its own way or ignores: {what}"


def did_you_mean(unknown: Iterable[str], known: Iterable[str]) -> str:
    """'; did you mean "stage" for "stag"?' for the unknown keys close to a known one, else ''."""
    known = sorted(known)
    guesses = []
    for key in sorted(unknown):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
        if close:
            guesses.append(f'"{close[0]}" for "{key}"')
    return f"; did you mean {', '.join(guesses)}?" if guesses else ""
