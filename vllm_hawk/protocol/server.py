"""Prefill-side side-channel server: ZMQ ROUTER in a thread, dispatching to a handler.

The server owns the handshake (compatibility check), peer authentication and the
framing; the handler owns the KV logic (P1-P9). A handler answers at once by returning
a message, or later (the KV may not be computed yet) by returning None and calling
``reply(msg)`` from any thread.

Authentication (``auth``):

* ``"curve"`` (default with a secret): CurveZMQ on the socket with a ZAP handler that
  admits only the client key derived from the shared secret
  (:func:`vllm_hawk.security.curve_keypairs`). A peer without the secret never completes
  the ZMTP handshake: libzmq drops it after ``handshake_ivl_s`` (silent or idle
  connections too), before any of our code runs, so idle or unauthenticated connections
  hold an fd for at most that long. The HMAC envelope stays on top (message-level
  replay window, recipient binding, sender identity).
* ``"hmac"``: the HMAC envelope only (NULL ZMTP mechanism). Forged messages are
  dropped, but any peer can complete the ZMTP handshake and then hold its connection
  (and an fd) for as long as it likes: weaker against idle-connection floods.
* ``"none"`` (no secret): nothing is authenticated; only for a private, trusted network.

Peers without the secret are bounded in what they cost: on an IPv4 endpoint the
listening socket carries an :class:`~vllm_hawk.protocol.accept_gate.AcceptGate`, a
kernel filter that drops the SYNs of sources over their budget of unauthenticated
connections (per address and all together); sources that sent an accepted Hello pass.

Control peers (``ControlHello``: the proxy, with the shared secret) handshake without
compatibility fields; their sessions may send only ``Release`` (a KVRequest or a Renew
is refused ``bad_message``, counted ``control_kv_request`` / ``control_renew``: the
prefill holds a request through its hand-over by itself, so a control peer has no lease
to keep).

Bad input never stops the loop. With a secret, anything that fails authentication is
dropped without a reply, except that a message WITHOUT a MAC from a peer we can identify
(hmac mode) gets one unsigned ``ErrorMsg(auth_failed)`` naming the cause (rate-limited),
so that a decode with no secret fails its handshake with a clear error instead of a
timeout. A handshake is accepted when the compatibility fields are equal, or differ as
:func:`~vllm_hawk.protocol.compat.regroups` allows (a GG decode with larger blocks); a
refused one names the differing fields with both values only to an authenticated peer;
with auth ``none`` only the field names. Rejected input
is logged at most a few times per 10 s per kind (:class:`~vllm_hawk.security.RateLimitedLog`)
and counted in ``stats.refusals``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message  # imported now: opening files may fail under fd floods

from vllm_hawk.protocol.accept_gate import bind_gated
from vllm_hawk.protocol.compat import (
    check_vllm_pair,
    compat_hash,
    describe_diff,
    engine_version,
    regroups,
)
from vllm_hawk.protocol.envelope import (
    DEFAULT_MAX_MESSAGE_NBYTES,
    AuthError,
    AuthMismatch,
    Envelope,
    FrameError,
)
from vllm_hawk.protocol.messages import (
    Ack,
    CompatFields,
    ControlHello,
    ErrorMsg,
    Hello,
    HelloAck,
    KVReady,
    KVRequest,
    Message,
    Release,
    Renew,
    Renewed,
)
from vllm_hawk.protocol.wakeup import Wakeup
from vllm_hawk.protocol.zmq_context import new_context
from vllm_hawk.security import RateLimitedLog, Refusals, curve_keypairs

logger = logging.getLogger(__name__)

Reply = Callable[[Message], None]
AUTH_MODES = ("curve", "hmac", "none")
HANDSHAKE_IVL_S = 1.0  # a connection must finish the ZMTP (CURVE) handshake within this
BACKLOG = 1024  # pending TCP connections queued by the kernel (zmq's default is 100)
RCVHWM = 256  # messages queued per connection before zmq stops reading it (<= 256 MiB)
UNSIGNED_REPLIES_PER_S = 20.0  # unsigned auth_failed answers (token bucket, burst as much)

# Not EVENT_ACCEPT_FAILED: at the fd limit libzmq retries accept() in a busy loop and
# reports every failure (about 65,000 a second); reading them would double that cost.
_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def resolve_auth(auth: str | None, secret: bytes | None) -> str:
    """The effective mode: ``auth`` checked against whether a secret is given."""
    if auth is None:
        return "curve" if secret is not None else "none"
    if auth not in AUTH_MODES:
        raise ValueError(f"auth must be one of {AUTH_MODES}, got {auth!r}")
    if auth == "none" and secret is not None:
        raise ValueError("auth='none' with a shared secret: drop the secret or choose 'curve'/'hmac'")
    if auth != "none" and secret is None:
        raise ValueError(f"auth={auth!r} needs a shared secret (>= 16 bytes)")
    return auth


class ProtocolHandler(Protocol):
    """What the prefill side plugs into :class:`ProtocolServer`."""

    def hello_info(self) -> tuple[str, int, int]:
        """``(transfer_endpoint, export_base_addr, export_nbytes)`` for HelloAck. A handler
        may also define ``tp_info() -> dict`` with HelloAck's ``tp_size``, ``tp_rank``,
        ``num_kv_heads``, ``head_start`` and ``num_heads``."""

    def on_kv_request(self, peer: str, msg: KVRequest, reply: Reply) -> Message | None:
        """D1 -> P1-P7: return KVReady/ErrorMsg now, or None and call ``reply`` later.
        ``peer``: the requesting decode's (authenticated, with a secret) sender id."""

    def on_release(self, peer: str, msg: Release, reply: Reply) -> Message | None:
        """D8 -> P8-P9: free the ring region and blocks; return Ack or ErrorMsg."""

    def on_renew(self, peer: str, msg: Renew, reply: Reply) -> Message | None:
        """Heartbeat: extend the leases of ``msg.req_ids``; return Renewed or ErrorMsg."""


