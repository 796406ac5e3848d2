"""A FAKE at the network boundary, for the integrity tests: a real transport plus one fault.

:class:`FaultyTransport` wraps the decode's transport. ``flip``: after a READ batch
completed, one bit of one landed byte flips (a bit flipped in flight). ``reuse``: before a
READ batch is submitted, the prefill's memory it will read is overwritten with other
bytes (the prefill freed the range or block and another request's KV was written there
before the READ); this needs the prefill's memory in this process (in-process tests).
``once``: only the first batch (else every one). Everything else is the wrapped
transport's. Imports nothing of vllm_hawk, so an engine process can load it early
(``faults/sitecustomize.py``)."""

from __future__ import annotations

import ctypes
import threading

FAULTS = ("flip", "reuse", "none")


def corrupt(addr: int, nbytes: int) -> None:
    """XOR ``nbytes`` bytes of host memory at ``addr`` with 0x5A (another request's bytes)."""
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    for i in range(nbytes):
        buf[i] ^= 0x5A


class FaultyTransport:
    def __init__(self, inner, fault: str, pick: float = 0.5, once: bool = True) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.inner, self.fault, self.pick, self.once = inner, fault, pick, once
        self.fired: list[tuple[int, int]] = []  # (address, nbytes) corrupted
        self._entries: dict[int, list] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _target(self, entries) -> tuple[int, int, int] | None:
        """(local address, remote address, bytes left in its entry) of the byte at ``pick``
        of the batch's bytes."""
        if not entries or (self.once and self.fired):
            return None
        at = int(sum(e[2] for e in entries) * self.pick)
        for loc, rem, n in entries:
            if at < n:
                return loc + at, rem + at, n - at
            at -= n
        return None

    def submit(self, kind, peer, entries):
        if self.fault == "reuse" and kind == "read":
            with self._lock:
                t = self._target(entries)
                if t is not None:
                    _, rem, left = t
                    corrupt(rem, min(64, left))
                    self.fired.append((rem, min(64, left)))
        h = self.inner.submit(kind, peer, entries)
        self._entries[id(h)] = list(entries) if kind == "read" else []
        return h

    def wait(self, handle, timeout_s):
        self.inner.wait(handle, timeout_s)
        entries = self._entries.pop(id(handle), [])
        if self.fault == "flip":
            with self._lock:
                t = self._target(entries)
                if t is not None:
                    ctypes.c_uint8.from_address(t[0]).value ^= 0x10  # one bit
                    self.fired.append((t[0], 1))
