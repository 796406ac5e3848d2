"""A transport double at the GPUDirect boundary: a NIC that reads device memory, which
the machines here do not have (no RDMA NIC, no GPU).

:class:`RecordingTransport` keeps what a prefill registers, under which memory location,
and accepts the ``locations`` it is given (``"cpu"``, ``"cuda:0"``, the opaque test
device's ``"hawkdev:0"``). A prefill never submits a transfer (its decode READs), so
``submit`` refuses: it stands in for Mooncake's registration only, for tests, the bench's
prefill check and the GPU check. Named as a fake; the real transports are
:mod:`vllm_hawk.transport`.
"""

from __future__ import annotations

from vllm_hawk.transport import RegionTable
from vllm_hawk.transport.base import HOST, check_location

__all__ = ["RecordingTransport"]


class RecordingTransport:
    """Registrations only; ``registered``: every ``register`` call ``(addr, nbytes,
    location)`` in order; :meth:`live`: those not unregistered yet."""

    endpoint = "recording:0"

    def __init__(self, locations) -> None:
        self.locations, self.regions = set(locations), RegionTable()
        self.registered: list[tuple[int, int, str]] = []
        self._live: dict[int, tuple[int, int, str]] = {}

    def accepts_memory(self, location: str) -> bool:
        return location in self.locations

    def register(self, addr: int, nbytes: int, location: str = HOST) -> None:
        check_location(self, location, "the recording transport")
        self.regions.add(addr, nbytes)
        self.registered.append((addr, nbytes, location))
        self._live[addr] = (addr, nbytes, location)

    def unregister(self, addr: int) -> None:
        self.regions.remove(addr)
        del self._live[addr]

    def live(self) -> list[tuple[int, int, str]]:
        return list(self._live.values())

    def submit(self, kind, peer, entries):
        raise NotImplementedError("the recording transport moves no bytes")

    def close(self) -> None:
        self._live.clear()