@dataclass
class ServerStats:
    received: int = 0
    replied: int = 0
    bad_messages: int = 0
    dropped_auth: int = 0
    handler_errors: int = 0
    handshakes_refused: int = 0
    zmtp_handshake_failures: int = 0  # CURVE/ZAP or protocol failures at connection level
    by_type: collections.Counter = field(default_factory=collections.Counter)
    refusals: Refusals = field(default_factory=Refusals)


class _CurvePeers:
    """ZAP credentials provider: admits exactly the client key derived from the secret."""

    def __init__(self, client_public_z85: bytes, refusals: Refusals) -> None:
        self.key, self.refusals = client_public_z85, refusals

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.key
        if not ok:
            self.refusals.count("zap_denied")
        return ok


class ProtocolServer:
    """ROUTER server for one prefill instance.

    bind: ZMQ endpoint, e.g. "tcp://127.0.0.1:0" (port 0 = pick one; see ``endpoint``).
    compat: our compatibility fields; secret: shared key (>= 16 bytes) or None; auth:
    ``curve`` | ``hmac`` | ``none`` (default: ``curve`` with a secret, else ``none``);
    server_id: our id (unique per start: default random) that signed requests must name;
    handshake_ivl_s: longest ZMTP handshake; max_sessions: handshaken connections kept
    (oldest evicted, counted).
    """

    def __init__(
        self,
        handler: ProtocolHandler,
        compat: CompatFields,
        *,
        bind: str = "tcp://127.0.0.1:0",
        secret: bytes | None = None,
        auth: str | None = None,
        server_id: str | None = None,
        window_s: float = 30.0,
        max_message_nbytes: int = DEFAULT_MAX_MESSAGE_NBYTES,
        max_sessions: int = 4096,
        handshake_ivl_s: float = HANDSHAKE_IVL_S,
        vllm_version: str | None = None,
    ) -> None:
        self._handler = handler
        self._compat = compat
        self.vllm_version = engine_version() if vllm_version is None else vllm_version
        self._hash = compat_hash(compat)
        self.auth = resolve_auth(auth, secret)
        self.server_id = server_id or f"prefill-{uuid.uuid4().hex[:12]}"
        self._env = Envelope(self.server_id, secret, window_s=window_s, max_message_nbytes=max_message_nbytes)
        self._max_sessions = max_sessions
        self._sessions: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._control: set[bytes] = set()  # sessions opened by ControlHello (subset of _sessions)
        self._hosts, self._frame = collections.OrderedDict(), None  # sender -> IP; the frame in hand
        self.stats = ServerStats()
        self._rlog = RateLimitedLog(logger)
        self._bucket = [UNSIGNED_REPLIES_PER_S, time.monotonic()]
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_lock = threading.Lock()  # number + queue a reply as one step (see _send)
        # Our own context: the ZAP handler is per context, and a process may run several
        # servers (the benchmark's prefill does).
        self._ctx = new_context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._monitor = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            # zmq drops (disconnects) a peer whose message exceeds this; our check is exact.
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_nbytes + 4096)
            self._sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_ivl_s * 1000)))
            self._sock.setsockopt(zmq.BACKLOG, BACKLOG)
            self._sock.setsockopt(zmq.RCVHWM, RCVHWM)
            self._sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            self._sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)
            if self.auth == "curve":
                from zmq.auth.thread import ThreadAuthenticator

                (spub, ssec), (cpub, _csec) = curve_keypairs(secret)
                self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".zap"))
                self._auth.start()
                self._auth.configure_curve_callback("*", _CurvePeers(cpub, self.stats.refusals))
                self._sock.curve_server = True
                self._sock.curve_publickey, self._sock.curve_secretkey = spub, ssec
                self._sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 0)
            self._gate, self._monitor = bind_gated(
                self._sock, bind, BACKLOG, _MONITOR_EVENTS, self.stats.refusals.count
            )
        except BaseException:
            self._teardown()  # e.g. port in use: leave nothing open behind the error
            raise
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wakeup = Wakeup(self._ctx, "hawk-server-wake")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"hawk-protocol-server-{self.endpoint}")
        self._thread.start()

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wakeup.wake()
        self._thread.join(timeout=5.0)
        self._wakeup.close_sender()
        if not self._thread.is_alive():
            self._teardown()

    def _teardown(self) -> None:
        if self._monitor is not None and not self._sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.destroy(linger=0)  # closes the socket, the monitor and the wake-up pair

    def __enter__(self) -> ProtocolServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sessions(self) -> int:
        return len(self._sessions)

    def peer_host(self, sender: str) -> str | None:
        """The IP ``sender``'s accepted Hello came from (None: unknown): engine_firewall.py."""
        return self._hosts.get(sender)

    # ---------------------------------------------------------------- loop
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.rx, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=500))
                if self._wakeup.rx in events:
                    self._wakeup.drain()
                if self._monitor in events:
                    self._drain_monitor()
                self._gate.tick()
                self._flush_outbox()
                if self._sock in events:
                    for _ in range(256):  # bounded burst, then service the outbox again
                        try:
                            raw = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._frame = raw[-1]
                        self._on_frames([f.bytes for f in raw])
                        self._flush_outbox()
        finally:
            self._wakeup.close_receiver()

    def _drain_monitor(self) -> None:
        for _ in range(1024):
            try:
                ev = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._gate.accepted(ev["value"])
            else:
                _zmtp_failed(self, ev)

    def _flush_outbox(self) -> None:
        while True:
            try:
                identity, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._sock.send_multipart([identity, *frames], zmq.NOBLOCK)
                self.stats.replied += 1
            except zmq.ZMQError as e:  # peer gone or its queue full: drop the reply
                logger.debug("protocol server: reply dropped: %s", e)

    def _send(self, identity: bytes, msg: Message, reply_to: int, recipient: str, *, sign: bool = True) -> None:
        # Replies come from the server thread and from handler threads at once. The peer
        # drops a sequence number lower than one it has seen (replay protection), so
        # numbering and queueing are one step: replies leave in sequence order.
        with self._send_lock:
            _seq, frames = self._env.pack(msg, reply_to, recipient, sign=sign)
            self._outbox.put((identity, frames))
        if threading.current_thread() is not self._thread:
            self._wakeup.wake()

    def _unsigned_allowed(self) -> bool:
        """Token bucket for unsigned answers to peers we cannot authenticate."""
        now = time.monotonic()
        tokens, t = self._bucket
        tokens = min(UNSIGNED_REPLIES_PER_S, tokens + (now - t) * UNSIGNED_REPLIES_PER_S)
        ok = tokens >= 1.0
        self._bucket[:] = [tokens - 1.0 if ok else tokens, now]
        return ok

    def _on_frames(self, frames: list[bytes]) -> None:
        self.stats.received += 1
        if len(frames) < 2:
            return
        identity = frames[0]
        unpacked = self._unpack(identity, frames[1:])
        if unpacked is None:
            return
        header, msg = unpacked
        self.stats.by_type[type(msg).__name__] += 1
        seq, peer = header.seq, header.sender
        try:
            self._dispatch(identity, header, msg)
            if isinstance(msg, (Hello, ControlHello)) and identity in self._sessions:
                self._gate.admit(_peer_address(self._frame))  # an accepted Hello (authenticated, with a secret)
        except Exception as e:  # noqa: BLE001 - a handler bug must not kill the server
            self.stats.handler_errors += 1
            logger.exception("protocol server: handler failed")
            self._send(
                identity,
                ErrorMsg(
                    code="internal", detail=f"{type(e).__name__}: {str(e)[:500]}", req_id=getattr(msg, "req_id", "")
                ),
                seq,
                peer,
            )

    def _unpack(self, identity: bytes, payload: list[bytes]):
        """``(header, msg)``, or None for a message refused here (counted, answered where
        the peer can be told why without helping a stranger)."""
        try:
            return self._env.unpack(payload)
        except AuthMismatch as e:  # we have no secret, the peer signs
            self.stats.dropped_auth += 1
            self.stats.refusals.count("auth_mismatch")
            self._rlog("mismatch", "protocol server: %s", e)
            if self._unsigned_allowed():
                self._send(
                    identity,
                    ErrorMsg(
                        code="auth_failed",
                        detail="this prefill runs with auth 'none' but "
                        "the decode has a shared secret: configure both sides alike",
                    ),
                    e.header.seq,
                    e.header.sender,
                    sign=False,
                )
        except AuthError as e:
            self.stats.dropped_auth += 1
            self.stats.refusals.count("auth")
            self._rlog("auth", "protocol server: dropped unauthenticated message: %s", e)
            if e.header is not None and self._unsigned_allowed():  # missing or bad MAC
                why = (
                    "this prefill requires side-channel authentication"
                    if "missing" in str(e)
                    else "the MAC does not verify: the shared secrets differ"
                )
                self._send(
                    identity,
                    ErrorMsg(
                        code="auth_failed",
                        detail=f"{why}: set the same shared_secret (or shared_secret_file) on both sides",
                    ),
                    e.header.seq,
                    e.header.sender,
                    sign=False,
                )
        except FrameError as e:
            self.stats.bad_messages += 1
            self.stats.refusals.count("bad_message")
            self._rlog("bad", "protocol server: bad message: %s", e)
            if self._env.authenticated and e.header is None:
                self.stats.dropped_auth += 1
                return None  # cannot be authenticated: drop silently
            self._send(
                identity,
                ErrorMsg(code="bad_message", detail=str(e)[:1000]),
                e.header.seq if e.header else 0,
                e.header.sender if e.header else "",
            )
        return None

    def _dispatch(self, identity: bytes, header, msg) -> None:
        """A Hello opens a session; anything else needs one and goes to the handler."""
        seq, peer = header.seq, header.sender
        if isinstance(msg, (Hello, ControlHello)):
            self._send(identity, self._on_hello(identity, peer, msg), seq, peer)
            return
        known = self._sessions.get(identity)
        if known is None or not header.recipient:  # only a Hello may be sent to nobody
            self._send(identity, ErrorMsg(code="bad_message", detail="handshake (Hello) required first"), seq, peer)
            return
        if known != peer:
            self.stats.refusals.count("sender_changed")
            self._send(
                identity, ErrorMsg(code="bad_message", detail="sender id differs from the handshake's"), seq, peer
            )
            return
        self._sessions.move_to_end(identity)
        reply = _OnceReply(self, identity, seq, peer)
        if isinstance(msg, KVRequest) and identity in self._control:
            self.stats.refusals.count("control_kv_request")
            out = ErrorMsg(code="bad_message", detail="a control session may not request KV", req_id=msg.req_id)
        elif isinstance(msg, Renew) and identity in self._control:
            self.stats.refusals.count("control_renew")
            out = ErrorMsg(code="bad_message", detail="a control session may only Release")
        elif isinstance(msg, KVRequest):
            out = self._handler.on_kv_request(peer, msg, reply)
        elif isinstance(msg, Release):
            out = self._handler.on_release(peer, msg, reply)
        elif isinstance(msg, Renew):
            out = self._handler.on_renew(peer, msg, reply)
        else:
            self.stats.bad_messages += 1
            out = ErrorMsg(code="bad_message", detail=f"{type(msg).__name__} is not a request")
        if out is not None:
            reply(out)

    def _on_hello(self, identity: bytes, sender: str, msg: Hello | ControlHello) -> Message:
        if isinstance(msg, ControlHello):
            return self._open_session(identity, sender, control=True)
        theirs = msg.compat
        if compat_hash(theirs) != msg.compat_hash:
            self.stats.bad_messages += 1
            return ErrorMsg(code="bad_message", detail="compat_hash does not match the fields")
        if msg.compat_hash != self._hash and not regroups(self._compat, theirs):
            self.stats.handshakes_refused += 1
            if self.auth == "none":  # an unauthenticated peer gets names only; the values go to the log
                self._rlog(
                    "compat", "protocol server: refused an incompatible peer: %s", describe_diff(self._compat, theirs)
                )
            detail = "incompatible peer: " + describe_diff(self._compat, theirs, values=self.auth != "none")
            return ErrorMsg(code="layout_mismatch", detail=detail[:1000])
        why = check_vllm_pair(self.vllm_version, msg.vllm_version)
        if why:
            self.stats.handshakes_refused += 1
            self._rlog("vllm", "protocol server: refused a peer: %s", why)
            return ErrorMsg(code="layout_mismatch", detail=("incompatible peer: " + why)[:1000])
        return self._open_session(identity, sender, control=False)

    def _open_session(self, identity: bytes, sender: str, control: bool) -> HelloAck:
        if identity not in self._sessions and len(self._sessions) >= self._max_sessions:
            old, _ = self._sessions.popitem(last=False)
            self._control.discard(old)
            self.stats.refusals.count("session_evicted")
        self._sessions[identity] = sender
        self._sessions.move_to_end(identity)
        _remember(self._hosts, sender, _peer_address(self._frame), self._max_sessions)
        if control:
            self._control.add(identity)
        else:
            self._control.discard(identity)
        endpoint, base, nbytes = self._handler.hello_info()
        tp = getattr(self._handler, "tp_info", None)
        return HelloAck(
            compat_hash=self._hash,
            server_id=self.server_id,
            vllm_version=self.vllm_version,
            transfer_endpoint=endpoint,
            export_base_addr=base,
            export_nbytes=nbytes,
            block_size=self._compat.block_size,
            **(tp() if tp is not None else {}),
        )


