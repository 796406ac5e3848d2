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

import collections
import contextlib
import ctypes
import hashlib
import hmac
import logging
import os
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hawk.security import RateLimitedLog, Refusals, derive_key
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

logger = logging.getLogger(__name__)

_MAGIC = b"HKHS"
_GREET_MAGIC = b"HKHA"
_HELLO = struct.Struct("<4sB3xQ32s32s")
_ANSWER = struct.Struct("<B7x32s")
AUTH_WINDOW_S = 30.0
_AUTH_OK, _AUTH_REQUIRED, _AUTH_FAILED, _AUTH_NONE_HERE = 0, 1, 2, 3
_ANSWER_TEXT = {
    _AUTH_REQUIRED: "requires the shared secret and this side has none (auth 'none')",
    _AUTH_FAILED: "refused this side's proof of the shared secret: the secrets differ (or the clocks "
    "differ by more than 30 s)",
    _AUTH_NONE_HERE: "runs without authentication (auth 'none') and this side has a shared secret: "
    "configure both sides alike",
}
_REQ = struct.Struct("<4sB3xQQ")
_RESP = struct.Struct("<B7xQ")
_OP_READ, _OP_WRITE = 1, 2
_FLAG_AUTH = 1
IDLE_TIMEOUT_S = 60.0
AUTH_TIMEOUT_S = 2.0
MAX_PENDING = 32
_rlog = RateLimitedLog(logger)
ST_OK, ST_OUT_OF_RANGE, ST_TOO_LARGE, ST_BAD_OP = 0, 1, 2, 3
_STATUS_TEXT = {
    ST_OUT_OF_RANGE: "outside the peer's registered regions",
    ST_TOO_LARGE: "piece larger than the peer accepts",
    ST_BAD_OP: "bad op",
}


class _PeerError(Exception):
    """Connection-level failure talking to a peer."""


class _AuthFailed(_PeerError):
    """The peer could not prove the shared secret (or the auth settings differ)."""


