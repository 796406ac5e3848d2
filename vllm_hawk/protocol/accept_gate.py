"""A bound on what peers without the secret cost the side channel: the listening socket is
ours (handed to libzmq with ``ZMQ_USE_FD``), and a classic BPF filter on it, which the
kernel runs on each SYN before a connection exists, drops sources over their budget.

Each accepted connection from a source that has not authenticated (no Hello from its
address yet) costs libzmq's I/O thread an accept, a CURVE HELLO (an X25519 operation:
about 130 us here) and a close. The gate counts those accepts (monitor
``EVENT_ACCEPTED``) in token buckets:

* per source address: :data:`PER_SOURCE_RATE` a second, burst :data:`PER_SOURCE_BURST`;
  a source that overdraws is blocked for :data:`BLOCK_S` (its SYNs dropped in the kernel);
* all unauthenticated sources together: :data:`GLOBAL_RATE` a second, burst
  :data:`GLOBAL_BURST`; overdrawn, the gate admits only sources that authenticated before,
  for :data:`CLOSED_S` (a flood from many addresses).

Sources with an authenticated session on record (at most :data:`MAX_ADMITTED`, most
recent kept) are never counted or blocked: the nodes holding the secret are trusted.
Connections already established keep the filter they were accepted under (the kernel
copies it), which passed their source, so a filter change never touches them. IPv4 only:
libzmq binds any other endpoint itself, without a gate.
"""

from __future__ import annotations

import collections
import ctypes
import os
import socket
import struct
import time

import zmq

PER_SOURCE_RATE = 20.0  # unauthenticated connections a second from one address
PER_SOURCE_BURST = 100.0
BLOCK_S = 10.0  # how long an address over its budget is blocked
GLOBAL_RATE = 200.0  # unauthenticated connections a second from all addresses together
GLOBAL_BURST = 400.0
CLOSED_S = 1.0  # how long the gate admits only authenticated sources once overdrawn
MAX_ADMITTED = 256  # source addresses with an authenticated session, kept for the filter
MAX_BLOCKED = 512  # blocked addresses; beyond it the gate closes instead
MAX_TRACKED = 4096  # addresses with a bucket (oldest dropped)

_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
_SKF_NET_OFF = -0x100000  # cBPF: offsets from the IP header (a TCP filter's data is the TCP header)
_LD_W_ABS, _JEQ_K, _JA, _RET_K = 0x20, 0x15, 0x05, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0


def _ip(addr: str) -> int:
    return struct.unpack("!I", socket.inet_aton(addr))[0]


def program(admitted: list[str], blocked: list[str], closed: bool) -> list[tuple[int, int, int, int]]:
    """cBPF ``(code, jt, jf, k)``: admitted sources pass; then blocked ones are dropped;
    then the rest pass, or are dropped when ``closed``."""
    ins = [(_LD_W_ABS, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFFFFFF)]  # IPv4 source address
    tests = [(a, True) for a in admitted] + ([] if closed else [(b, False) for b in blocked])
    n = len(tests)
    for i, (addr, ok) in enumerate(tests):  # jeq, then a 32-bit jump (jt/jf are 8 bits)
        target = 2 * n + 2 if ok else 2 * n + 3  # index of ret ACCEPT / ret DROP
        ins.append((_JEQ_K, 0, 1, _ip(addr)))
        ins.append((_JA, 0, 0, target - (3 + 2 * i)))
    ins.append((_RET_K, 0, 0, _DROP if closed else _ACCEPT))
    ins.append((_RET_K, 0, 0, _ACCEPT))
    ins.append((_RET_K, 0, 0, _DROP))
    return ins


def attach(fd: int, ins: list[tuple[int, int, int, int]]) -> None:
    """Replace the filter on socket ``fd`` (atomically, in the kernel)."""
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in ins))
    prog = struct.pack("HL", len(ins), ctypes.addressof(code))
    s = socket.socket(fileno=fd)
    try:
        s.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, prog)
    finally:
        s.detach()  # libzmq owns the fd


def listen_ipv4(bind: str, backlog: int) -> tuple[int, str] | None:
    """For ``tcp://<IPv4 or *>:<port>``: a listening socket's fd and the endpoint to give
    libzmq with it; None for any other endpoint (libzmq binds it, without a gate)."""
    if not bind.startswith("tcp://"):
        return None
    host, _, port = bind[len("tcp://") :].rpartition(":")
    host = "0.0.0.0" if host in ("*", "") else host
    try:
        socket.inet_aton(host)
        port_n = int(port)
    except (OSError, ValueError):
        return None
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq's own listener
        s.bind((host, port_n))
        s.listen(backlog)
        s.set_inheritable(False)
    except OSError as e:  # raised as libzmq would (callers catch zmq.ZMQError, e.g. port in use)
        s.close()
        raise zmq.ZMQError(e.errno or zmq.EINVAL, f"side channel cannot bind {bind}: {e.strerror or e}") from e
    except BaseException:
        s.close()
        raise
    endpoint = f"tcp://{host}:{s.getsockname()[1]}"
    return s.detach(), endpoint


