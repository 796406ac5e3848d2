"""The prefill side's registered ring buffer (Algorithm 1, P5-P6 and P8).

:class:`RingAllocator` hands out byte ranges ``[offset, offset + nbytes)`` of a
``capacity``-byte ring in arrival order; a range is one request's G'. Ranges may be
released in any order; space is reused once every older range has been released
(classic ring: head = end of the newest range, tail = start of the oldest live one). A
range never wraps: if it does not fit before the end, it starts at offset 0 and the gap
at the end stays unused until the ring drains past it. ``reserve`` waits for room up to
a deadline (backpressure) and raises :class:`BufferFull` after it, or at once when the
request is larger than the ring; it never overwrites a live range. ``abort`` (called
when the owner closes) wakes every waiter with :class:`RingClosed` and refuses later
reservations, so a closing endpoint never waits out a reserve deadline.

:class:`RingBuffer` is the allocator plus its memory (a uint8 torch tensor on the
``device`` it is made for: host memory, or the KV cache's GPU, so that the transform
writes G' there and the decode's NIC reads it with GPUDirect RDMA) and its registration
with a transport, under the memory's location (:mod:`~vllm_hawk.kvflow.device`):
``registration="auto"`` (default, :func:`~vllm_hawk.kvflow.exposure.resolve_registration`)
registers a device ring whole, once, at creation, and a host ring per request;
``"per_request"`` registers only the ranges of live requests, each from ``reserve`` to
``release``, so a transport peer reaches nothing of an idle ring and no range but the
live ones (:mod:`~vllm_hawk.kvflow.exposure`); ``"whole"`` registers the ring once. A
host ring that a GPU fills is pinned (``pin_memory``, :func:`pin_host_ring`), so the
device -> host copies are DMA at full speed and may be asynchronous.

Size: :func:`ring_nbytes_for` gives the capacity that holds the largest request a
source produces (its bytes for the engine's ``max_model_len`` tokens) in all its shares;
the ring then holds several shorter requests at once, or one of that length.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

import torch

from vllm_hawk.kvflow.device import memory_location, own_stream, record, synchronize, wait
from vllm_hawk.kvflow.errors import BufferFull, RingClosed, RingTooSmall
from vllm_hawk.kvflow.exposure import resolve_registration

DEFAULT_ALIGN = 4096


def ring_nbytes_for(request_nbytes: int, max_shares: int = 1, align: int = DEFAULT_ALIGN) -> int:
    """The ring capacity (bytes) that holds one request of ``request_nbytes`` bytes served
    as up to ``max_shares`` shares at once (each share's range starts aligned to
    ``align``, so each may waste up to ``align - 1`` bytes)."""
    if request_nbytes <= 0 or max_shares <= 0:
        raise ValueError(f"ring size for a request of {request_nbytes} bytes in {max_shares} shares")
    return -(-(request_nbytes + max_shares * align) // align) * align


def pin_host_ring(ring_device: torch.device | str, cache_device: torch.device | str) -> bool:
    """Whether a ring on ``ring_device`` filled from a KV cache on ``cache_device`` is
    pinned: a host ring next to a CUDA cache (page-locked memory: the GPU's copies into it
    are DMA and may be queued asynchronously). Pinning needs CUDA, so no CPU-only test
    makes such a ring; this decision is what CI checks."""
    return torch.device(ring_device).type == "cpu" and torch.device(cache_device).type == "cuda"


class RingAllocator:
    """Offset-only ring allocator (bytes), thread-safe.

    capacity: ring size in bytes; align: every range starts at a multiple of ``align``.
    """

    def __init__(self, capacity: int, align: int = DEFAULT_ALIGN) -> None:
        if capacity <= 0 or align <= 0 or align & (align - 1):
            raise ValueError(f"ring needs capacity > 0 and a power-of-two align, got {capacity}, {align}")
        self.capacity = capacity - capacity % align
        if self.capacity == 0:
            raise ValueError(f"ring capacity {capacity} is smaller than its alignment {align}")
        self.align = align
        self._cond = threading.Condition()
        # Live and released-but-not-yet-reclaimed ranges in allocation order:
        # key -> [offset, nbytes_reserved, released]
        self._ranges: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._head = 0  # next free byte after the newest range
        self._aborted = False

    # ------------------------------------------------------------------ queries
    def used_bytes(self) -> int:
        """Bytes held by ranges not yet reclaimed (released ones behind a live one count)."""
        with self._cond:
            return self._used_locked()

    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes()

    def is_empty(self) -> bool:
        with self._cond:
            return not self._ranges

    def live(self) -> dict[str, tuple[int, int]]:
        """``{key: (offset, nbytes)}`` of ranges not yet released."""
        with self._cond:
            return {k: (o, n) for k, (o, n, rel) in self._ranges.items() if not rel}

    def contains(self, offset: int, nbytes: int) -> bool:
        """True when ``[offset, offset + nbytes)`` lies inside the ring."""
        return offset >= 0 and nbytes > 0 and offset + nbytes <= self.capacity

    # ------------------------------------------------------------------ reserve / release
    def reserve(self, key: str, nbytes: int, timeout_s: float = 0.0) -> int:
        """Reserve ``nbytes`` for ``key``; returns the byte offset in the ring.

        Waits up to ``timeout_s`` seconds for releases (0 = refuse at once when full).
        Raises :class:`BufferFull` (no room in time, or larger than the ring),
        :class:`RingClosed` (after :meth:`abort`, also while waiting) and ``ValueError``
        (``key`` already holds a range, ``nbytes`` <= 0)."""
        if nbytes <= 0:
            raise ValueError(f"ring reserve for {key!r}: nbytes must be > 0, got {nbytes}")
        size = -(-nbytes // self.align) * self.align
        if size > self.capacity:
            raise RingTooSmall(
                f"ring: request {key!r} needs {nbytes} bytes, more than the whole "
                f"{self.capacity}-byte ring; raise the ring size (ring_nbytes) to at least {size}",
                key,
                nbytes,
                self.capacity,
                size,
            )
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            if key in self._ranges:
                raise ValueError(f"ring: request {key!r} already holds a range")
            while True:
                if self._aborted:
                    raise RingClosed(f"ring closed: request {key!r} gets no range", key)
                off = self._fit_locked(size)
                if off is not None:
                    self._ranges[key] = [off, size, False]
                    self._head = off + size
                    return off
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferFull(
                        f"ring full: request {key!r} needs {size} bytes, {self.capacity - self._used_locked()} "
                        f"of {self.capacity} free ({len(self.live())} live ranges) after waiting "
                        f"{timeout_s:.3f} s",
                        key,
                    )
                self._cond.wait(left)

    def release(self, key: str) -> None:
        """Release ``key``'s range (any order). Raises ``KeyError`` for an unknown key."""
        with self._cond:
            r = self._ranges.get(key)
            if r is None or r[2]:
                raise KeyError(f"ring: no live range for request {key!r}")
            r[2] = True
            while self._ranges and next(iter(self._ranges.values()))[2]:
                self._ranges.popitem(last=False)
            if not self._ranges:
                self._head = 0
            self._cond.notify_all()

    def abort(self) -> None:
        """Refuse every later ``reserve`` and wake the waiting ones with :class:`RingClosed`
        (live ranges stay valid and can still be released)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ internals
    def _used_locked(self) -> int:
        if not self._ranges:
            return 0
        tail = next(iter(self._ranges.values()))[0]
        if self._head > tail:
            return self._head - tail
        return self.capacity - tail + self._head  # wrapped (gap at the end counts as used)

    def _fit_locked(self, size: int) -> int | None:
        if not self._ranges:
            return 0 if size <= self.capacity else None
        tail = next(iter(self._ranges.values()))[0]
        head = self._head
        if head > tail:  # free: [head, capacity) then [0, tail)
            if head + size <= self.capacity:
                return head
            return 0 if size <= tail else None
        return head if head + size <= tail else None  # wrapped: free is [head, tail)


class RingBuffer:
    """The registered ring: ``capacity`` bytes on ``device`` plus a :class:`RingAllocator`.

    ``transport`` (optional): ``registration="per_request"`` registers each reserved range
    until its release; ``"whole"`` registers ``(base_addr, capacity)`` now and
    unregisters it at :meth:`close`; both under :attr:`location`; ``"auto"``: ``whole``
    for a device ring, else ``per_request`` (:attr:`registration` is the resolved one).
    ``pin_memory``: host memory, page-locked (needs CUDA). ``view(offset, nbytes)``
    is a uint8 tensor over ring bytes (no copy, on ``device``) that the transform writes
    G' into; :meth:`synchronize` waits for what this thread queued there (by an event).
    On a device with streams the ring is zeroed on the constructing thread's own stream
    (:func:`~vllm_hawk.kvflow.device.own_stream`) and waited for: nothing of it lands on
    the legacy default stream or stays queued after the constructor.
    """

    def __init__(
        self,
        capacity: int,
        transport=None,
        align: int = DEFAULT_ALIGN,
        registration: str = "auto",
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        self.alloc = RingAllocator(capacity, align)
        self.capacity = self.alloc.capacity
        # zeroed now: the first touch (host page faults) stays out of the transform and the transfers
        with own_stream(device):
            self.memory = torch.zeros(self.capacity, dtype=torch.uint8, device=device, pin_memory=pin_memory)
            synchronize(device)
        self.device = self.memory.device
        self.location = memory_location(self.device)
        self.base_addr = self.memory.data_ptr()  # an address in the device's space, for the transport only
        self._transport = transport
        self.registration = resolve_registration(registration, self.location)
        self._ranges: dict[str, int] = {}  # key -> registered address (per_request)
        self._rlock = threading.Lock()
        if transport is not None and self.registration == "whole":
            transport.register(self.base_addr, self.capacity, self.location)

    def reserve(self, key: str, nbytes: int, timeout_s: float = 0.0) -> int:
        off = self.alloc.reserve(key, nbytes, timeout_s)
        if self._transport is not None and self.registration == "per_request":
            addr = self.base_addr + off
            try:
                self._transport.register(addr, nbytes, self.location)
            except BaseException:
                self.alloc.release(key)
                raise
            with self._rlock:
                self._ranges[key] = addr
        return off

    def release(self, key: str) -> None:
        with self._rlock:
            addr = self._ranges.pop(key, None)
        if addr is not None:
            with contextlib.suppress(Exception):  # transport closed already
                self._transport.unregister(addr)
        self.alloc.release(key)

    def abort(self) -> None:
        self.alloc.abort()

    def synchronize(self) -> None:
        """Block until the writes this thread queued into the ring have run (device rings):
        an event recorded now on this thread's current stream (a worker's own, see
        :func:`~vllm_hawk.kvflow.device.own_stream`), then waited for. Call it after the
        writes, inside the same stream context."""
        wait(record(self.device))

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if not self.alloc.contains(offset, nbytes):
            raise ValueError(f"ring view [{offset}, {offset + nbytes}) outside the {self.capacity}-byte ring")
        return self.memory[offset : offset + nbytes]

    def close(self) -> None:
        self.alloc.abort()
        if self._transport is not None:
            with self._rlock:
                addrs, self._ranges = list(self._ranges.values()), {}
            if self.registration == "whole":
                addrs = [self.base_addr]
            for a in addrs:
                with contextlib.suppress(Exception):  # transport may be closed already
                    self._transport.unregister(a)
            self._transport = None
