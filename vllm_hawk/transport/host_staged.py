"""Host-staged baseline transport (the paper's GG-Host / GN-Host rows).

Bytes take the path the paper measures HAWK against:

    device memory -> host staging buffer -> TCP stream -> host staging buffer -> device memory

i.e. one extra copy on each side plus a plain TCP socket. Every entry is cut into
pieces of at most ``chunk_nbytes``; each piece is copied through a fixed staging
buffer (``ctypes.memmove``, standing in for a device<->host DMA) and sent as one
request on a per-peer connection, with up to ``window`` pieces in flight.

Each transport runs a small server thread that serves reads and writes of its
registered regions and refuses anything outside them.

Authentication (``secret``): every connection proves the shared secret before the
server reads a request. The client speaks first, in its first packet: a fresh nonce, its
clock (ms) and HMAC-SHA256(k, "c" | time | nonce); the server accepts it within a 30 s
window and only once per nonce (bounded replay cache), then answers a status and
HMAC(k, "s" | nonce | time), which the client checks (mutual: the client never moves
memory for an impostor). ``k`` is derived from the secret for this use only. A mismatch
(secret on one side only, or different secrets) fails the client's transfer with an
error that names it.

Resource bounds: unauthenticated connections wait in the accept thread's selector, not
in threads; one must authenticate within ``auth_timeout_s`` (2 s); at most
``max_pending`` may wait at once and the oldest is dropped for a new one. Because a
legitimate client's proof is already in its first packet, it is checked as soon as its
connection is accepted, so an idle flood cannot lock peers out. At most
``max_connections`` authenticated connections (more are refused, counted); one idle for
``idle_timeout_s`` is closed. A request's range is checked before anything is
allocated or read; an out-of-range WRITE is refused and the connection closed (its
payload is never buffered). ``stats`` counts refusals by reason.

Wire format (little endian), one TCP connection per (client, peer):
  hello    client ``<4sB3xQ32s32s>``: magic b"HKHA", flags (1 = has a secret), time (unix
           ms), nonce, MAC (zeros without a secret);
  answer   server ``<B7x32s>``: status (0 ok, 1 a secret is required, 2 authentication
           failed, 3 this side has no secret), MAC (zeros without a secret);
  request  ``<4sB3xQQ``: magic b"HKHS", op (1 read, 2 write), remote_addr, nbytes;
           a write request is followed by ``nbytes`` payload bytes.
  response ``<B7xQ``: status (0 ok, 1 outside registered regions, 2 too large,
           3 bad op), nbytes; an ok read response is followed by the payload.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hawk.security import Refusals, derive_key
from vllm_hawk.transport.base import (
    HOST,
    Entry,
    Kind,
    RegionTable,
    TransferHandle,
    TransferState,
    begin_transfer,
    check_location,
    closed_transfer,
    wait_handle,
)
from vllm_hawk.transport.staged_auth import client_handshake
from vllm_hawk.transport.staged_server import StagedServer
from vllm_hawk.transport.staged_wire import (
    MAGIC,
    OP_READ,
    OP_WRITE,
    REQ,
    RESP,
    ST_OK,
    STATUS_TEXT,
    PeerError,
    RemoteRefused,
    recv_exact,
    staging,
)

IDLE_TIMEOUT_S = 60.0
AUTH_TIMEOUT_S = 2.0
MAX_PENDING = 32


@dataclass
class _Job:
    handle: TransferHandle
    op: int
    entries: Sequence[Entry]


class HostStagedTransport:
    """Host-staged TCP transport with a serving thread (:class:`StagedServer`).

    bind_host/port: where the data server listens (port 0 = ephemeral).
    advertise_host: host part of ``endpoint`` (defaults to bind_host).
    chunk_nbytes: staging buffer size = largest piece sent (bytes).
    max_piece_nbytes: largest piece the server accepts (bytes).
    window: pieces in flight per connection. io_timeout_s: per socket operation.
    secret: shared secret (>= 16 bytes) or None (no authentication, say so explicitly
    by passing None); max_connections / max_pending / idle_timeout_s / auth_timeout_s:
    the bounds of the module doc.
    """

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        chunk_nbytes: int = 4 << 20,
        max_piece_nbytes: int = 64 << 20,
        window: int = 32,
        io_timeout_s: float = 10.0,
        max_connections: int = 64,
        secret: bytes | None = None,
        max_pending: int = MAX_PENDING,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
    ) -> None:
        if chunk_nbytes <= 0 or chunk_nbytes > max_piece_nbytes:
            raise ValueError(f"need 0 < chunk_nbytes <= max_piece_nbytes, got {chunk_nbytes}, {max_piece_nbytes}")
        self._key = derive_key(secret, "host-staged") if secret is not None else None
        self.stats = Refusals()
        self._regions = RegionTable()
        self._chunk = chunk_nbytes
        self._window = max(1, window)
        self._io_timeout = io_timeout_s
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[threading.Thread, queue.Queue]] = {}
        self._client_socks: set[socket.socket] = set()
        self._server = StagedServer(
            bind_host,
            port,
            advertise_host,
            regions=self._regions,
            stats=self.stats,
            key=self._key,
            closed=self._closed,
            max_piece_nbytes=max_piece_nbytes,
            io_timeout_s=io_timeout_s,
            max_connections=max_connections,
            max_pending=max_pending,
            idle_timeout_s=idle_timeout_s,
            auth_timeout_s=auth_timeout_s,
        )
        self._endpoint = self._server.endpoint

    # ---------------------------------------------------------------- interface
    @property
    def endpoint(self) -> str:
        return self._endpoint

    def accepts_memory(self, location: str) -> bool:
        return location == HOST  # it copies with memmove: host memory only

    def register(self, addr: int, nbytes: int, location: str = HOST) -> None:
        check_location(self, location, "the host-staged transport")
        self._regions.add(addr, nbytes)

    def unregister(self, addr: int) -> None:
        self._regions.remove(addr)

    def submit(self, kind: Kind, peer: str, entries: Sequence[Entry]) -> TransferHandle:
        h = begin_transfer(self._regions, kind, peer, entries)
        if self._closed.is_set():
            return closed_transfer(h)
        job = _Job(h, OP_READ if kind == "read" else OP_WRITE, list(entries))
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
            conns = list(self._client_socks)
        conns = self._server.connections() + conns
        for _t, q in workers:
            q.put(None)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._server.join()
        for t, _q in workers:
            t.join(timeout=2.0)

    # ---------------------------------------------------------------- client side
    def _worker_queue(self, peer: str) -> queue.Queue:
        with self._lock:
            entry = self._workers.get(peer)
            if entry is None:
                q: queue.Queue = queue.Queue()
                t = threading.Thread(
                    target=self._client_loop, args=(peer, q), daemon=True, name=f"hawk-hs-client-{peer}"
                )
                self._workers[peer] = (t, q)
                t.start()
                return q
            return entry[1]

    def _connect(self, peer: str) -> socket.socket:
        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit():
            raise PeerError(f"bad peer endpoint {peer!r} (want host:port)")
        try:
            s = socket.create_connection((host.strip("[]"), int(port)), timeout=self._io_timeout)
        except OSError as e:
            raise PeerError(f"connect failed: {e}") from e
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(self._io_timeout)
        try:
            client_handshake(s, self._key, peer)
        except BaseException:
            s.close()
            raise
        return s

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._client_socks.discard(sock)
        sock.close()

    def _client_loop(self, peer: str, q: queue.Queue) -> None:
        _buf, staging_addr, view = staging(self._chunk)
        sock: socket.socket | None = None
        resp = bytearray(RESP.size)
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
                self._run_job(sock, job, staging_addr, view, memoryview(resp))
            except RemoteRefused as e:
                h.finish_failed(str(e))
                if e.closed and sock is not None:  # the peer closes after a refused WRITE
                    self._drop(sock)
                    sock = None
            except (OSError, PeerError, ConnectionError) as e:
                if sock is not None:
                    self._drop(sock)
                    sock = None
                h.finish_failed(f"peer I/O error: {e}")
            else:
                h.finish_ok()
            h.settled.set()
        if sock is not None:
            self._drop(sock)

    def _run_job(self, sock: socket.socket, job: _Job, staging_addr: int, view: memoryview, resp: memoryview) -> None:
        """Send ``job``'s pieces (at most ``chunk_nbytes`` each, ``window`` in flight)
        through the staging buffer at ``staging_addr`` (``view``); RemoteRefused if the
        peer refused any."""
        pieces = [
            (local + off, remote + off, min(self._chunk, nbytes - off))
            for local, remote, nbytes in job.entries
            for off in range(0, nbytes, self._chunk)
        ]
        pending: list[tuple[int, int]] = []  # (local_addr, nbytes) awaiting a response
        refused = 0
        first_refusal = ""
        closed = False
        i = 0
        while i < len(pieces) or pending:
            if i < len(pieces) and len(pending) < self._window:
                local, remote, nbytes = pieces[i]
                i += 1
                sock.sendall(REQ.pack(MAGIC, job.op, remote, nbytes))
                if job.op == OP_WRITE:
                    ctypes.memmove(staging_addr, local, nbytes)  # device -> host staging
                    sock.sendall(view[:nbytes])
                pending.append((local, nbytes))
                continue
            local, nbytes = pending.pop(0)
            recv_exact(sock, resp)
            status, rn = RESP.unpack(resp)
            if status != ST_OK:
                refused += 1
                first_refusal = first_refusal or STATUS_TEXT.get(status, f"status {status}")
                if job.op == OP_WRITE:  # the server closed the connection (payload not read)
                    closed = True
                    break
                continue
            if job.op == OP_READ:
                if rn != nbytes:
                    raise PeerError(f"peer answered {rn} bytes for a {nbytes}-byte read")
                recv_exact(sock, view[:nbytes])
                ctypes.memmove(local, staging_addr, nbytes)  # host staging -> device
        if refused:
            raise RemoteRefused(f"peer refused {refused} of {len(pieces)} pieces: {first_refusal}", closed)
