"""Whether a Mooncake engine reaches CUDA device memory, and which wheel fits this torch.

Mooncake publishes one ``mooncake`` package in three distributions:
``mooncake-transfer-engine`` (built for CUDA 12), ``mooncake-transfer-engine-cuda13``
(CUDA 13) and ``mooncake-transfer-engine-non-cuda`` (no CUDA; it sends a device address to
the socket as if it were host memory). The name installed is not trusted; the engine is
asked, once per transport and device, the first time ``cuda:N`` is asked about:

1. torch sees that GPU (``torch.cuda.is_available()``, ``N < device_count()``): if not,
   no, and nothing is probed (this CPU-only CI stops here);
2. the engine was compiled with CUDA (``mooncake.engine.SUPPORT_CUDA``, its ``USE_CUDA``
   flag): a build without it is never handed a device address;
3. a 4 KiB loopback READ through the engine's own endpoint, from a registered device
   buffer (location ``cuda:N``) into a registered host buffer, arrives byte for byte.
   Registration alone says nothing: over TCP every build accepts any address. The READ
   goes the way a peer's would (TCP: the engine's ``cudaMemcpy``; RDMA: the NIC reads
   the GPU), so a runtime the driver cannot load, or a NIC that cannot map the GPU,
   answers no here instead of failing the first request.

Step 3 on a device is not exercised in CI (no GPU here); :func:`loopback_check`, which it
calls, is, on host memory.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import threading

from vllm_hawk.transport.base import HOST, TransportError

logger = logging.getLogger(__name__)

NON_CUDA = "mooncake-transfer-engine-non-cuda"
#: Mooncake's distribution for each CUDA major version torch is built for, and the
#: project extra (pyproject.toml) that pins it.
WHEELS = {"12": "mooncake-transfer-engine", "13": "mooncake-transfer-engine-cuda13"}
EXTRAS = {NON_CUDA: "cpu", "mooncake-transfer-engine": "cu12", "mooncake-transfer-engine-cuda13": "cu13"}
PROBE_BYTES = 4096
#: Seconds the probe's loopback READ may take (a healthy one takes milliseconds).
PROBE_TIMEOUT_S = 10.0
_KEPT: list = []  # probe buffers of a READ that never settled: the engine may still write them


def wheel_for_torch(cuda_version: str | None) -> str:
    """The Mooncake distribution for a torch built for CUDA ``cuda_version``
    (``torch.version.cuda``: ``"12.4"``, ``"13.0"``; None for a torch without CUDA)."""
    if cuda_version is None:
        return NON_CUDA
    wheel = WHEELS.get(str(cuda_version).split(".")[0])
    if wheel is None:
        raise ValueError(
            f"torch.version.cuda is {cuda_version!r}: Mooncake publishes wheels for CUDA 12 "
            f"({WHEELS['12']}) and 13 ({WHEELS['13']}) only; install a torch for one of them"
        )
    return wheel


def torch_cuda_version() -> str | None:
    """``torch.version.cuda`` (None without torch, or for a torch without CUDA)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def install_hint() -> str:
    """What to ``pip install`` for this torch: the wheel and the extra that pins it."""
    cuda_version = torch_cuda_version()
    built = f"CUDA {cuda_version}" if cuda_version else "no CUDA"
    try:
        wheel = wheel_for_torch(cuda_version)
    except ValueError as e:
        return f"none ({e})"
    return f"{wheel} (the project's [{EXTRAS[wheel]}] extra; this torch is built for {built})"


def installed_wheels() -> list[str]:
    """``"name version"`` of each Mooncake distribution whose metadata is installed."""
    found = []
    for name in (NON_CUDA, *WHEELS.values()):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return found


def cuda_unreachable(location: str, support_cuda: object, cuda) -> str | None:
    """Why a Mooncake engine cannot reach memory at ``location`` (``"cuda:N"``), decided
    without touching a device; None when only the probe can tell (steps 1-2 above).

    support_cuda: ``mooncake.engine.SUPPORT_CUDA`` (None where the engine lacks it);
    cuda: ``torch.cuda``, or None without torch."""
    kind, _, index = location.partition(":")
    if kind != "cuda" or not index.isdigit():
        return f"{location!r} is not a CUDA device name ('cuda:N')"
    if cuda is None or not cuda.is_available():
        return "torch sees no CUDA device here (torch.cuda.is_available() is False)"
    if int(index) >= cuda.device_count():
        return f"torch sees {cuda.device_count()} CUDA device(s), so no {location}"
    if support_cuda is not True:
        return f"the installed Mooncake engine is built without CUDA (mooncake.engine.SUPPORT_CUDA is {support_cuda})"
    return None


def loopback_check(transport, src, location: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """READ ``src`` (a 1-D uint8 torch tensor at ``location``) into a host buffer through
    ``transport``'s own endpoint and compare the bytes; None when they arrived, else what
    failed. Both buffers are registered for the READ only and unregistered after it."""
    import torch

    n = src.numel()
    dst = torch.zeros(n, dtype=torch.uint8)
    registered = []
    try:
        for t, where in ((src, location), (dst, HOST)):
            try:
                transport._register(t.data_ptr(), n, where)
            except TransportError as e:
                return f"registering {n} bytes at {where!r} failed: {e}"
            registered.append(t.data_ptr())
        h = transport.submit("read", transport.endpoint, [(dst.data_ptr(), src.data_ptr(), n)])
        try:
            transport.wait(h, timeout_s)
        except TransportError as e:
            if not h.settled.wait(timeout_s):
                _KEPT.append((src, dst))
                registered.clear()  # the engine may still use them
            return f"a {n}-byte loopback READ from {location} failed: {e}"
        if not torch.equal(dst, src.cpu()):
            return f"a {n}-byte loopback READ from {location} returned different bytes"
        return None
    finally:
        for addr in registered:
            transport.unregister(addr)


class CudaReach:
    """One transport's answer per ``cuda:N``: None (it reaches that GPU) or why not,
    decided the first time each is asked about and kept."""

    def __init__(self, transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._why: dict[str, str | None] = {}

    def reason(self, location: str) -> str | None:
        with self._lock:
            if location not in self._why:
                self._why[location] = self._decide(location)
            return self._why[location]

    def _decide(self, location: str) -> str | None:
        import mooncake.engine

        try:
            import torch
        except ImportError:
            torch = None
        why = cuda_unreachable(location, getattr(mooncake.engine, "SUPPORT_CUDA", None), torch and torch.cuda)
        if why is None:  # pragma: no cover - needs a CUDA GPU (not in CI)
            why = _probe(self._transport, location)
        if why is None:  # pragma: no cover - needs a CUDA GPU
            logger.info("Mooncake engine %s reaches %s (4 KiB loopback READ)", self._transport.endpoint, location)
            return None
        installed = ", ".join(installed_wheels()) or "no Mooncake distribution metadata"
        return f"{why}; installed: {installed}; the wheel for this torch is {install_hint()}"


def _probe(transport, location: str) -> str | None:  # pragma: no cover - needs a CUDA GPU
    """Step 3 on the device: a 4 KiB pattern in ``location``'s memory, READ back to host."""
    import torch

    pattern = (torch.arange(PROBE_BYTES, dtype=torch.int32) * 7 + 3).remainder(251).to(torch.uint8)
    device = torch.device(location)
    try:
        src = pattern.to(device)
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        return f"torch could not place {PROBE_BYTES} bytes on {location}: {e}"
    return loopback_check(transport, src, location)
