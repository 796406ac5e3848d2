"""Prefill-side side-channel server: ZMQ ROUTER in a thread, dispatching to a handler.

The server owns the handshake (compatibility check) and the framing; the handler owns
the KV logic (P1-P9). A handler answers at once by returning a message, or later (the
KV may not be computed yet) by returning None and calling ``reply(msg)`` from any
thread. Bad input never stops the loop: malformed or oversized messages get
``ErrorMsg(bad_message)``, except that with a shared secret anything that fails
authentication (or cannot be authenticated) is dropped without a reply.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

import zmq

from vllm_hawk.protocol.compat import compat_hash, describe_diff
from vllm_hawk.protocol.envelope import DEFAULT_MAX_MESSAGE_NBYTES, AuthError, Envelope, FrameError
from vllm_hawk.protocol.messages import (
    Ack,
    CompatFields,
    ErrorMsg,
    Hello,
    HelloAck,
    KVReady,
    KVRequest,
    Message,
    Release,
)
from vllm_hawk.protocol.wakeup import Wakeup

logger = logging.getLogger(__name__)

Reply = Callable[[Message], None]


class ProtocolHandler(Protocol):
    """What the prefill side plugs into :class:`ProtocolServer`."""

    def hello_info(self) -> tuple[str, int, int]:
        """``(transfer_endpoint, export_base_addr, export_nbytes)`` for HelloAck."""

    def on_kv_request(self, peer: str, msg: KVRequest, reply: Reply) -> Message | None:
        """D1 -> P1-P7: return KVReady/ErrorMsg now, or None and call ``reply`` later."""

    def on_release(self, peer: str, msg: Release, reply: Reply) -> Message | None:
        """D8 -> P8-P9: free the ring region and blocks; return Ack or ErrorMsg."""


@dataclass
class ServerStats:
    received: int = 0
    replied: int = 0
    bad_messages: int = 0
    dropped_auth: int = 0
    handler_errors: int = 0
    handshakes_refused: int = 0
    by_type: collections.Counter = field(default_factory=collections.Counter)


class ProtocolServer:
    """ROUTER server for one prefill instance.

    bind: ZMQ endpoint, e.g. "tcp://127.0.0.1:0" (port 0 = pick one; see ``endpoint``).
    compat: our compatibility fields; secret: shared key (>= 16 bytes) or None.
    """

    def __init__(self, handler: ProtocolHandler, compat: CompatFields, *,
                 bind: str = "tcp://127.0.0.1:0", secret: bytes | None = None,
                 server_id: str | None = None, window_s: float = 30.0,
                 max_message_nbytes: int = DEFAULT_MAX_MESSAGE_NBYTES,
                 max_sessions: int = 4096) -> None:
        self._handler = handler
        self._compat = compat
        self._hash = compat_hash(compat)
        self.server_id = server_id or f"prefill-{uuid.uuid4().hex[:12]}"
        self._env = Envelope(self.server_id, secret, window_s=window_s,
                             max_message_nbytes=max_message_nbytes)
        self._max_sessions = max_sessions
        self._sessions: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.stats = ServerStats()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # zmq drops (disconnects) a peer whose message exceeds this; our check is exact.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_nbytes + 4096)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError:
            self._sock.close()  # e.g. port in use: leave nothing open behind the error
            raise
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wakeup = Wakeup(self._ctx, "hawk-server-wake")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"hawk-protocol-server-{self.endpoint}")
        self._thread.start()

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wakeup.wake()
        self._thread.join(timeout=5.0)
        self._wakeup.close_sender()

    def __enter__(self) -> "ProtocolServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- loop
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.rx, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=500))
                if self._wakeup.rx in events:
                    self._wakeup.drain()
                self._flush_outbox()
                if self._sock in events:
                    for _ in range(256):  # bounded burst, then service the outbox again
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                        self._flush_outbox()
        finally:
            self._sock.close()
            self._wakeup.close_receiver()

    def _flush_outbox(self) -> None:
        while True:
            try:
                identity, msg, reply_to = self._outbox.get_nowait()
            except queue.Empty:
                return
            _seq, frames = self._env.pack(msg, reply_to)
            try:
                self._sock.send_multipart([identity, *frames], zmq.NOBLOCK)
                self.stats.replied += 1
            except zmq.ZMQError as e:  # peer gone or its queue full: drop the reply
                logger.debug("protocol server: reply dropped: %s", e)

    def _send(self, identity: bytes, msg: Message, reply_to: int) -> None:
        self._outbox.put((identity, msg, reply_to))
        if threading.current_thread() is not self._thread:
            self._wakeup.wake()

    def _on_frames(self, frames: list[bytes]) -> None:
        self.stats.received += 1
        if len(frames) < 2:
            return
        identity, payload = frames[0], frames[1:]
        try:
            header, msg = self._env.unpack(payload)
        except AuthError as e:
            self.stats.dropped_auth += 1
            logger.warning("protocol server: dropped unauthenticated message: %s", e)
            return
        except FrameError as e:
            self.stats.bad_messages += 1
            if self._env.authenticated and e.header is None:
                self.stats.dropped_auth += 1
                return  # cannot be authenticated: drop silently
            self._send(identity, ErrorMsg(code="bad_message", detail=str(e)[:1000]),
                       e.header.seq if e.header else 0)
            return
        self.stats.by_type[type(msg).__name__] += 1
        seq = header.seq
        try:
            if isinstance(msg, Hello):
                self._send(identity, self._on_hello(identity, header.sender, msg), seq)
                return
            peer = self._sessions.get(identity)
            if peer is None:
                self._send(identity, ErrorMsg(code="bad_message", detail="handshake (Hello) "
                                              "required first"), seq)
                return
            self._sessions.move_to_end(identity)
            reply = _OnceReply(self, identity, seq, getattr(msg, "req_id", ""))
            if isinstance(msg, KVRequest):
                out = self._handler.on_kv_request(peer, msg, reply)
            elif isinstance(msg, Release):
                out = self._handler.on_release(peer, msg, reply)
            else:
                self.stats.bad_messages += 1
                out = ErrorMsg(code="bad_message",
                               detail=f"{type(msg).__name__} is not a request")
            if out is not None:
                reply(out)
        except Exception as e:  # noqa: BLE001 - a handler bug must not kill the server
            self.stats.handler_errors += 1
            logger.exception("protocol server: handler failed")
            self._send(identity, ErrorMsg(code="internal", detail=f"{type(e).__name__}: "
                                          f"{str(e)[:500]}", req_id=getattr(msg, "req_id", "")),
                       seq)

    def _on_hello(self, identity: bytes, sender: str, msg: Hello) -> Message:
        theirs = msg.compat
        if compat_hash(theirs) != msg.compat_hash:
            self.stats.bad_messages += 1
            return ErrorMsg(code="bad_message", detail="compat_hash does not match the fields")
        if msg.compat_hash != self._hash:
            self.stats.handshakes_refused += 1
            return ErrorMsg(code="layout_mismatch",
                            detail="incompatible peer: " + describe_diff(self._compat, theirs))
        if identity not in self._sessions and len(self._sessions) >= self._max_sessions:
            self._sessions.popitem(last=False)
        self._sessions[identity] = msg.client_id or sender
        endpoint, base, nbytes = self._handler.hello_info()
        return HelloAck(compat_hash=self._hash, server_id=self.server_id,
                        transfer_endpoint=endpoint, export_base_addr=base, export_nbytes=nbytes)


class _OnceReply:
    """The ``reply`` callable handed to the handler: the first call wins."""

    __slots__ = ("_server", "_identity", "_seq", "_req_id", "_used", "_lock")

    def __init__(self, server: ProtocolServer, identity: bytes, seq: int, req_id: str) -> None:
        self._server, self._identity, self._seq, self._req_id = server, identity, seq, req_id
        self._used = False
        self._lock = threading.Lock()

    def __call__(self, msg: Message) -> None:
        if not isinstance(msg, (KVReady, Ack, ErrorMsg)):
            raise TypeError(f"a reply must be KVReady, Ack or ErrorMsg, not {type(msg).__name__}")
        with self._lock:
            if self._used:
                return
            self._used = True
        self._server._send(self._identity, msg, self._seq)
