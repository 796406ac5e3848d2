"""Decode-side side-channel client: ZMQ DEALER, request/response with timeouts.

One thread owns the socket; callers get :class:`concurrent.futures.Future` objects
(``call_async``) or block with a deadline (``call``). Replies are matched to requests
by the request's sequence number; late replies to abandoned requests are dropped.
``ErrorMsg`` replies raise :class:`RemoteError` (``code`` attribute); a refused
handshake raises :class:`IncompatiblePeer` whose message names the differing fields.

Authentication mismatches fail the handshake at once with :class:`AuthRefused`, naming
the cause, instead of a timeout: with ``curve`` the socket's monitor reports a failed
ZMTP handshake (wrong secret: the server drops the connection; a different auth mode:
mechanism mismatch); with ``hmac``/``none`` the server answers an unsigned
``ErrorMsg(auth_failed)``, accepted only as the answer to our pending Hello.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import queue
import threading
import time
import uuid

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message  # imported now: opening files may fail under fd floods

from vllm_hawk.protocol.compat import check_vllm_pair, compat_hash, engine_version, regroups
from vllm_hawk.protocol.envelope import DEFAULT_MAX_MESSAGE_NBYTES, AuthError, Envelope, FrameError
from vllm_hawk.protocol.messages import (
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
from vllm_hawk.protocol.server import resolve_auth
from vllm_hawk.protocol.wakeup import Wakeup
from vllm_hawk.protocol.zmq_context import shared_context
from vllm_hawk.security import RateLimitedLog, curve_keypairs

logger = logging.getLogger(__name__)

HANDSHAKE_REQUIRED = "handshake (Hello) required first"


class ProtocolTimeout(TimeoutError):
    """No (valid) reply within the deadline."""


class RemoteError(RuntimeError):
    """The server answered with ErrorMsg."""

    def __init__(self, msg: ErrorMsg, endpoint: str) -> None:
        super().__init__(f"{endpoint} refused: {msg.code}: {msg.detail}")
        self.code = msg.code
        self.detail = msg.detail
        self.req_id = msg.req_id


class IncompatiblePeer(RemoteError):
    """Handshake refused: ``detail`` names each differing compatibility field."""


class Reconnected(ProtocolTimeout):
    """The connection was lost (the server restarted?) since the last handshake, before
    this message went out: it was not sent (it would name the old server's id, and a new
    server drops it). Raised by :meth:`ProtocolClient.call_async`'s future, whether the
    loss was known when it was called or seen only as it was about to be sent;
    :meth:`ProtocolClient.call` handshakes again and sends it again."""


class AuthRefused(RuntimeError):
    """The handshake failed on authentication: secrets or auth modes differ (the message says which)."""


ZMTP_ATTEMPTS = 4  # connections closed during the ZMTP handshake, in a row, before a Hello fails
_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
)


class ProtocolClient:
    """Client of one prefill's :class:`~vllm_hawk.protocol.server.ProtocolServer`.

    endpoint: ZMQ endpoint of the server ("tcp://host:port"); compat: our fields, or None
    for a control peer (the proxy: handshakes with ``ControlHello``, may only Release).
    secret: shared key or None; auth: as :class:`~vllm_hawk.protocol.server.ProtocolServer`
    (must match the server's); timeout_s: default deadline per call (seconds).
    """

    def __init__(
        self,
        endpoint: str,
        compat: CompatFields | None,
        *,
        secret: bytes | None = None,
        auth: str | None = None,
        client_id: str | None = None,
        timeout_s: float = 5.0,
        window_s: float = 30.0,
        max_message_nbytes: int = DEFAULT_MAX_MESSAGE_NBYTES,
        vllm_version: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.vllm_version = engine_version() if vllm_version is None else vllm_version
        self.client_id = client_id or f"{'decode' if compat is not None else 'control'}-{uuid.uuid4().hex[:12]}"
        self.auth = resolve_auth(auth, secret)
        self._compat = compat
        self._timeout = timeout_s
        self._env = Envelope(self.client_id, secret, window_s=window_s, max_message_nbytes=max_message_nbytes)
        self._rlog = RateLimitedLog(logger)
        self.hello: HelloAck | None = None
        self._server_id = ""  # recipient of our signed messages, from HelloAck
        self._pending: dict[int, cf.Future] = {}
        self._hellos: set[int] = set()  # seqs of pending Hellos
        self._auth_failure = ""  # set by the monitor: why the ZMTP handshake failed
        self._epoch = 0  # connections lost after a handshake (the monitor counts them)
        self._session_epoch = 0  # the epoch our current session (HelloAck) was asked for in
        self._zmtp_up = False  # the current connection finished its ZMTP handshake
        self._zmtp_failures = 0  # connections in a row closed during the handshake
        self._zmtp_closed = ""  # the last handshake-failure event, for the error message
        self._zmtp_refused = False  # the handshake was refused outright (auth, mechanism)
        self._refused = ""  # why, once a refusal ended the connection for good
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ctx = shared_context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_nbytes + 4096)
        if self.auth == "curve":
            (spub, _ssec), (cpub, csec) = curve_keypairs(secret)
            self._sock.curve_serverkey = spub
            self._sock.curve_publickey, self._sock.curve_secretkey = cpub, csec
        self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
        self._sock.connect(endpoint)
        self._wakeup = Wakeup(self._ctx, "hawk-client-wake")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"hawk-protocol-client-{endpoint}")
        self._thread.start()

    # ---------------------------------------------------------------- API
    def handshake(self, timeout_s: float | None = None) -> HelloAck:
        """Send Hello; return the server's HelloAck or raise IncompatiblePeer."""
        epoch = self._epoch  # read before the Hello is queued: a loss after it asks for another
        if self._compat is None:
            msg = ControlHello(client_id=self.client_id)
        else:
            msg = Hello(
                compat=self._compat,
                compat_hash=compat_hash(self._compat),
                client_id=self.client_id,
                vllm_version=self.vllm_version,
            )
        try:
            ack = self.call(msg, timeout_s, _handshake=True)
        except RemoteError as e:
            if e.code == "layout_mismatch":
                raise IncompatiblePeer(ErrorMsg(code=e.code, detail=e.detail), self.endpoint) from None
            if e.code == "auth_failed":
                raise AuthRefused(
                    f"side-channel handshake with {self.endpoint} refused: {e.detail} (this side: auth {self.auth!r})"
                ) from None
            raise
        except ProtocolTimeout as e:
            if self._auth_failure:
                raise AuthRefused(f"side-channel handshake with {self.endpoint} failed: {self._auth_failure}") from None
            raise e
        if not isinstance(ack, HelloAck):
            raise RemoteError(
                ErrorMsg(code="bad_message", detail=f"Hello answered with {type(ack).__name__}"), self.endpoint
            )
        if self._compat is not None and not self._agrees(ack):  # the server must agree too
            raise IncompatiblePeer(
                ErrorMsg(code="layout_mismatch", detail="server acknowledged a different hash"), self.endpoint
            )
        why = check_vllm_pair(self.vllm_version, ack.vllm_version) if self._compat is not None else ""
        if why:
            raise IncompatiblePeer(ErrorMsg(code="layout_mismatch", detail=why[:1000]), self.endpoint)
        self._server_id = ack.server_id
        self._session_epoch = epoch
        self.hello = ack
        return ack

    def _agrees(self, ack: HelloAck) -> bool:
        """The server's hash is ours, or that of our fields with its ``block_size`` where
        :func:`~vllm_hawk.protocol.compat.regroups` allows the two sizes."""
        if ack.compat_hash == compat_hash(self._compat):
            return True
        prefill = msgspec.structs.replace(self._compat, block_size=ack.block_size)
        return ack.compat_hash == compat_hash(prefill) and regroups(prefill, self._compat)

    def ensure_session(self, timeout_s: float | None = None) -> None:
        """Handshake again if the connection was lost since our last handshake (the server
        restarted, or libzmq reconnected): a new connection has a new server id and no
        session for us. :meth:`call` does this itself; callers of :meth:`call_async` call it first."""
        if self._session_lost():
            self.handshake(timeout_s)

    def _session_lost(self) -> bool:
        return self.hello is not None and self._epoch != self._session_epoch

    def request_kv(self, msg: KVRequest, timeout_s: float | None = None) -> KVReady:
        """D1 -> P7. Checks that every segment lies inside the server's exported region."""
        out = self.call(msg, timeout_s)
        if not isinstance(out, KVReady) or out.req_id != msg.req_id:
            raise RemoteError(
                ErrorMsg(
                    code="bad_message", detail=f"KVRequest answered with {type(out).__name__} for another request"
                ),
                self.endpoint,
            )
        ring = self.hello.export_nbytes if self.hello else 0
        for i, s in enumerate(out.segments):
            if s.offset_bytes + s.nbytes > ring:
                raise RemoteError(
                    ErrorMsg(code="bad_message", detail=f"segment {i} lies outside the {ring}-byte exported region"),
                    self.endpoint,
                )
        return out

    def release(self, req_id: str, ok: bool = True, timeout_s: float | None = None, *, share: int = 0) -> None:
        """D8: tell the prefill to free the request's (or one share's) ring region (P8)."""
        self.call(Release(req_id=req_id, ok=ok, share=share), timeout_s)

    def renew(self, req_ids: list[str], timeout_s: float | None = None) -> Renewed:
        """Heartbeat: extend the leases of ``req_ids`` (at most ``MAX_RENEW_IDS``)."""
        out = self.call(Renew(req_ids=list(req_ids)), timeout_s)
        if not isinstance(out, Renewed):
            raise RemoteError(
                ErrorMsg(code="bad_message", detail=f"Renew answered with {type(out).__name__}"), self.endpoint
            )
        return out

    def call(self, msg: Message, timeout_s: float | None = None, *, _handshake: bool = False) -> Message:
        """Send ``msg`` and wait for its reply. After a lost connection (the server
        restarted?) it handshakes again first: the new connection has a new server id and
        no session for us, and drops messages addressed to the old one. A message that
        the loss caught before it was sent (:class:`Reconnected`) is sent again after a new
        handshake, as often as that happens; one deadline covers it all."""
        timeout = self._timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(1e-3, deadline - time.monotonic())

        while True:
            if not _handshake:
                self.ensure_session(left())
            try:
                out = self._call_once(msg, left())
                break
            except Reconnected:
                if _handshake or time.monotonic() >= deadline:
                    raise
        if isinstance(out, ErrorMsg) and out.detail == HANDSHAKE_REQUIRED and not _handshake and self.hello is not None:
            self.handshake(left())  # the server restarted or our connection was renewed
            out = self._call_once(msg, left())
        if isinstance(out, ErrorMsg):
            raise RemoteError(out, self.endpoint)
        return out

    def call_async(self, msg: Message) -> cf.Future:
        """Send ``msg``; the future resolves to the reply message (ErrorMsg included)."""
        if self._stop.is_set():
            raise RuntimeError("client is closed")
        fut: cf.Future = cf.Future()
        # Number and queue under one lock: with authentication the server drops a
        # sequence number lower than one it has seen, so messages must leave in order.
        with self._lock:
            hello = isinstance(msg, (Hello, ControlHello))
            if hello and self._refused:  # the refusal came before this Hello
                fut.set_exception(AuthRefused(f"side-channel handshake with {self.endpoint} failed: {self._refused}"))
                return fut
            if not hello and self._session_lost():  # would name a lost connection's server
                fut.set_exception(Reconnected(f"connection to {self.endpoint} lost since the last handshake"))
                return fut
            seq, frames = self._env.pack(msg, recipient="" if hello else self._server_id)
            self._pending[seq] = fut
            if hello:
                self._hellos.add(seq)
            self._outbox.put((frames, seq, None if hello else self._epoch))
        fut.add_done_callback(lambda _f, s=seq: self._forget(s))
        self._wakeup.wake()
        return fut

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wakeup.wake()
        self._thread.join(timeout=5.0)
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        self._wakeup.close_sender()
        for f in pending:
            f.cancel()

    def __enter__(self) -> ProtocolClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _call_once(self, msg: Message, timeout: float) -> Message:
        fut = self.call_async(msg)
        try:
            return fut.result(timeout)
        except Reconnected:  # a TimeoutError too (cf.TimeoutError is the builtin): not this deadline's
            raise
        except cf.TimeoutError:
            fut.cancel()
            raise ProtocolTimeout(
                f"no reply from {self.endpoint} to {type(msg).__name__} within {timeout:.3f} s"
            ) from None

    def _forget(self, seq: int) -> None:
        with self._lock:
            self._pending.pop(seq, None)
            self._hellos.discard(seq)

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
                while True:
                    try:
                        frames, seq, epoch = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if epoch is not None and epoch != self._epoch:  # addressed to a lost connection's server
                        self._fail_unsent(seq)
                        continue
                    try:
                        self._sock.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.ZMQError as e:  # not connected yet / HWM: caller times out
                        logger.debug("protocol client: send failed: %s", e)
                if self._sock in events:
                    for _ in range(256):
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close()
            self._wakeup.close_receiver()

    def _drain_monitor(self) -> None:
        for _ in range(256):
            try:
                ev = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, value = ev["event"], ev["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._auth_failure = self._zmtp_closed = self._refused = ""
                self._zmtp_up, self._zmtp_failures = True, 0
                continue
            if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the DISCONNECTED that follows decides
                self._zmtp_closed = f"{zmq.Event(kind).name}, errno {value}"
                continue
            if kind == zmq.EVENT_DISCONNECTED:
                if self.hello is not None:
                    with self._lock:  # messages queued from now on are numbered for the new epoch
                        self._epoch += 1
                if self._zmtp_up or self._zmtp_refused:  # an established connection was lost (libzmq
                    self._zmtp_up = self._zmtp_refused = False  # reconnects), or the refusal below ended it
                    continue
                self._on_handshake_closed()
                continue
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = (
                    f"the prefill's ZAP handler refused this decode's CURVE key (status {value}): the shared "
                    "secrets differ"
                )
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                why = (
                    f"ZMTP security mechanism mismatch: this decode has auth {self.auth!r} and the prefill does "
                    "not (with a shared secret both sides need the same 'auth'; without one both need "
                    "auth 'none')"
                )
            else:
                why = (
                    f"the ZMTP handshake failed ({zmq.Event(kind).name}, value {value}): the shared secrets "
                    f"or the auth modes differ (this side: auth {self.auth!r})"
                )
            self._auth_failure, self._zmtp_refused = why, True
            with self._lock:  # libzmq does not reconnect after a refusal: later Hellos fail at once
                self._refused = why
            self._rlog("zmtp", "protocol client %s: %s", self.endpoint, why)
            self._fail_hellos(why)

    def _on_handshake_closed(self) -> None:
        """A connection closed before its ZMTP handshake finished. A prefill that cannot
        open our CURVE HELLO (a different secret) closes it at once; so does one whose
        1 s ``HANDSHAKE_IVL`` ran out because it was starved of CPU (4-6 vLLM processes
        on 2 cores). libzmq reconnects, and the queued Hello goes out on the next
        connection; the pending Hellos fail after :data:`ZMTP_ATTEMPTS` such closes in a
        row (0.5 s for a wrong secret here, with libzmq's 100 ms reconnect interval)."""
        self._zmtp_failures += 1
        if self.auth == "curve":
            why = (
                "the prefill closed the connection during the CURVE handshake: the shared secrets differ, "
                "or the prefill has auth 'hmac'/'none'"
            )
        else:
            why = (
                f"the prefill closed the connection during the ZMTP handshake: the auth modes differ "
                f"(this side: auth {self.auth!r})"
            )
        why += f" ({self._zmtp_failures} connection(s) in a row; {self._zmtp_closed or 'no handshake event'})"
        self._zmtp_closed = ""
        self._auth_failure = why
        if self._zmtp_failures < ZMTP_ATTEMPTS:
            self._rlog("zmtp-retry", "protocol client %s: %s; reconnecting", self.endpoint, why)
            return
        self._rlog("zmtp", "protocol client %s: %s", self.endpoint, why)
        self._fail_hellos(why)

    def _fail_unsent(self, seq: int) -> None:
        with self._lock:
            fut = self._pending.pop(seq, None)
        if fut is not None and fut.set_running_or_notify_cancel():
            fut.set_exception(Reconnected(f"connection to {self.endpoint} lost before the message was sent"))

    def _fail_hellos(self, why: str) -> None:
        with self._lock:
            futs = [self._pending.pop(s, None) for s in self._hellos]
            self._hellos.clear()
        for f in futs:
            if f is not None and f.set_running_or_notify_cancel():
                f.set_exception(AuthRefused(f"side-channel handshake with {self.endpoint} failed: {why}"))

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            header, msg = self._env.unpack(frames)
        except FrameError as e:
            refusal = self._env.unpack_unsigned_refusal(frames) if isinstance(e, AuthError) else None
            with self._lock:
                hello = refusal is not None and refusal[0].reply_to in self._hellos
            if hello:
                self._fail_hellos(f"{refusal[1].detail} (this side: auth {self.auth!r})")
                return
            self._rlog("bad", "protocol client: dropped a bad reply from %s: %s", self.endpoint, e)
            return
        with self._lock:
            fut = self._pending.pop(header.reply_to, None)
        if fut is None:
            return  # late, unsolicited or replayed reply
        if not fut.set_running_or_notify_cancel():
            return
        fut.set_result(msg)
