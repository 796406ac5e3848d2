"""In-process transport: ``ctypes.memmove`` between transports of one process.

For unit tests of everything above the transport. Each instance is reachable by its
``endpoint`` (``"inproc:<n>"``) through a process-wide table; a closed instance is a
dead peer. Both the local and the target's registered ranges are checked, like the
real transports. ``fail_next`` injects failures for tests of the failure paths.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

from vllm_hawk.transport.base import (
    HOST,
    Entry,
    Kind,
    RegionTable,
    TransferHandle,
    TransferState,
    begin_transfer,
    check_location,
    wait_handle,
)

_ids = itertools.count(1)
_peers: dict[str, InProcessTransport] = {}
_peers_lock = threading.Lock()


class InProcessTransport:
    """Synchronous memcpy transport; ``submit`` completes (or fails) the batch at once."""

    def __init__(self) -> None:
        self._endpoint = f"inproc:{next(_ids)}"
        self._regions = RegionTable()
        self._closed = False
        self.fail_next = 0  # number of following batches to fail on purpose (tests)
        with _peers_lock:
            _peers[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def accepts_memory(self, location: str) -> bool:
        return location == HOST  # it copies with memmove: host memory only

    def register(self, addr: int, nbytes: int, location: str = HOST) -> None:
        check_location(self, location, "the in-process transport")
        self._regions.add(addr, nbytes)

    def unregister(self, addr: int) -> None:
        self._regions.remove(addr)

    def submit(self, kind: Kind, peer: str, entries: Sequence[Entry]) -> TransferHandle:
        h = begin_transfer(self._regions, kind, peer, entries)
        with _peers_lock:
            target = _peers.get(peer)
        if self._closed:
            h.finish_failed("transport is closed")
        elif target is None or target._closed:
            h.finish_failed("peer unreachable")
        elif self.fail_next > 0:
            self.fail_next -= 1
            h.finish_failed("injected failure")
        else:
            bad = [i for i, (_l, r, nb) in enumerate(entries) if not target._regions.contains(r, nb)]
            if bad:
                h.finish_failed(
                    f"peer refused {len(bad)} entries outside its registered regions (first: entry {bad[0]})"
                )
            else:
                for local, remote, nbytes in entries:
                    if kind == "read":
                        ctypes.memmove(local, remote, nbytes)
                    else:
                        ctypes.memmove(remote, local, nbytes)
                h.finish_ok()
        h.settled.set()
        return h

    def poll(self, handle: TransferHandle) -> TransferState:
        return handle.state

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        wait_handle(handle, timeout_s)

    def close(self) -> None:
        self._closed = True
        with _peers_lock:
            _peers.pop(self._endpoint, None)
