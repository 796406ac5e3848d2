"""Host-staged baseline transport (the paper's GG-Host / GN-Host rows).

Bytes take the path the paper measures HAWK against:

    device memory -> host staging buffer -> TCP stream -> host staging buffer -> device memory

i.e. one extra copy on each side plus a plain TCP socket. Every entry is cut into
pieces of at most ``chunk_nbytes``; each piece is copied through a fixed staging
buffer (``ctypes.memmove``, standing in for a device<->host DMA) and sent as one
request on a per-peer connection, with up to ``window`` pieces in flight.

Each transport runs a small server thread that serves reads and writes of its
registered regions and refuses anything outside them. There is no authentication on
the data port: bind it to a private address (default 127.0.0.1).

Wire format (little endian), one TCP connection per (client, peer):
  request  ``<4sB3xQQ``: magic b"HKHS", op (1 read, 2 write), remote_addr, nbytes;
           a write request is followed by ``nbytes`` payload bytes.
  response ``<B7xQ``: status (0 ok, 1 outside registered regions, 2 too large,
           3 bad op), nbytes; an ok read response is followed by the payload.
"""
from __future__ import annotations

import ctypes
import logging
import queue
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Sequence

from vllm_hawk.transport.base import (
    Entry,
    Kind,
    RegionTable,
    TransferHandle,
    TransferState,
    begin_transfer,
    closed_transfer,
    wait_handle,
)

logger = logging.getLogger(__name__)

_MAGIC = b"HKHS"
_REQ = struct.Struct("<4sB3xQQ")
_RESP = struct.Struct("<B7xQ")
_OP_READ, _OP_WRITE = 1, 2
_IDLE_TIMEOUT_S = 300.0
ST_OK, ST_OUT_OF_RANGE, ST_TOO_LARGE, ST_BAD_OP = 0, 1, 2, 3
_STATUS_TEXT = {ST_OUT_OF_RANGE: "outside the peer's registered regions",
                ST_TOO_LARGE: "piece larger than the peer accepts", ST_BAD_OP: "bad op"}


class _PeerError(Exception):
    """Connection-level failure talking to a peer."""


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def _staging(nbytes: int) -> tuple[ctypes.Array, int, memoryview]:
    buf = (ctypes.c_char * nbytes)()
    return buf, ctypes.addressof(buf), memoryview(buf).cast("B")


@dataclass
class _Job:
    handle: TransferHandle
    op: int
    entries: Sequence[Entry]


