"""The host-staged transport's data server: one listener, its accept thread and a
thread per authenticated connection, serving reads and writes of the registered regions
within the bounds of :mod:`~vllm_hawk.transport.host_staged`'s module doc."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import selectors
import socket
import threading
import time

from vllm_hawk.security import Refusals
from vllm_hawk.transport.base import RegionTable
from vllm_hawk.transport.staged_auth import ANSWER, AUTH_OK, HELLO, HelloCheck
from vllm_hawk.transport.staged_wire import (
    MAGIC,
    OP_READ,
    OP_WRITE,
    REQ,
    RESP,
    ST_BAD_OP,
    ST_OK,
    ST_OUT_OF_RANGE,
    ST_TOO_LARGE,
    recv_exact,
    rlog,
    staging,
)


class StagedServer:
    """Serves ``regions`` on ``bind_host:port`` until ``closed`` is set.

    key: the derived shared key or None; stats: where refusals are counted;
    max_piece_nbytes: the largest request (bytes); io_timeout_s: per socket operation;
    max_connections / max_pending / idle_timeout_s / auth_timeout_s: the module doc's bounds.
    """

    def __init__(
        self,
        bind_host: str,
        port: int,
        advertise_host: str | None,
        *,
        regions: RegionTable,
        stats: Refusals,
        key: bytes | None,
        closed: threading.Event,
        max_piece_nbytes: int,
        io_timeout_s: float,
        max_connections: int,
        max_pending: int,
        idle_timeout_s: float,
        auth_timeout_s: float,
    ) -> None:
        self._regions, self.stats, self._closed = regions, stats, closed
        self._max_piece, self._io_timeout, self._max_conns = max_piece_nbytes, io_timeout_s, max_connections
        self._max_pending = max(1, max_pending)
        self._idle_timeout = idle_timeout_s
        self._auth_timeout = auth_timeout_s
        self._pending: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()  # accept thread only
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        # A long accept queue: under a flood of idle connections a legitimate peer's SYN
        # must wait in it (the accept thread drains it fast) rather than be dropped.
        self._listener = socket.create_server((bind_host, port), backlog=1024)
        self._listener.settimeout(0.2)
        host = advertise_host or bind_host
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._hello = HelloCheck(key, stats, self.endpoint)  # accept thread only
        self._accept_thread = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"hawk-hs-accept-{self.endpoint}"
        )
        self._accept_thread.start()

    def connections(self) -> list[socket.socket]:
        """The authenticated connections being served now."""
        with self._lock:
            return list(self._conns)

    def join(self) -> None:
        """After ``closed`` is set: wait for the accept thread, close the listener."""
        self._accept_thread.join(timeout=2.0)
        self._listener.close()

    # ---------------------------------------------------------------- accepting
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
                rlog("accept", "host-staged server %s: accept failed: %s", self.endpoint, e)
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
            data = conn.recv(HELLO.size - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop_pending(sel, bufs, conn)
            return
        buf += data
        if len(buf) < HELLO.size:
            return
        self._pending.pop(conn, None)
        bufs.pop(conn, None)
        sel.unregister(conn)
        status, proof = self._hello.check(bytes(buf))
        try:
            conn.setblocking(True)
            conn.settimeout(self._auth_timeout)
            conn.sendall(ANSWER.pack(status, proof))
        except OSError:
            status = -1
        if status == AUTH_OK and self._admit(conn):
            threading.Thread(
                target=self._serve_conn, args=(conn,), daemon=True, name=f"hawk-hs-serve-{self.endpoint}"
            ).start()
        else:
            conn.close()

    def _admit(self, conn: socket.socket) -> bool:
        """Take an authenticated connection unless ``max_connections`` are served or the
        server is closing."""
        with self._lock:
            if len(self._conns) >= self._max_conns:
                self.stats.count("connections_full")
                rlog("full", "host-staged server %s: %d connections: refusing another", self.endpoint, self._max_conns)
                return False
            if self._closed.is_set():
                return False
            self._conns.add(conn)
            return True

    # ---------------------------------------------------------------- serving
    def _serve_conn(self, conn: socket.socket) -> None:
        staging_buf = None
        staging_addr = 0
        view = memoryview(b"")
        hdr = bytearray(REQ.size)
        hview = memoryview(hdr)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._closed.is_set():
                conn.settimeout(self._idle_timeout)  # idle connections are closed
                try:
                    recv_exact(conn, hview[:1])
                except TimeoutError:
                    self.stats.count("idle_closed")
                    return
                conn.settimeout(self._io_timeout)
                recv_exact(conn, hview[1:])
                magic, op, remote, nbytes = REQ.unpack(hdr)
                if magic != MAGIC or op not in (OP_READ, OP_WRITE):
                    self.stats.count("bad_request")
                    rlog("bad", "host-staged server %s: bad request header, closing connection", self.endpoint)
                    conn.sendall(RESP.pack(ST_BAD_OP, 0))
                    return
                if nbytes > self._max_piece or nbytes == 0:
                    # A write payload we will not buffer: we cannot resync, so close.
                    self.stats.count("too_large")
                    conn.sendall(RESP.pack(ST_TOO_LARGE, 0))
                    return
                if not self._regions.contains(remote, nbytes):  # before allocating or reading anything
                    self.stats.count("out_of_range")
                    rlog(
                        "range",
                        "host-staged server %s: refused a %s of %d bytes outside the registered regions",
                        self.endpoint,
                        "write" if op == OP_WRITE else "read",
                        nbytes,
                    )
                    conn.sendall(RESP.pack(ST_OUT_OF_RANGE, 0))
                    if op == OP_WRITE:
                        return  # its payload follows and is never read: close
                    continue
                if len(view) < nbytes:
                    staging_buf, staging_addr, view = staging(max(nbytes, 1 << 20))
                if op == OP_WRITE:
                    recv_exact(conn, view[:nbytes])  # TCP -> host staging
                    if self._regions.contains(remote, nbytes):  # unregistered meanwhile?
                        ctypes.memmove(remote, staging_addr, nbytes)  # staging -> device
                        conn.sendall(RESP.pack(ST_OK, nbytes))
                    else:
                        conn.sendall(RESP.pack(ST_OUT_OF_RANGE, 0))
                else:
                    ctypes.memmove(staging_addr, remote, nbytes)  # device -> staging
                    conn.sendall(RESP.pack(ST_OK, nbytes))
                    conn.sendall(view[:nbytes])
        except (OSError, ConnectionError):
            pass
        finally:
            del staging_buf
            with self._lock:
                self._conns.discard(conn)
            conn.close()
