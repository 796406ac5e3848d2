"""Where the prefill side's memory lives, which stream its device work runs on, and when
that work has finished.

Every prefill-side buffer (the ring, G', the staging of a gather) lives on the device of
the KV cache it is made from, and is written by torch operations queued on that device
(on a CUDA GPU: asynchronously, on the calling thread's current stream). So:

* :func:`memory_location` names a tensor's memory for the transport (``"cpu"``, or
  ``"cuda:0"``: registered with Mooncake for GPUDirect RDMA, see
  :mod:`vllm_hawk.transport.mooncake`);
* :func:`own_stream` runs a block's device work on a stream of the calling thread's own
  (each prefill worker thread has one, made on first use), never on the legacy default
  stream the engine's threads share;
* :func:`record` / :func:`wait`: an event after that work, and the wait for it; the
  prefill waits before a KVReady announces bytes, because the decode's NIC reads them as
  soon as it has the KVReady, without the GPU's knowledge;
* :func:`synchronize` waits for everything this thread queued (its current stream);
  :func:`synchronize_device` for everything queued on the device (start-up only: before
  vLLM captures CUDA graphs).

Streams on CUDA: ``torch.cuda.Stream()`` hands out streams from torch's per-device pool,
which ``c10/cuda/CUDAStream.cpp`` creates with ``cudaStreamNonBlocking``
(``kDefaultFlags``): they never synchronise implicitly with the legacy default stream, so
neither the engine's default-stream work nor ours waits for the other. Cross-stream
memory safety (why no ``record_stream`` is needed): the ring is allocated once and freed
only at close, after the workers drained; a ring range is written by one worker, which
waits for its event before the KVReady, so the bytes are complete before the range can
be released and written again by another worker on another stream; a transform's
temporaries are made and used on the worker's own stream (the caching allocator reuses
them only in that stream's order), and pinned upload buffers are held by torch's host
allocator until the copy's stream has passed them. The KV blocks read were written by
the engine's forward, which finished (its sampled tokens reached the host) before the
request was handed over, and stay held until the decode's Release.

Everything goes through torch's device modules (``torch.cuda``, or any registered device
module with ``current_device``, ``current_stream``, ``Stream``, ``stream`` and
``Event``; one without ``Stream`` runs on its current stream), never through a raw
pointer. On the CPU all of it is a no-op. The CUDA path is not exercised in CI (the
opaque test device of ``tests/kvflow`` stands in for it; ``scripts/gpu_check.py`` runs
it on a GPU).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from vllm_hawk.transport.base import HOST

__all__ = ["HOST", "memory_location", "own_stream", "record", "synchronize", "synchronize_device", "wait"]

_local = threading.local()  # .streams: {device location: this thread's own stream}


def memory_location(device: torch.device | str) -> str:
    """``"cpu"`` for host memory, else ``"<type>:<index>"`` (the current device of that
    type when ``device`` names none), e.g. ``"cuda:0"``."""
    d = torch.device(device)
    if d.type == "cpu":
        return HOST
    index = d.index if d.index is not None else getattr(torch, d.type).current_device()
    return f"{d.type}:{index}"


def _module(device: torch.device):
    """The device's torch module when it has streams of its own, else None (CPU)."""
    if device.type == "cpu":
        return None
    m = getattr(torch, device.type)
    return m if hasattr(m, "Stream") and hasattr(m, "stream") else None


@contextlib.contextmanager
def own_stream(device: torch.device | str):
    """Queue the body's work on ``device`` on the calling thread's own stream (made on
    first use, kept for the thread's life; a non-blocking pool stream on CUDA). Yields the
    stream, or None where there are no streams (CPU: the body runs as it is)."""
    d = torch.device(memory_location(device))
    m = _module(d)
    if m is None:
        yield None
        return
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    s = streams.get(str(d))
    if s is None:
        s = streams[str(d)] = m.Stream(device=d)
    with m.stream(s):
        yield s


def record(device: torch.device | str):
    """An event recorded on this thread's current stream of ``device``: it completes when
    the work queued there so far has run. None on the CPU (nothing to wait for)."""
    d = torch.device(device)
    m = _module(d)
    if m is None:
        return None
    ev = m.Event()
    ev.record(m.current_stream(d))
    return ev


def wait(event) -> None:
    """Block the calling thread until ``event`` (from :func:`record`; None: no-op) completed."""
    if event is not None:
        event.synchronize()


def synchronize(device: torch.device | str) -> None:
    """Block until the work queued on ``device`` by this thread's current stream has run
    (a CUDA stream synchronisation; nothing to wait for on the CPU)."""
    d = torch.device(device)
    if d.type == "cpu":
        return
    getattr(torch, d.type).current_stream(d).synchronize()


def synchronize_device(device: torch.device | str) -> None:
    """Block until all work queued on ``device`` by any thread and stream has run
    (``torch.cuda.synchronize``). Start-up only: called during a CUDA graph capture from
    another thread it would invalidate the capture."""
    d = torch.device(device)
    if d.type != "cpu":
        getattr(torch, d.type).synchronize(d)