def _mac(key: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, role + a + b, hashlib.sha256).digest()


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
        self._max_pending = max(1, max_pending)
        self._idle_timeout = idle_timeout_s
        self._auth_timeout = auth_timeout_s
        self._pending: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()  # accept thread only
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # nonces (accept thread only)
        self.stats = Refusals()
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

        # A long accept queue: under a flood of idle connections a legitimate peer's SYN
        # must wait in it (the accept thread drains it fast) rather than be dropped.
        self._listener = socket.create_server((bind_host, port), backlog=1024)
        self._listener.settimeout(0.2)
        host = advertise_host or bind_host
        self._endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._accept_thread = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"hawk-hs-accept-{self._endpoint}"
        )
        self._accept_thread.start()

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
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
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
            raise _PeerError(f"bad peer endpoint {peer!r} (want host:port)")
        try:
            s = socket.create_connection((host.strip("[]"), int(port)), timeout=self._io_timeout)
        except OSError as e:
            raise _PeerError(f"connect failed: {e}") from e
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(self._io_timeout)
        try:
            self._client_auth(s, peer)
        except BaseException:
            s.close()
            raise
        return s

    def _client_auth(self, s: socket.socket, peer: str) -> None:
        ts, nonce = int(time.time() * 1000), os.urandom(32)
        flags = _FLAG_AUTH if self._key else 0
        mac = _mac(self._key, b"c", ts.to_bytes(8, "little"), nonce) if self._key else bytes(32)
        s.sendall(_HELLO.pack(_GREET_MAGIC, flags, ts, nonce, mac))
        ans = bytearray(_ANSWER.size)
        try:
            _recv_exact(s, memoryview(ans))
        except (OSError, ConnectionError) as e:
            raise _AuthFailed(
                f"{peer} closed the connection before answering ({e}): not a host-staged peer "
                "of this version, or it is overloaded"
            ) from e
        status, proof = _ANSWER.unpack(ans)
        if status != _AUTH_OK:
            raise _AuthFailed(f"{peer} {_ANSWER_TEXT.get(status, f'answered status {status}')}")
        if self._key and not hmac.compare_digest(proof, _mac(self._key, b"s", nonce, ts.to_bytes(8, "little"))):
            raise _AuthFailed(f"{peer} could not prove the shared secret: the secrets differ (or an impostor)")

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
                h.finish_failed(str(e))
                if e.closed and sock is not None:  # the peer closes after a refused WRITE
                    with self._lock:
                        self._client_socks.discard(sock)
                    sock.close()
                    sock = None
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

    def _run_job(
        self, sock: socket.socket, job: _Job, staging_addr: int, staging: memoryview, resp: memoryview
    ) -> None:
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
                if job.op == _OP_WRITE:  # the server closed the connection (payload not read)
                    closed = True
                    break
                continue
            if job.op == _OP_READ:
                if rn != nbytes:
                    raise _PeerError(f"peer answered {rn} bytes for a {nbytes}-byte read")
                _recv_exact(sock, staging[:nbytes])
                ctypes.memmove(local, staging_addr, nbytes)  # host staging -> device
        if refused:
            raise _RemoteRefused(f"peer refused {refused} of {len(pieces)} pieces: {first_refusal}", closed)

    # ---------------------------------------------------------------- server side
    def _accept_loop(self) -> None:
        """Accept, and authenticate in a selector: nothing unauthenticated gets a thread."""
        sel = selectors.DefaultSelector()
        self._listener.setblocking(False)
        sel.register(self._listener, selectors.EVENT_READ)
        bufs: dict[socket.socket, bytearray] = {}
        try:
            while not self._closed.is_set():
                events = sel.select(0.2)
                # pending connections first: a legitimate proof is checked before more accepts
                for key, _ev in sorted(events, key=lambda e: e[0].fileobj is self._listener):
                    if key.fileobj is self._listener:
                        self._accept_some(sel, bufs)
                    else:
                        self._pending_readable(sel, bufs, key.fileobj)
                self._expire_pending(sel, bufs)
        finally:
            for c in list(bufs):
                sel.unregister(c)
                c.close()
            sel.close()

    def _accept_some(self, sel, bufs) -> None:
        for _ in range(64):
            try:
                conn, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.stats.count("accept_failed")  # e.g. EMFILE: out of file descriptors
                _rlog("accept", "host-staged server %s: accept failed: %s", self._endpoint, e)
                time.sleep(0.05)  # do not spin while the descriptors are gone
                return
            if len(self._pending) >= self._max_pending:  # drop the oldest unauthenticated one
                old, _t = self._pending.popitem(last=False)
                self.stats.count("pending_evicted")
                self._drop_pending(sel, bufs, old)
            conn.setblocking(False)
            self._pending[conn] = time.monotonic()
            bufs[conn] = bytearray()
            sel.register(conn, selectors.EVENT_READ)
            # a legitimate client's hello is usually here already: check it now, before a
            # later accept of this burst can evict the connection as the oldest pending one
            self._pending_readable(sel, bufs, conn)

    def _drop_pending(self, sel, bufs, conn) -> None:
        self._pending.pop(conn, None)
        bufs.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()

    def _expire_pending(self, sel, bufs) -> None:
        now = time.monotonic()
        while self._pending:
            conn, t = next(iter(self._pending.items()))
            if now - t < self._auth_timeout:
                break
            self.stats.count("auth_timeout")
            self._drop_pending(sel, bufs, conn)

    def _pending_readable(self, sel, bufs, conn) -> None:
        buf = bufs[conn]
        try:
            data = conn.recv(_HELLO.size - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop_pending(sel, bufs, conn)
            return
        buf += data
        if len(buf) < _HELLO.size:
            return
        self._pending.pop(conn, None)
        bufs.pop(conn, None)
        sel.unregister(conn)
        status, proof = self._check_hello(bytes(buf))
        try:
            conn.setblocking(True)
            conn.settimeout(self._auth_timeout)
            conn.sendall(_ANSWER.pack(status, proof))
        except OSError:
            status = -1
        admitted = False
        if status == _AUTH_OK:
            with self._lock:
                if len(self._server_conns) >= self._max_conns:
                    self.stats.count("connections_full")
                    _rlog(
                        "full",
                        "host-staged server %s: %d connections: refusing another",
                        self._endpoint,
                        self._max_conns,
                    )
                elif not self._closed.is_set():
                    self._server_conns.add(conn)
                    admitted = True
        if not admitted:
            conn.close()
            return
        threading.Thread(
            target=self._serve_conn, args=(conn,), daemon=True, name=f"hawk-hs-serve-{self._endpoint}"
        ).start()

    def _check_hello(self, raw: bytes) -> tuple[int, bytes]:
        magic, flags, ts, nonce, mac = _HELLO.unpack(raw)
        if magic != _GREET_MAGIC:
            self.stats.count("bad_hello")
            return _AUTH_FAILED, bytes(32)
        if self._key is None:
            if flags & _FLAG_AUTH:
                self.stats.count("auth_mismatch")
                return _AUTH_NONE_HERE, bytes(32)
            return _AUTH_OK, bytes(32)
        if not flags & _FLAG_AUTH:
            self.stats.count("auth_missing")
            _rlog("auth", "host-staged server %s: a peer without the shared secret connected", self._endpoint)
            return _AUTH_REQUIRED, bytes(32)
        tsb = ts.to_bytes(8, "little")
        fresh = abs(time.time() * 1000 - ts) <= AUTH_WINDOW_S * 1000
        if not (fresh and hmac.compare_digest(mac, _mac(self._key, b"c", tsb, nonce)) and self._first_use(nonce)):
            self.stats.count("auth_failed")
            _rlog(
                "auth",
                "host-staged server %s: a connection failed authentication (wrong secret, stale or replayed proof)",
                self._endpoint,
            )
            return _AUTH_FAILED, bytes(32)
        return _AUTH_OK, _mac(self._key, b"s", nonce, tsb)

    def _first_use(self, nonce: bytes) -> bool:
        """Replay cache: a nonce is accepted once within the window (bounded table)."""
        now = time.monotonic()
        seen = self._seen
        while seen and next(iter(seen.values())) < now - 2 * AUTH_WINDOW_S:
            seen.popitem(last=False)
        if nonce in seen:
            return False
        if len(seen) >= 1 << 16:
            seen.popitem(last=False)
            self.stats.count("replay_cache_evicted")
        seen[nonce] = now
        return True

    def _serve_conn(self, conn: socket.socket) -> None:
        staging_buf = None
        staging_addr = 0
        staging = memoryview(b"")
        hdr = bytearray(_REQ.size)
        hview = memoryview(hdr)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._closed.is_set():
                conn.settimeout(self._idle_timeout)  # idle connections are closed
                try:
                    _recv_exact(conn, hview[:1])
                except TimeoutError:
                    self.stats.count("idle_closed")
                    return
                conn.settimeout(self._io_timeout)
                _recv_exact(conn, hview[1:])
                magic, op, remote, nbytes = _REQ.unpack(hdr)
                if magic != _MAGIC or op not in (_OP_READ, _OP_WRITE):
                    self.stats.count("bad_request")
                    _rlog("bad", "host-staged server %s: bad request header, closing connection", self._endpoint)
                    conn.sendall(_RESP.pack(ST_BAD_OP, 0))
                    return
                if nbytes > self._max_piece or nbytes == 0:
                    # A write payload we will not buffer: we cannot resync, so close.
                    self.stats.count("too_large")
                    conn.sendall(_RESP.pack(ST_TOO_LARGE, 0))
                    return
                if not self._regions.contains(remote, nbytes):  # before allocating or reading anything
                    self.stats.count("out_of_range")
                    _rlog(
                        "range",
                        "host-staged server %s: refused a %s of %d bytes outside the registered regions",
                        self._endpoint,
                        "write" if op == _OP_WRITE else "read",
                        nbytes,
                    )
                    conn.sendall(_RESP.pack(ST_OUT_OF_RANGE, 0))
                    if op == _OP_WRITE:
                        return  # its payload follows and is never read: close
                    continue
                if len(staging) < nbytes:
                    staging_buf, staging_addr, staging = _staging(max(nbytes, 1 << 20))
                if op == _OP_WRITE:
                    _recv_exact(conn, staging[:nbytes])  # TCP -> host staging
                    if self._regions.contains(remote, nbytes):  # unregistered meanwhile?
                        ctypes.memmove(remote, staging_addr, nbytes)  # staging -> device
                        conn.sendall(_RESP.pack(ST_OK, nbytes))
                    else:
                        conn.sendall(_RESP.pack(ST_OUT_OF_RANGE, 0))
                else:
                    ctypes.memmove(staging_addr, remote, nbytes)  # device -> staging
                    conn.sendall(_RESP.pack(ST_OK, nbytes))
                    conn.sendall(staging[:nbytes])
        except (OSError, ConnectionError):
            pass
        finally:
            del staging_buf
            with self._lock:
                self._server_conns.discard(conn)
            conn.close()


class _RemoteRefused(Exception):
    """The peer answered but refused some pieces (``closed``: it closed the connection)."""

    def __init__(self, msg: str, closed: bool = False) -> None:
        super().__init__(msg)
        self.closed = closed
