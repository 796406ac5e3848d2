"""CPU affinity of the connector's threads.

vLLM's CPU worker binds its main thread to its OpenMP cores (one core by default on
small machines), and threads inherit that mask. The connector's threads (side channel,
pulls, transport polling) must not queue behind the model's busy loop on that core: on
a 2-core machine that starved them for tens of seconds.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["unpin_current_thread", "unpinned_threads"]


def unpin_current_thread() -> None:
    """Let the calling thread run on every CPU (see module doc)."""
    if hasattr(os, "sched_setaffinity"):  # Linux only
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


@contextlib.contextmanager
def unpinned_threads():
    """Threads (Python and native) created inside inherit an unpinned CPU mask."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    mask = os.sched_getaffinity(0)
    unpin_current_thread()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mask)
