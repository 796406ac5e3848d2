"""What a transport exposes for remote access, and for how long (data-plane least exposure).

A transport peer (Mooncake on TCP: anyone who reaches its ports, unauthenticated) can
READ and WRITE whatever is registered at that moment. So HAWK registers per transfer:

* ``per_request`` (default): a request's memory is registered when its transfer needs it
  and unregistered when it is done — the prefill's ring range from P5 to Release (or
  lease expiry), a GG-Direct prefill's block runs from KVReady to Release, a decode's
  receive buffers or KV pages for the duration of one READ batch;
* ``whole``: the ring, the pool, the whole cache registered once at start (also what
  ``hawk bench transfer --registration both`` compares per-request registration with);
* ``auto`` (:func:`resolve_registration`): ``whole`` for memory on a device (a GPU ring
  or cache: registering a GPU range costs a registration per NIC, and Mooncake's dma-buf
  route may keep an fd per registration, so it is registered once, as NIXL does),
  ``per_request`` for host memory.

:class:`Exposure` registers byte ranges for a key with reference counts: ranges of
different keys may overlap (two requests sharing prefix blocks); an already registered
run is reused and only the uncovered gaps are registered, and a run is unregistered when
the last key holding it lets go.

Cost, measured on Mooncake TCP (0.3.13, loopback): ``register_memory`` takes 60-150 us
per region while few are registered and grows with the number registered (500 us each
with 4,096 registered). A direct landing into Tenstorrent KV pages needs thousands of
page runs, so ``acquire`` takes ``max_ranges``: beyond it the smallest gaps between runs
are closed (within one ``domain``, e.g. one bank's mapping or one cache tensor, never
across) until at most ``max_ranges`` regions remain. The exposure of such a fetch is then
the span of pages between its first and last page in each bank — other requests' pages
in between included — but still only for the fetch's duration.
"""

from __future__ import annotations

import bisect
import contextlib
import threading

REGISTRATIONS = ("per_request", "whole")
REGISTRATION_CHOICES = ("auto", *REGISTRATIONS)  # what a user may set
MAX_RANGES = 64  # regions registered per acquire (see the module doc)


def check_registration(value: str) -> str:
    if value not in REGISTRATIONS:
        raise ValueError(f"registration must be one of {REGISTRATIONS}, got {value!r}")
    return value


def resolve_registration(value: str, location: str) -> str:
    """``value`` (one of :data:`REGISTRATION_CHOICES`) for memory at ``location``
    (``"cpu"``, ``"cuda:0"``...): ``auto`` is ``whole`` on a device, ``per_request`` in
    host memory (see the module doc); the others are themselves."""
    if value == "auto":
        return "per_request" if location == "cpu" else "whole"
    if value not in REGISTRATIONS:
        raise ValueError(f"registration must be one of {REGISTRATION_CHOICES}, got {value!r}")
    return value


def merged(ranges) -> list[tuple[int, int]]:
    """(addr, nbytes) ranges merged where adjacent or overlapping, sorted."""
    out: list[list[int]] = []
    for a, n in sorted(ranges):
        if n <= 0:
            continue
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n - out[-1][0])
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]


def coarsened(runs: list[tuple[int, int]], domains, max_ranges: int | None) -> list[tuple[int, int]]:
    """Close the smallest gaps between sorted disjoint ``runs`` (only where both runs lie
    in the same one of ``domains``) until at most ``max_ranges`` remain."""
    if not max_ranges or len(runs) <= max_ranges or not domains:
        return runs
    doms = merged(domains)
    starts = [a for a, _n in doms]

    def dom(a: int, n: int) -> int:
        i = bisect.bisect_right(starts, a) - 1
        return i if i >= 0 and a + n <= doms[i][0] + doms[i][1] else -1

    ids = [dom(a, n) for a, n in runs]
    gaps = sorted(
        (runs[i + 1][0] - runs[i][0] - runs[i][1], i)
        for i in range(len(runs) - 1)
        if ids[i] >= 0 and ids[i] == ids[i + 1]
    )
    join = set(i for _g, i in gaps[: max(0, len(runs) - max_ranges)])
    out: list[list[int]] = []
    for i, (a, n) in enumerate(runs):
        if out and i - 1 in join:
            out[-1][1] = a + n - out[-1][0]
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]


class Exposure:
    """Reference-counted registration of byte ranges with ``transport`` (thread-safe), all
    of the memory at ``location`` (``"cpu"``, or a device such as ``"cuda:0"``)."""

    def __init__(self, transport, location: str = "cpu") -> None:
        self.transport, self.location = transport, location
        self._lock = threading.Lock()
        self._starts: list[int] = []  # registered runs, sorted by start
        self._runs: dict[int, list[int]] = {}  # start -> [end, refcount]
        self._held: dict[str, list[int]] = {}  # key -> run starts it holds
        self.registrations = 0  # register calls made (for the benchmark)

    def acquire(self, key: str, ranges, *, domains=None, max_ranges: int | None = MAX_RANGES) -> None:
        """Register ``ranges`` for ``key`` (which must hold nothing yet), coarsened to at most
        ``max_ranges`` regions inside ``domains`` (see the module doc). On a failed
        registration nothing stays held for ``key``."""
        runs = coarsened(merged(ranges), domains, max_ranges)
        with self._lock:
            if key in self._held:
                raise ValueError(f"exposure: {key!r} already holds registered memory")
            held: list[int] = []
            self._held[key] = held
            try:
                for a, n in runs:
                    self._cover_locked(a, a + n, held)
            except BaseException:
                self._release_locked(key)
                raise

    def release(self, key: str) -> None:
        """Let go of ``key``'s ranges (no-op for an unknown key)."""
        with self._lock:
            self._release_locked(key)

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._held

    def registered(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(s, self._runs[s][0] - s) for s in self._starts]

    def close(self) -> None:
        with self._lock:
            for key in list(self._held):
                self._release_locked(key)

    # ------------------------------------------------------------------ internals
    def _cover_locked(self, a: int, end: int, held: list[int]) -> None:
        i = bisect.bisect_right(self._starts, a) - 1
        if i < 0 or self._runs[self._starts[i]][0] <= a:
            i += 1
        pos = a
        while pos < end:
            if i < len(self._starts) and self._starts[i] <= pos:  # an existing run covers pos
                s = self._starts[i]
                self._runs[s][1] += 1
                held.append(s)
                pos = self._runs[s][0]
                i += 1
                continue
            gap_end = min(end, self._starts[i]) if i < len(self._starts) else end
            self.transport.register(pos, gap_end - pos, self.location)
            self.registrations += 1
            self._starts.insert(i, pos)
            self._runs[pos] = [gap_end, 1]
            held.append(pos)
            pos = gap_end
            i += 1

    def _release_locked(self, key: str) -> None:
        for s in self._held.pop(key, ()):
            run = self._runs[s]
            run[1] -= 1
            if run[1] == 0:
                del self._runs[s]
                self._starts.remove(s)
                with contextlib.suppress(Exception):  # transport closed already
                    self.transport.unregister(s)
