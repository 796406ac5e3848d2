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
import logging
import queue
import threading
import time
import uuid

import msgspec
import zmq

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
from vllm_hawk.protocol.zmtp_watch import ZmtpWatch
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
        self._session_epoch = 0  # the ZMTP watch's epoch our current session (HelloAck) was asked for in
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
        self._zmtp = ZmtpWatch(
            self._sock,
            endpoint=endpoint,
            auth=self.auth,
            lock=self._lock,
            rlog=self._rlog,
            in_session=lambda: self.hello is not None,
            fail_hellos=self._fail_hellos,
        )
        self._sock.connect(endpoint)
        self._wakeup = Wakeup(self._ctx, "hawk-client-wake")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"hawk-protocol-client-{endpoint}")
        self._thread.start()

    # ---------------------------------------------------------------- API
    def handshake(self, timeout_s: float | None = None) -> HelloAck:
        """Send Hello; return the server's HelloAck or raise IncompatiblePeer."""
        epoch = self._zmtp.epoch  # read before the Hello is queued: a loss after it asks for another
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
            if self._zmtp.auth_failure:
                raise AuthRefused(
                    f"side-channel handshake with {self.endpoint} failed: {self._zmtp.auth_failure}"
                ) from None
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
        return self.hello is not None and self._zmtp.epoch != self._session_epoch

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
            if hello and self._zmtp.refused:  # the refusal came before this Hello
                fut.set_exception(
                    AuthRefused(f"side-channel handshake with {self.endpoint} failed: {self._zmtp.refused}")
                )
                return fut
            if not hello and self._session_lost():  # would name a lost connection's server
                fut.set_exception(Reconnected(f"connection to {self.endpoint} lost since the last handshake"))
                return fut
            seq, frames = self._env.pack(msg, recipient="" if hello else self._server_id)
            self._pending[seq] = fut
            if hello:
                self._hellos.add(seq)
            self._outbox.put((frames, seq, None if hello else self._zmtp.epoch))
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
        poller.register(self._zmtp.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=500))
                if self._wakeup.rx in events:
                    self._wakeup.drain()
                if self._zmtp.monitor in events:
                    self._drain_monitor()
                while True:
                    try:
                        frames, seq, epoch = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if epoch is not None and epoch != self._zmtp.epoch:  # addressed to a lost connection's server
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
            self._zmtp.close(self._sock)
            self._sock.close()
            self._wakeup.close_receiver()

    def _drain_monitor(self) -> None:
        self._zmtp.drain()

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