class HostStagedTransport:
    """Host-staged TCP transport with a serving thread.

    bind_host/port: where the data server listens (port 0 = ephemeral).
    advertise_host: host part of ``endpoint`` (defaults to bind_host).
    chunk_nbytes: staging buffer size = largest piece sent (bytes).
    max_piece_nbytes: largest piece the server accepts (bytes).
    window: pieces in flight per connection. io_timeout_s: per socket operation.
    """

    def __init__(self, bind_host: str = "127.0.0.1", port: int = 0, *,
                 advertise_host: str | None = None, chunk_nbytes: int = 4 << 20,
                 max_piece_nbytes: int = 64 << 20, window: int = 32,
                 io_timeout_s: float = 10.0, max_connections: int = 64) -> None:
        if chunk_nbytes <= 0 or chunk_nbytes > max_piece_nbytes:
            raise ValueError("need 0 < chunk_nbytes <= max_piece_nbytes")
        self._regions = RegionTable()
        self._chunk = chunk_nbytes
        self._max_piece = max_piece_nbytes
        self._window = max(1, window)
        self._io_timeout = io_timeout_s
        self._max_conns = max_connections
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[threading.Thread, queue.Queue]] = {}
        self._server_conns: set[socket.socket] = set()
        self._client_socks: set[socket.socket] = set()

        self._listener = socket.create_server((bind_host, port), backlog=64)
        self._listener.settimeout(0.2)
        host = advertise_host or bind_host
        self._endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"hawk-hs-accept-{self._endpoint}")
        self._accept_thread.start()

    # ---------------------------------------------------------------- interface
    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, addr: int, nbytes: int) -> None:
        self._regions.add(addr, nbytes)

    def unregister(self, addr: int) -> None:
        self._regions.remove(addr)

    def submit(self, kind: Kind, peer: str, entries: Sequence[Entry]) -> TransferHandle:
        h = begin_transfer(self._regions, kind, peer, entries)
        if self._closed.is_set():
            return closed_transfer(h)
        job = _Job(h, _OP_READ if kind == "read" else _OP_WRITE, list(entries))
        self._worker_queue(peer).put(job)
        return h

    def poll(self, handle: TransferHandle) -> TransferState:
        return handle.state

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        wait_handle(handle, timeout_s)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
            conns = list(self._server_conns) + list(self._client_socks)
        for _t, q in workers:
            q.put(None)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept_thread.join(timeout=2.0)
        self._listener.close()
        for t, _q in workers:
            t.join(timeout=2.0)

    # ---------------------------------------------------------------- client side
    def _worker_queue(self, peer: str) -> queue.Queue:
        with self._lock:
            entry = self._workers.get(peer)
            if entry is None:
                q: queue.Queue = queue.Queue()
                t = threading.Thread(target=self._client_loop, args=(peer, q), daemon=True,
                                     name=f"hawk-hs-client-{peer}")
                self._workers[peer] = (t, q)
                t.start()
                return q
            return entry[1]

    def _connect(self, peer: str) -> socket.socket:
        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit():
            raise _PeerError(f"bad peer endpoint {peer!r} (want host:port)")
        try:
            s = socket.create_connection((host.strip("[]"), int(port)), timeout=self._io_timeout)
        except OSError as e:
            raise _PeerError(f"connect failed: {e}") from e
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(self._io_timeout)
        return s

    def _client_loop(self, peer: str, q: queue.Queue) -> None:
        _buf, staging_addr, staging = _staging(self._chunk)
        sock: socket.socket | None = None
        resp = bytearray(_RESP.size)
        while True:
            job = q.get()
            if job is None:
                break
            h = job.handle
            if self._closed.is_set():  # queued before close(): never touch memory after it
                closed_transfer(h)
                continue
            try:
                if sock is None:
                    sock = self._connect(peer)
                    with self._lock:
                        self._client_socks.add(sock)
                self._run_job(sock, job, staging_addr, staging, memoryview(resp))
            except _RemoteRefused as e:
                h.finish_failed(str(e))  # connection still in sync, keep it
            except (OSError, _PeerError, ConnectionError) as e:
                if sock is not None:
                    with self._lock:
                        self._client_socks.discard(sock)
                    sock.close()
                    sock = None
                h.finish_failed(f"peer I/O error: {e}")
            else:
                h.finish_ok()
            h.settled.set()
        if sock is not None:
            with self._lock:
                self._client_socks.discard(sock)
            sock.close()

    def _run_job(self, sock: socket.socket, job: _Job, staging_addr: int,
                 staging: memoryview, resp: memoryview) -> None:
        pieces = [(local + off, remote + off, min(self._chunk, nbytes - off))
                  for local, remote, nbytes in job.entries
                  for off in range(0, nbytes, self._chunk)]
        pending: list[tuple[int, int]] = []  # (local_addr, nbytes) awaiting a response
        refused = 0
        first_refusal = ""
        i = 0
        while i < len(pieces) or pending:
            if i < len(pieces) and len(pending) < self._window:
                local, remote, nbytes = pieces[i]
                i += 1
                sock.sendall(_REQ.pack(_MAGIC, job.op, remote, nbytes))
                if job.op == _OP_WRITE:
                    ctypes.memmove(staging_addr, local, nbytes)  # device -> host staging
                    sock.sendall(staging[:nbytes])
                pending.append((local, nbytes))
                continue
            local, nbytes = pending.pop(0)
            _recv_exact(sock, resp)
            status, rn = _RESP.unpack(resp)
            if status != ST_OK:
                refused += 1
                first_refusal = first_refusal or _STATUS_TEXT.get(status, f"status {status}")
                continue
            if job.op == _OP_READ:
                if rn != nbytes:
                    raise _PeerError(f"peer answered {rn} bytes for a {nbytes}-byte read")
                _recv_exact(sock, staging[:nbytes])
                ctypes.memmove(local, staging_addr, nbytes)  # host staging -> device
        if refused:
            raise _RemoteRefused(f"peer refused {refused} of {len(pieces)} pieces: "
                                 f"{first_refusal}")

    # ---------------------------------------------------------------- server side
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _addr = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            with self._lock:
                if len(self._server_conns) >= self._max_conns or self._closed.is_set():
                    conn.close()
                    continue
                self._server_conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                             name=f"hawk-hs-serve-{self._endpoint}").start()

    def _serve_conn(self, conn: socket.socket) -> None:
        staging_buf = None
        staging_addr = 0
        staging = memoryview(b"")
        hdr = bytearray(_REQ.size)
        hview = memoryview(hdr)
        try:
            while not self._closed.is_set():
                conn.settimeout(_IDLE_TIMEOUT_S)  # idle connections close eventually
                _recv_exact(conn, hview[:1])
                conn.settimeout(self._io_timeout)
                _recv_exact(conn, hview[1:])
                magic, op, remote, nbytes = _REQ.unpack(hdr)
                if magic != _MAGIC or op not in (_OP_READ, _OP_WRITE):
                    logger.warning("host-staged server: bad request header, closing connection")
                    conn.sendall(_RESP.pack(ST_BAD_OP, 0))
                    return
                if nbytes > self._max_piece or nbytes == 0:
                    # A write payload we will not buffer: we cannot resync, so close.
                    conn.sendall(_RESP.pack(ST_TOO_LARGE, 0))
                    return
                if len(staging) < nbytes:
                    staging_buf, staging_addr, staging = _staging(max(nbytes, 1 << 20))
                if op == _OP_WRITE:
                    _recv_exact(conn, staging[:nbytes])  # TCP -> host staging
                    if self._regions.contains(remote, nbytes):
                        ctypes.memmove(remote, staging_addr, nbytes)  # staging -> device
                        conn.sendall(_RESP.pack(ST_OK, nbytes))
                    else:
                        conn.sendall(_RESP.pack(ST_OUT_OF_RANGE, 0))
                else:
                    if self._regions.contains(remote, nbytes):
                        ctypes.memmove(staging_addr, remote, nbytes)  # device -> staging
                        conn.sendall(_RESP.pack(ST_OK, nbytes))
                        conn.sendall(staging[:nbytes])
                    else:
                        conn.sendall(_RESP.pack(ST_OUT_OF_RANGE, 0))
        except (OSError, ConnectionError):
            pass
        finally:
            del staging_buf
            with self._lock:
                self._server_conns.discard(conn)
            conn.close()


class _RemoteRefused(Exception):
    """The peer answered but refused some pieces (connection stays usable)."""
