"""A fresh rendezvous namespace for each attempt of a torchrun job, so a restarted group re-forms.

torchrun (2.4 and later) lends its workers the launcher's own key-value store
(``TORCHELASTIC_USE_AGENT_STORE``) and keeps it across restarts. A group formed on it with
``env://`` writes its keys under the same names in every attempt, so after a worker dies and
torchrun restarts them all, the new ranks find the dead attempt's addresses and counters there:
gloo's ``connectFullMesh`` dials the dead ranks (connection refused), or the ranks wait in
``init_process_group`` for minutes. ``attempt_store`` gives the process group the same store
under a prefix of its own per attempt: the run id, the restart count torchrun sets
(``TORCHELASTIC_RESTART_COUNT``) and the world size (an elastic membership change re-forms the
group at another size without counting a restart). With the launcher's store not shared
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), rank 0 hosts a new store each attempt, as ``env://``
does, and the prefix changes nothing.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def attempt_key() -> str | None:
    """This attempt's namespace (None outside torchrun)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"poplar/pg/{run}/attempt{restart}/world{os.environ.get('WORLD_SIZE', '1')}"


def attempt_store(timeout_s: float) -> Any:
    """The store for this attempt's process group, or None outside torchrun. Connecting waits at
    most ``timeout_s``."""
    key = attempt_key()
    if key is None:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                          is_master=not shared and rank == 0, timeout=timedelta(seconds=timeout_s),
                          multi_tenant=not shared)
    return dist.PrefixStore(key, store)
