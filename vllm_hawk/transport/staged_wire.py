"""The host-staged transport's request/response framing and its staging buffers.

Formats (little endian; see :mod:`~vllm_hawk.transport.host_staged` for the whole wire):
  request  ``<4sB3xQQ``: magic b"HKHS", op (1 read, 2 write), remote_addr, nbytes; a
           write request is followed by ``nbytes`` payload bytes;
  response ``<B7xQ``: status (``ST_*``), nbytes; an ok read response is followed by the
           payload.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct

from vllm_hawk.security import RateLimitedLog

logger = logging.getLogger("vllm_hawk.transport.host_staged")
rlog = RateLimitedLog(logger)  # the server's refusals, one key per kind

MAGIC = b"HKHS"
REQ = struct.Struct("<4sB3xQQ")
RESP = struct.Struct("<B7xQ")
OP_READ, OP_WRITE = 1, 2
ST_OK, ST_OUT_OF_RANGE, ST_TOO_LARGE, ST_BAD_OP = 0, 1, 2, 3
STATUS_TEXT = {
    ST_OUT_OF_RANGE: "outside the peer's registered regions",
    ST_TOO_LARGE: "piece larger than the peer accepts",
    ST_BAD_OP: "bad op",
}


class PeerError(Exception):
    """Connection-level failure talking to a peer."""


class RemoteRefused(Exception):
    """The peer answered but refused some pieces (``closed``: it closed the connection)."""

    def __init__(self, msg: str, closed: bool = False) -> None:
        super().__init__(msg)
        self.closed = closed


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def staging(nbytes: int) -> tuple[ctypes.Array, int, memoryview]:
    """A host staging buffer of ``nbytes``: (the buffer, its address, a byte view)."""
    buf = (ctypes.c_char * nbytes)()
    return buf, ctypes.addressof(buf), memoryview(buf).cast("B")
