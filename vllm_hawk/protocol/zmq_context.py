"""ZeroMQ contexts whose I/O threads may run on every CPU.

libzmq starts a context's I/O threads when its first socket is created, and they keep
the CPU mask of the thread that created it. vLLM's CPU workers pin their main thread
(``VLLM_CPU_OMP_THREADS_BIND``) and create ``zmq.Context.instance()`` there, and a
tensor-parallel worker's main thread busy-polls vLLM's shared-memory queue on that very
core; a side channel on that context then waited seconds for its I/O thread (Hello
unanswered for 5 s with TP=2 on both sides of a 2-core machine). The side channel
therefore uses its own contexts, started with the full CPU mask.
"""

from __future__ import annotations

import contextlib
import os
import threading

import zmq

__all__ = ["new_context", "shared_context"]

_lock = threading.Lock()
_shared: tuple[int, zmq.Context] | None = None  # (pid, context): a forked child makes its own


def new_context() -> zmq.Context:
    """A new context whose I/O thread is already running, on every CPU."""
    ctx = zmq.Context()
    saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if saved is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        ctx.socket(zmq.PAIR).close(linger=0)  # starts the I/O thread with this thread's (full) mask
    finally:
        if saved is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, saved)
    return ctx


def shared_context() -> zmq.Context:
    """One :func:`new_context` per process, shared by the side-channel clients."""
    global _shared
    with _lock:
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), new_context())
        return _shared[1]
