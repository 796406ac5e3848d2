"""The one interface every KV transport implements.

A transport moves bytes between this process's registered memory and a peer's
registered memory. Addresses are virtual addresses (``int``) in the address space of
the memory's ``location``: ``"cpu"`` (host memory) or a device such as ``"cuda:0"``
(device memory, read by the NIC over GPUDirect RDMA); sizes are bytes. A caller holds a
:class:`Transport` and never branches on which one it is:

    t.accepts_memory("cuda:0")                    # can peers reach memory there?
    t.register(addr, nbytes, location)            # once per buffer (ring, bank buffer)
    h = t.submit("read", peer, [(local, remote, nbytes), ...])   # one batch
    t.wait(h, timeout_s=5.0)                      # TransferFailed / TransferTimeout
    t.unregister(addr); t.close()

``submit`` never blocks on the peer: a dead or hanging peer shows up as
``TransferFailed`` or ``TransferTimeout`` from ``wait`` within the caller's deadline.
Every transport refuses an entry that is not wholly inside one registered region,
on both sides: a local range error raises :class:`RegionError` at submit time; a
remote one fails the transfer (the target refuses it, nothing is written).
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Kind = Literal["read", "write"]
#: One transfer entry: (local_addr, remote_addr, nbytes). "read" copies remote -> local,
#: "write" copies local -> remote.
Entry = tuple[int, int, int]

MAX_ADDR = 2**64 - 1
#: The location of host memory (torch's name for it); a device's is ``"<type>:<index>"``.
HOST = "cpu"


class TransportError(RuntimeError):
    """Base class of transport errors."""


class RegionError(TransportError, ValueError):
    """An address range is not inside one registered region (or overlaps one on register)."""


class TransferFailed(TransportError):
    """The batch failed: peer unreachable or died, remote range refused, I/O error."""


class TransferTimeout(TransportError):
    """The caller's deadline passed before the batch finished (it may still be in flight)."""


class TransferState(enum.Enum):
    """Lifecycle of one submitted batch."""

    PENDING = "pending"  # submitted, entries still moving
    DONE = "done"  # every entry finished successfully
    FAILED = "failed"  # at least one entry failed; see TransferHandle.error


@dataclass(eq=False)
class TransferHandle:
    """One submitted batch. Opaque to callers except for the read-only fields below.

    ``settled`` is set once no entry of the batch can still touch local memory (after
    DONE, or after a FAILED batch's in-flight entries drained). After a timeout or a
    failure, reuse the local buffers only once ``settled`` is set.
    """

    kind: Kind
    peer: str
    num_entries: int
    total_nbytes: int
    submitted_at: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.PENDING
    error: str = ""
    finished_at: float | None = None
    done_event: threading.Event = field(default_factory=threading.Event, repr=False)
    settled: threading.Event = field(default_factory=threading.Event, repr=False)

    def describe(self) -> str:
        return f"{self.kind} of {self.num_entries} entries ({self.total_nbytes} bytes) with peer {self.peer}"

    # Implementations call these two; they are idempotent (first outcome wins).
    def finish_ok(self) -> None:
        if self.state is TransferState.PENDING:
            self.state = TransferState.DONE
            self.finished_at = time.monotonic()
        self.done_event.set()

    def finish_failed(self, reason: str) -> None:
        if self.state is TransferState.PENDING:
            self.state = TransferState.FAILED
            self.error = reason
            self.finished_at = time.monotonic()
        self.done_event.set()


@runtime_checkable
class Transport(Protocol):
    """What the connector needs from a byte mover (Mooncake, host-staged, in-process)."""

    @property
    def endpoint(self) -> str:
        """The name a peer passes as ``peer`` to reach us, e.g. ``"127.0.0.1:15123"``."""

    def accepts_memory(self, location: str) -> bool:
        """True when this transport can register memory at ``location`` (``"cpu"``,
        ``"cuda:0"``, ...) so that peers reach it."""

    def register(self, addr: int, nbytes: int, location: str = HOST) -> None:
        """Make ``[addr, addr + nbytes)`` of the memory at ``location`` usable locally and
        reachable by peers; RegionError where :meth:`accepts_memory` is False."""

    def unregister(self, addr: int) -> None:
        """Forget the region registered at ``addr`` (exact start address)."""

    def submit(self, kind: Kind, peer: str, entries: Sequence[Entry]) -> TransferHandle:
        """Start one batch; never waits for the peer. Raises RegionError/ValueError."""

    def poll(self, handle: TransferHandle) -> TransferState:
        """Current state of ``handle``; cheap and non-blocking."""

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until DONE; raise TransferFailed or TransferTimeout (naming peer, entries)."""

    def close(self) -> None:
        """Stop threads, unregister everything; idempotent."""


def wait_handle(handle: TransferHandle, timeout_s: float) -> None:
    """Shared ``wait`` body: block on the handle's event with our own deadline."""
    if timeout_s is None or timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
    if not handle.done_event.wait(timeout_s):
        raise TransferTimeout(f"timed out after {timeout_s:.3f} s: {handle.describe()}")
    if handle.state is TransferState.FAILED:
        raise TransferFailed(f"failed: {handle.describe()}: {handle.error}")


