"""How the doors of other frameworks' loops end a rank whose job failed: as ``poplar train`` does.

A peer that dies or hangs fails this rank's next collective (at once for a dead peer, after the
collective timeout for a hung one, ``poplar.process.timeouts``). Left to the framework, every rank
would then print its own raw gloo traceback, none of which can say which rank was at fault.
``run_as_one_job`` runs the framework's entry point (``PoplarStrategy``'s fit / validate / test
/ predict, ``PoplarTrainer.train``) under ``poplar.process.failure``'s reporting instead: on a
collective's failure the rank checks in, lets the process group go, the first rank to fail prints
one line naming the ranks that died or never reported, and every failing rank leaves with exit
status 1. Under torchrun it leaves at once (``os._exit``), as ``poplar train`` does: the
framework's objects still hold the group's gloo resources, and freeing them at interpreter
shutdown waits seconds on the hung peer (and can abort the process, [Note: gloo at interpreter
exit]); elsewhere it raises ``SystemExit(1)``. While it runs, a SIGTERM reaches a rank blocked in a collective
(``poplar.process.sigterm_watch``). Any other exception (a bug in the user's script, raised before or after the
collectives) goes on as raised.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

import torch.distributed as dist

from poplar.process.failure import FailureReporting
from poplar.process.sigterm_watch import SigtermWatch
from poplar.types.errors import DistributedError

# what the message of a bare backend error from torch.distributed starts or contains (gloo's
# timeouts and broken connections are plain RuntimeErrors)
_BACKEND_MARKS = ("gloo/", "Connection closed by peer", "Connection reset by peer", "NCCL error", "ProcessGroupNCCL")


def is_collective_failure(error: BaseException) -> bool:
    """True for a collective that failed because a peer died, hung or failed: Poplar's
    ``DistributedError`` (every collective Poplar runs, and every agreed failure), torch's
    ``DistError`` family, and a bare gloo / NCCL error from a collective the framework ran."""
    if isinstance(error, DistributedError) or isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in _BACKEND_MARKS)


def run_as_one_job(door: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; a collective failure ends this rank as ``poplar train`` ends it
    (one line for the job, led by ``door``; ``SystemExit(1)``)."""
    reporting = FailureReporting(door)
    try:
        reporting.join()
    except Exception:  # noqa: BLE001 - no store: every rank reports for itself
        pass
    text = None
    watch = SigtermWatch(door).start()  # blocked in a collective, the rank still answers SIGTERM
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - only collective failures are handled
        if not is_collective_failure(e):
            raise
        text = str(e)  # only the text: the exception's frames hold the engine and its group
    finally:
        watch.stop()
    if text is None:
        reporting.finished()
        return result
    reporting.end(text, peer=True)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)
    raise SystemExit(1)
