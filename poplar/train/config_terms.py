"""What the engine and auto mode say, in the config's terms, for a run built from a config
(``Trainer.from_config``, ``poplar train``). Their messages name Python arguments
(``global_batch_size``, ``world_size``, ``AutoOptions(require_all_ranks=True)``); a config user
has keys (``train_batch_size``, ``train_micro_batch_size_per_gpu``) and no ``AutoOptions``, so
the fix must be said with those.

- ``even_plan``: DeepSpeed's even plan, its batch errors naming ``train_batch_size`` and
  ``train_micro_batch_size_per_gpu``;
- ``CONFIG_REMEDIES``: auto mode's fixes in a config's terms: the ``train_batch_size`` that gives
  every rank samples, and no Python-only option (a config cannot set it).
"""

from __future__ import annotations

from poplar.auto import Remedies
from poplar.types.plans import Plan

# auto mode's messages, in a config's terms (``AutoOptions.remedies``)
CONFIG_REMEDIES = Remedies(global_batch='"train_batch_size": {batch}', require_all_ranks=None)


def even_plan(world: int, global_batch: int, micro_batch: int, error: type[Exception]) -> Plan:
    """DeepSpeed's even plan of a config; a global batch that does not divide among the ranks is
    ``error`` naming the config's keys and the batches that would."""
    if global_batch % world:
        below, above = global_batch // world * world, (global_batch // world + 1) * world
        near = f"{below} or {above}" if below else f"{above}"
        raise error(f'"train_batch_size" {global_batch} does not divide among {world} ranks: an even plan (from '
                    f'"train_micro_batch_size_per_gpu" {micro_batch}) gives every rank the same share; give a '
                    f'"train_batch_size" divisible by {world} (e.g. {near}), or let auto mode plan unequal shares '
                    '("poplar.cluster", or a GPU per rank)')
    return Plan.even(world, global_batch, micro_batch)