class _Bucket:
    __slots__ = ("tokens", "t")

    def __init__(self, burst: float, now: float) -> None:
        self.tokens, self.t = burst, now

    def take(self, rate: float, burst: float, now: float) -> bool:
        self.tokens = min(burst, self.tokens + (now - self.t) * rate)
        self.t = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class AcceptGate:
    """The budgets of one listening socket ``fd`` (used from the server thread only; with
    ``fd`` None, for an endpoint without a gate, every call does nothing).

    ``accepted(fd)`` per monitor ``EVENT_ACCEPTED`` (the accepted socket's fd);
    ``admit(addr)`` when a Hello from ``addr`` opened a session; ``tick()`` now and then
    (reopens what expired). ``count(kind)`` counts refusals (``flood_source_blocked``,
    ``flood_gate_closed``)."""

    def __init__(self, fd: int | None, count) -> None:
        self.fd, self._count = fd, count
        now = time.monotonic()
        self._admitted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._buckets: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()
        self._blocked: dict[str, float] = {}  # address -> unblock time (monotonic)
        self._global = _Bucket(GLOBAL_BURST, now)
        self._closed_until = 0.0
        self._installed: tuple | None = None

    def accepted(self, conn_fd: int) -> None:
        if self.fd is None:
            return
        try:
            s = socket.socket(fileno=conn_fd)
        except OSError:  # already closed by libzmq (and reused for something else)
            return
        try:
            addr = s.getpeername()[0]
        except OSError:
            return
        finally:
            s.detach()
        if addr in self._admitted:
            return
        now = time.monotonic()
        b = self._buckets.get(addr)
        if b is None:
            b = self._buckets[addr] = _Bucket(PER_SOURCE_BURST, now)
            while len(self._buckets) > MAX_TRACKED:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(addr)
        changed = False
        if not b.take(PER_SOURCE_RATE, PER_SOURCE_BURST, now) and addr not in self._blocked:
            if len(self._blocked) < MAX_BLOCKED:
                self._blocked[addr] = now + BLOCK_S
                self._count("flood_source_blocked")
            else:
                self._closed_until = now + CLOSED_S
            changed = True
        if not self._global.take(GLOBAL_RATE, GLOBAL_BURST, now) and now >= self._closed_until:
            self._closed_until = now + CLOSED_S
            self._count("flood_gate_closed")
            changed = True
        if changed:
            self._install(now)

    def admit(self, addr: str | None) -> None:
        if self.fd is None:
            return
        if not addr or addr in self._admitted:
            if addr:
                self._admitted.move_to_end(addr)
            return
        try:
            _ip(addr)
        except OSError:
            return
        self._admitted[addr] = None
        while len(self._admitted) > MAX_ADMITTED:
            self._admitted.popitem(last=False)
        self._blocked.pop(addr, None)
        self._install(time.monotonic())

    def tick(self) -> None:
        if self.fd is None:
            return
        now = time.monotonic()
        expired = [a for a, until in self._blocked.items() if until <= now]
        for a in expired:
            del self._blocked[a]
        if expired or (self._installed and self._installed[2] and now >= self._closed_until):
            self._install(now)

    def _install(self, now: float) -> None:
        want = (tuple(self._admitted), tuple(self._blocked), now < self._closed_until)
        if want == self._installed:
            return
        if want == ((), (), False) and self._installed is None:
            return
        attach(self.fd, program(list(want[0]), list(want[1]), want[2]))
        self._installed = want

    def snapshot(self) -> dict:
        return {
            "admitted": len(self._admitted),
            "blocked": len(self._blocked),
            "closed": time.monotonic() < self._closed_until,
        }


def bind_gated(sock: zmq.Socket, bind: str, backlog: int, events: int, count) -> tuple[AcceptGate, zmq.Socket]:
    """Bind ROUTER ``sock`` to ``bind`` (IPv4: through a listening socket of ours, gated)
    and start its monitor for ``events`` (plus ``EVENT_ACCEPTED`` when gated). Returns
    ``(gate, monitor)`` (a gate with ``fd`` None for other endpoints); on an error nothing
    is left open or monitored."""
    listening = listen_ipv4(bind, backlog)
    if listening is not None:
        fd, bind = listening
        sock.setsockopt(zmq.USE_FD, fd)
        events |= zmq.EVENT_ACCEPTED
    monitor = None
    try:
        monitor = sock.get_monitor_socket(events)
        sock.bind(bind)  # from here libzmq owns the fd and closes it with the socket
    except BaseException:
        if listening is not None:
            os.close(listening[0])
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
        raise
    return AcceptGate(listening[0] if listening is not None else None, count), monitor
