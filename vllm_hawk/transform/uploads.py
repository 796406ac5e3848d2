"""Host -> device copies of the transform's small index tables (block ids, tile indices).

:func:`to_device` queues the copy on the calling thread's current stream (a prefill
worker's own, :mod:`vllm_hawk.kvflow.device`) without blocking the host: on CUDA from
pinned memory (``pin_memory()``: torch's caching host allocator, which records an event on
that stream and reuses the pinned block only after the copy ran, so the buffer outlives
the asynchronous copy without our help), ``non_blocking=True``. A pageable source would
make CUDA stage it and block the host thread, holding the GIL next to the engine's. On
other devices (no pinned allocator: the opaque test device) the copy is still issued
``non_blocking``; on the CPU it is no copy at all. The pinned CUDA path is not exercised
in CI (``scripts/gpu_check.py`` runs it).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["to_device"]


def to_device(a: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``a`` (a host array or tensor) on ``device``: the same memory on the CPU, else an
    asynchronous copy on the current stream (pinned first on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    d = torch.device(device)
    if d.type == "cpu":
        return t
    if d.type == "cuda":
        t = t.pin_memory()
    return t.to(d, non_blocking=True)
