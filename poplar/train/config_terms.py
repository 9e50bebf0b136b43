"""What the engine and auto mode say, in the config's terms, for a run built from a config
(``Trainer.from_config``, ``poplar train``). Their messages name Python arguments
(``global_batch_size``, ``world_size``, ``AutoOptions(require_all_ranks=True)``); a config user
has keys (``train_batch_size``, ``train_micro_batch_size_per_gpu``) and no ``AutoOptions``, so
the fix must be said with those.

- ``even_plan``: DeepSpeed's even plan, its batch errors naming ``train_batch_size`` and
  ``train_micro_batch_size_per_gpu``;
- ``in_config_terms``: while the engine is built, auto mode's warning about ranks the plan gives
  no samples names the ``train_batch_size`` that gives every rank samples, and drops the
  Python-only option (a config cannot set it).
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator

from poplar.types.plans import Plan

# auto mode's idle-ranks warning (poplar.auto.mode.idle_ranks_line): its Python remedies -> a config's
IDLE_RANKS = "would give every rank samples"
_REWRITES = ((re.compile(r"a global batch of (\d+) would give every rank samples"),
              r'"train_batch_size": \1 would give every rank samples'),
             (re.compile(r", or AutoOptions\(require_all_ranks=True\) gives each at least one"), ""))


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


class _ConfigTerms(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and IDLE_RANKS in record.msg:
            for pattern, replacement in _REWRITES:
                record.msg = pattern.sub(replacement, record.msg)
        return True


@contextlib.contextmanager
def in_config_terms() -> Iterator[None]:
    """Within: Poplar's log says auto mode's remedies in the config's terms."""
    logger, terms = logging.getLogger("poplar"), _ConfigTerms()
    logger.addFilter(terms)
    try:
        yield
    finally:
        logger.removeFilter(terms)
