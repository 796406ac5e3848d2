"""What a transport exposes for remote access, and for how long (data-plane least exposure).

A transport peer (Mooncake on TCP: anyone who reaches its ports, unauthenticated) can
READ and WRITE whatever is registered at that moment. So HAWK registers per transfer:

* ``per_request`` (default): a request's memory is registered when its transfer needs it
  and unregistered when it is done — the prefill's ring range from P5 to Release (or
  lease expiry), a GG-Direct prefill's block runs from KVReady to Release, a decode's
  receive buffers or KV pages for the duration of one READ batch;
* ``whole``: the previous behaviour (the ring, the pool, the whole cache registered once
  at start), kept to measure what per-request registration costs
  (``hawk bench transfer --registration both``).

:class:`Exposure` registers byte ranges for a key with reference counts: ranges of
different keys may overlap (two requests sharing prefix blocks); an already registered
run is reused and only the uncovered gaps are registered, and a run is unregistered when
the last key holding it lets go.
"""
from __future__ import annotations

import bisect
import threading

REGISTRATIONS = ("per_request", "whole")


def check_registration(value: str) -> str:
    if value not in REGISTRATIONS:
        raise ValueError(f"registration must be one of {REGISTRATIONS}, got {value!r}")
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


class Exposure:
    """Reference-counted registration of byte ranges with ``transport`` (thread-safe)."""

    def __init__(self, transport) -> None:
        self.transport = transport
        self._lock = threading.Lock()
        self._starts: list[int] = []  # registered runs, sorted by start
        self._runs: dict[int, list[int]] = {}  # start -> [end, refcount]
        self._held: dict[str, list[int]] = {}  # key -> run starts it holds
        self.registrations = 0  # register calls made (for the benchmark)

    def acquire(self, key: str, ranges) -> None:
        """Register ``ranges`` for ``key`` (which must hold nothing yet). On a failed
        registration nothing stays held for ``key``."""
        with self._lock:
            if key in self._held:
                raise ValueError(f"exposure: {key!r} already holds registered memory")
            held: list[int] = []
            self._held[key] = held
            try:
                for a, n in merged(ranges):
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
            self.transport.register(pos, gap_end - pos)
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
                try:
                    self.transport.unregister(s)
                except Exception:  # noqa: BLE001 - transport closed already
                    pass
