"""KV transports: one interface (:class:`Transport`), three implementations.

=============  ============================================================
``mooncake``   Mooncake Transfer Engine, RDMA on hardware / TCP here (HAWK, GG-Direct)
``host_staged`` extra host copy on each side + plain TCP (GG-Host / GN-Host baseline)
``inprocess``  memmove inside one process (unit tests)
=============  ============================================================

Use :func:`make_transport` so callers never import a backend by name.
"""

from __future__ import annotations

from typing import Any

from vllm_hawk.transport.base import (
    Entry,
    Kind,
    RegionError,
    RegionTable,
    TransferFailed,
    TransferHandle,
    TransferState,
    TransferTimeout,
    Transport,
    TransportError,
)

TRANSPORT_KINDS = ("mooncake", "host_staged", "inprocess")


def make_transport(kind: str, **options: Any) -> Transport:
    """Build a transport by name; ``options`` go to its constructor."""
    if kind == "mooncake":
        from vllm_hawk.transport.mooncake import MooncakeTransport

        return MooncakeTransport(**options)
    if kind == "host_staged":
        from vllm_hawk.transport.host_staged import HostStagedTransport

        return HostStagedTransport(**options)
    if kind == "inprocess":
        from vllm_hawk.transport.inprocess import InProcessTransport

        return InProcessTransport(**options)
    raise ValueError(f"unknown transport {kind!r}; choose one of {TRANSPORT_KINDS}")


__all__ = [
    "Entry",
    "Kind",
    "RegionError",
    "RegionTable",
    "TRANSPORT_KINDS",
    "TransferFailed",
    "TransferHandle",
    "TransferState",
    "TransferTimeout",
    "Transport",
    "TransportError",
    "make_transport",
]
