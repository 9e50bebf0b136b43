"""Releasing a failed micro-step's memory at once: the error keeps its story, not its frames.

An exception caught in ``ZeroRuntime`` holds its traceback, the traceback holds the frames of the
failed forward (their locals: activations, the autograd graph), and the frames reach back through
``f_back`` to the runtime's frame that keeps the exception to re-raise it later: a reference cycle,
freed only by the garbage collector. After an out-of-memory error that leaves the memory full, so
the next iteration, even on a plan that fits, runs out of memory again unless the user calls
``gc.collect()``. ``release_frames`` turns the traceback into text (an exception note, shown where
the traceback would be) and drops it, so reference counting frees the frames as soon as the step
is abandoned.
"""

from __future__ import annotations

import traceback


def release_frames(error: BaseException) -> None:
    """Replace ``error``'s traceback by a note holding its text, and clear the frames' locals."""
    tb = error.__traceback__
    if tb is None:
        return
    error.add_note("Traceback of the failed micro-step (its frames were released):\n"
                   + "".join(traceback.format_tb(tb)).rstrip())
    traceback.clear_frames(tb)
    error.__traceback__ = None
