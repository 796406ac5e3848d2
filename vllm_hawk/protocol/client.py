"""Decode-side side-channel client: ZMQ DEALER, request/response with timeouts.

One thread owns the socket; callers get :class:`concurrent.futures.Future` objects
(``call_async``) or block with a deadline (``call``). Replies are matched to requests
by the request's sequence number; late replies to abandoned requests are dropped.
``ErrorMsg`` replies raise :class:`RemoteError` (``code`` attribute); a refused
handshake raises :class:`IncompatiblePeer` whose message names the differing fields.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import uuid

import zmq

from vllm_hawk.protocol.compat import compat_hash
from vllm_hawk.protocol.envelope import DEFAULT_MAX_MESSAGE_NBYTES, Envelope, FrameError
from vllm_hawk.protocol.messages import CompatFields, ErrorMsg, Hello, HelloAck, KVReady, KVRequest, Message, Release
from vllm_hawk.protocol.wakeup import Wakeup

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


class ProtocolClient:
    """Client of one prefill's :class:`~vllm_hawk.protocol.server.ProtocolServer`.

    endpoint: ZMQ endpoint of the server ("tcp://host:port"); compat: our fields.
    secret: shared key or None; timeout_s: default deadline per call (seconds).
    """

    def __init__(self, endpoint: str, compat: CompatFields, *, secret: bytes | None = None,
                 client_id: str | None = None, timeout_s: float = 5.0, window_s: float = 30.0,
                 max_message_nbytes: int = DEFAULT_MAX_MESSAGE_NBYTES) -> None:
        self.endpoint = endpoint
        self.client_id = client_id or f"decode-{uuid.uuid4().hex[:12]}"
        self._compat = compat
        self._timeout = timeout_s
        self._env = Envelope(self.client_id, secret, window_s=window_s,
                             max_message_nbytes=max_message_nbytes)
        self.hello: HelloAck | None = None
        self._pending: dict[int, cf.Future] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_nbytes + 4096)
        self._sock.connect(endpoint)
        self._wakeup = Wakeup(self._ctx, "hawk-client-wake")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"hawk-protocol-client-{endpoint}")
        self._thread.start()

    # ---------------------------------------------------------------- API
    def handshake(self, timeout_s: float | None = None) -> HelloAck:
        """Send Hello; return the server's HelloAck or raise IncompatiblePeer."""
        msg = Hello(compat=self._compat, compat_hash=compat_hash(self._compat),
                    client_id=self.client_id)
        try:
            ack = self.call(msg, timeout_s, _handshake=True)
        except RemoteError as e:
            if e.code == "layout_mismatch":
                raise IncompatiblePeer(ErrorMsg(code=e.code, detail=e.detail),
                                       self.endpoint) from None
            raise
        if not isinstance(ack, HelloAck):
            raise RemoteError(ErrorMsg(code="bad_message", detail=f"Hello answered with "
                                       f"{type(ack).__name__}"), self.endpoint)
        if ack.compat_hash != compat_hash(self._compat):  # the server must agree too
            raise IncompatiblePeer(ErrorMsg(code="layout_mismatch",
                                            detail="server acknowledged a different hash"),
                                   self.endpoint)
        self.hello = ack
        return ack

    def request_kv(self, msg: KVRequest, timeout_s: float | None = None) -> KVReady:
        """D1 -> P7. Checks that every segment lies inside the server's exported region."""
        out = self.call(msg, timeout_s)
        if not isinstance(out, KVReady) or out.req_id != msg.req_id:
            raise RemoteError(ErrorMsg(code="bad_message", detail="KVRequest answered with "
                                       f"{type(out).__name__} for another request"),
                              self.endpoint)
        ring = self.hello.export_nbytes if self.hello else 0
        for i, s in enumerate(out.segments):
            if s.offset_bytes + s.nbytes > ring:
                raise RemoteError(ErrorMsg(code="bad_message", detail=f"segment {i} lies "
                                           f"outside the {ring}-byte exported region"), self.endpoint)
        return out

    def release(self, req_id: str, ok: bool = True, timeout_s: float | None = None) -> None:
        """D8: tell the prefill to free the request's ring region (P8)."""
        self.call(Release(req_id=req_id, ok=ok), timeout_s)

    def call(self, msg: Message, timeout_s: float | None = None, *,
             _handshake: bool = False) -> Message:
        """Send ``msg`` and wait for its reply; re-handshakes once if the server lost us."""
        timeout = self._timeout if timeout_s is None else timeout_s
        out = self._call_once(msg, timeout)
        if (isinstance(out, ErrorMsg) and out.detail == HANDSHAKE_REQUIRED and not _handshake
                and self.hello is not None):
            self.handshake(timeout)  # the server restarted or our connection was renewed
            out = self._call_once(msg, timeout)
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
            seq, frames = self._env.pack(msg)
            self._pending[seq] = fut
            self._outbox.put(frames)
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

    def __enter__(self) -> "ProtocolClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _call_once(self, msg: Message, timeout: float) -> Message:
        fut = self.call_async(msg)
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            fut.cancel()
            raise ProtocolTimeout(f"no reply from {self.endpoint} to {type(msg).__name__} "
                                  f"within {timeout:.3f} s") from None

    def _forget(self, seq: int) -> None:
        with self._lock:
            self._pending.pop(seq, None)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.rx, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=500))
                if self._wakeup.rx in events:
                    self._wakeup.drain()
                while True:
                    try:
                        frames = self._outbox.get_nowait()
                    except queue.Empty:
                        break
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
            self._sock.close()
            self._wakeup.close_receiver()

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            header, msg = self._env.unpack(frames)
        except FrameError as e:
            logger.warning("protocol client: dropped a bad reply from %s: %s", self.endpoint, e)
            return
        with self._lock:
            fut = self._pending.pop(header.reply_to, None)
        if fut is None:
            return  # late, unsolicited or replayed reply
        if not fut.set_running_or_notify_cancel():
            return
        fut.set_result(msg)