class _OnceReply:
    """The ``reply`` callable handed to the handler: the first call wins."""

    __slots__ = ("_server", "_identity", "_seq", "_peer", "_used", "_lock")

    def __init__(self, server: ProtocolServer, identity: bytes, seq: int, peer: str) -> None:
        self._server, self._identity, self._seq, self._peer = server, identity, seq, peer
        self._used = False
        self._lock = threading.Lock()

    def __call__(self, msg: Message) -> None:
        if not isinstance(msg, (KVReady, Ack, Renewed, ErrorMsg)):
            raise TypeError(f"a reply must be KVReady, Ack, Renewed or ErrorMsg, not {type(msg).__name__}")
        with self._lock:
            if self._used:
                return
            self._used = True
        self._server._send(self._identity, msg, self._seq, self._peer)


def _remember(hosts: collections.OrderedDict, sender: str, addr: str | None, bound: int) -> None:
    hosts[sender] = addr
    hosts.move_to_end(sender)
    while len(hosts) > bound:
        hosts.popitem(last=False)


def _peer_address(frame) -> str | None:
    """A received frame's ``Peer-Address`` property (the sending TCP peer's IP), or None."""
    try:
        return frame.get("Peer-Address") or None
    except (zmq.ZMQError, AttributeError, TypeError):
        return None


def _zmtp_failed(server: ProtocolServer, ev: dict) -> None:
    """A peer failed the ZMTP handshake (monitor event ``ev``): counted, logged at a bounded rate."""
    server.stats.zmtp_handshake_failures += 1
    server.stats.refusals.count("zmtp_handshake")
    server._rlog(
        "zmtp",
        "protocol server %s: a peer failed the ZMTP handshake (%s, value %s): wrong "
        "or missing shared secret, or auth mode differs (this side: %s)",
        server.endpoint,
        zmq.Event(ev["event"]).name,
        ev["value"],
        server.auth,
    )