def check_kind(kind: str) -> Kind:
    if kind not in ("read", "write"):
        raise ValueError(f"kind must be 'read' or 'write', got {kind!r}")
    return kind  # type: ignore[return-value]


def check_entries(entries: Sequence[Entry], max_entries: int = 1 << 20) -> tuple[int, int]:
    """Validate entry tuples (ints, nbytes > 0, no address overflow).

    Returns ``(num_entries, total_nbytes)``.
    """
    n = len(entries)
    if n == 0:
        raise ValueError("a batch needs at least one entry")
    if n > max_entries:
        raise ValueError(f"batch of {n} entries exceeds the limit of {max_entries}")
    total = 0
    for i, e in enumerate(entries):
        if len(e) != 3:
            raise ValueError(f"entry {i} must be (local_addr, remote_addr, nbytes), got {e!r}")
        local, remote, nbytes = e
        for name, v in (("local_addr", local), ("remote_addr", remote), ("nbytes", nbytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"entry {i}: {name} must be a non-negative int, got {v!r}")
        if nbytes == 0:
            raise ValueError(f"entry {i}: nbytes must be > 0")
        if local + nbytes > MAX_ADDR or remote + nbytes > MAX_ADDR:
            raise ValueError(f"entry {i}: address range overflows 64 bits")
        total += nbytes
    return n, total


HOST_ONLY = (
    "it reaches host memory ('cpu') only; device memory needs transport mooncake-rdma with Mooncake's "
    "wheel for torch's CUDA (the [cu12] or [cu13] extra)"
)


def check_location(transport, location: str, what: str, why: str = HOST_ONLY) -> None:
    """Raise RegionError naming ``what`` (the transport) and ``why`` unless it accepts ``location``."""
    if not transport.accepts_memory(location):
        raise RegionError(f"{what} cannot register memory at {location!r}: {why}")


def begin_transfer(regions: RegionTable, kind: str, peer: str, entries: Sequence[Entry]) -> TransferHandle:
    """Validate a ``submit`` call (kind, entries, local ranges registered) and open its handle."""
    check_kind(kind)
    n, total = check_entries(entries)
    regions.check_local(entries)
    return TransferHandle(kind=kind, peer=peer, num_entries=n, total_nbytes=total)


def closed_transfer(h: TransferHandle) -> TransferHandle:
    """Settle ``h`` as failed because the transport is closed."""
    h.finish_failed("transport is closed")
    h.settled.set()
    return h


class RegionTable:
    """Registered address ranges of one process; thread-safe; non-overlapping.

    ``contains(addr, nbytes)`` is True only when the whole range lies inside ONE region.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []  # exclusive, parallel to _starts

    def add(self, addr: int, nbytes: int) -> None:
        if not isinstance(addr, int) or not isinstance(nbytes, int) or addr <= 0 or nbytes <= 0:
            raise RegionError(f"register needs addr > 0 and nbytes > 0, got {addr!r}, {nbytes!r}")
        if addr + nbytes > MAX_ADDR:
            raise RegionError("registered range overflows 64 bits")
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            if i > 0 and self._ends[i - 1] > addr:
                raise RegionError(f"range {addr:#x}+{nbytes} overlaps region at {self._starts[i - 1]:#x}")
            if i < len(self._starts) and self._starts[i] < addr + nbytes:
                raise RegionError(f"range {addr:#x}+{nbytes} overlaps region at {self._starts[i]:#x}")
            self._starts.insert(i, addr)
            self._ends.insert(i, addr + nbytes)

    def remove(self, addr: int) -> int:
        """Remove the region starting exactly at ``addr``; return its size in bytes."""
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i == len(self._starts) or self._starts[i] != addr:
                raise RegionError(f"no region registered at {addr:#x}")
            nbytes = self._ends[i] - addr
            del self._starts[i]
            del self._ends[i]
            return nbytes

    def contains(self, addr: int, nbytes: int) -> bool:
        if nbytes <= 0 or addr < 0:
            return False
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            return i >= 0 and addr + nbytes <= self._ends[i]

    def regions(self) -> list[tuple[int, int]]:
        """``[(addr, nbytes), ...]`` in address order."""
        with self._lock:
            return [(s, e - s) for s, e in zip(self._starts, self._ends, strict=False)]

    def __len__(self) -> int:
        return len(self._starts)

    def check_local(self, entries: Sequence[Entry]) -> None:
        """Raise RegionError unless every entry's local range is inside one region."""
        for i, (local, _remote, nbytes) in enumerate(entries):
            if not self.contains(local, nbytes):
                raise RegionError(f"entry {i}: local range {local:#x}+{nbytes} is not inside a registered region")
