"""Where the prefill side's memory lives, and when device work on it has finished.

Every prefill-side buffer (the ring, G', the staging of a gather) lives on the device of
the KV cache it is made from, and is written by torch operations queued on that device
(on a CUDA GPU: asynchronously, on the calling thread's current stream). So:

* :func:`memory_location` names a tensor's memory for the transport (``"cpu"``, or
  ``"cuda:0"``: registered with Mooncake for GPUDirect RDMA, see
  :mod:`vllm_hawk.transport.mooncake`);
* :func:`synchronize` waits until the work this thread queued on a device has run; the
  prefill calls it before a KVReady announces bytes, because the decode's NIC reads them
  as soon as it has the KVReady, without the GPU's knowledge.

Both go through torch's device modules (``torch.cuda``, or any registered device module
with ``current_device`` and ``current_stream``), never through a raw pointer.
"""

from __future__ import annotations

import torch

from vllm_hawk.transport.base import HOST

__all__ = ["HOST", "memory_location", "synchronize"]


def memory_location(device: torch.device | str) -> str:
    """``"cpu"`` for host memory, else ``"<type>:<index>"`` (the current device of that
    type when ``device`` names none), e.g. ``"cuda:0"``."""
    d = torch.device(device)
    if d.type == "cpu":
        return HOST
    index = d.index if d.index is not None else getattr(torch, d.type).current_device()
    return f"{d.type}:{index}"


def synchronize(device: torch.device | str) -> None:
    """Block until the work queued on ``device`` by this thread's current stream has run
    (a CUDA stream synchronisation; nothing to wait for on the CPU)."""
    d = torch.device(device)
    if d.type == "cpu":
        return
    getattr(torch, d.type).current_stream(d).synchronize()
