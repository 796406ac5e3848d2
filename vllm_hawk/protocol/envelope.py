"""Framing and shared-secret authentication of side-channel messages.

One message = four ZMQ frames: ``[MAGIC, header, body, mac]``.

* ``header``: msgpack ``[sender, recipient, seq, ts_ms, reply_to]``: who sends, to whom
  (the server's ``server_id``, or the client's id in replies; ``""`` only in a Hello,
  sent before the client knows the server's id), a per-sender sequence number (strictly
  increasing; starts at the sender's start time in ns so a restart never reuses one),
  the send time (unix ms) and, in replies, the ``seq`` of the request answered. A
  signed message captured at one prefill is refused by another that shares the secret
  (recipient binding).
* ``body``: one :mod:`~vllm_hawk.protocol.messages` message.
* ``mac``: empty without a secret; else HMAC-SHA256(secret, MAGIC | len(header) |
  header | body), compared in constant time. The receiver then requires ``ts_ms``
  within ``window_s`` of its clock and ``seq`` above the last one it accepted from that
  sender (replay protection); the table of senders is bounded (``max_peers``).

The MAC key is derived from the shared secret for this use only
(:func:`vllm_hawk.security.derive_key`), so the CurveZMQ keys and the host-staged
transport's key are independent of it.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import struct
import threading
import time
from collections.abc import Sequence
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from vllm_hawk.protocol.messages import U64, ErrorMsg, Message, ProtocolError, decode, encode
from vllm_hawk.security import derive_key

MAGIC = b"HAWK/9"
MAC_NBYTES = 32
DEFAULT_MAX_MESSAGE_NBYTES = 1 << 20


class Header(Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    sender: Annotated[str, Meta(min_length=1, max_length=128)]
    recipient: Annotated[str, Meta(max_length=128)]
    seq: U64
    ts_ms: U64
    reply_to: U64 = 0


class FrameError(ProtocolError):
    """Bad framing or body. ``header`` is set when the header was readable (and, with a
    secret, authenticated), so that a reply can reference it."""

    def __init__(self, msg: str, header: Header | None = None) -> None:
        super().__init__(msg)
        self.header = header


class AuthError(FrameError):
    """MAC missing or wrong, wrong recipient, stale timestamp, or replayed sequence number.
    ``header`` (UNAUTHENTICATED) is set only when the MAC was missing or wrong: the server
    may then tell the peer so, unsigned and rate-limited, without reading its body."""


class AuthMismatch(FrameError):
    """The peer signs but this side has no secret (auth 'none' here)."""


_header_decoder = msgspec.msgpack.Decoder(Header)
_encoder = msgspec.msgpack.Encoder()


class Envelope:
    """Packs and unpacks frames for one endpoint (client or server); thread-safe.

    sender: our id in headers. secret: shared key (bytes) or None for no auth.
    window_s: accepted clock skew / message age (seconds). max_peers: replay table size.
    """

    def __init__(
        self,
        sender: str,
        secret: bytes | None = None,
        *,
        window_s: float = 30.0,
        max_peers: int = 4096,
        max_message_nbytes: int = DEFAULT_MAX_MESSAGE_NBYTES,
    ) -> None:
        if not 1 <= len(sender) <= 128:
            raise ValueError(f"sender id must be 1..128 characters, got {len(sender)}")
        self.sender = sender
        self._secret = derive_key(secret, "side-channel-mac") if secret is not None else None
        self._window_ms = int(window_s * 1000)
        self._max_peers = max_peers
        self.max_message_nbytes = max_message_nbytes
        self._seq = itertools.count(time.time_ns())
        self._lock = threading.Lock()
        # sender -> (last accepted seq, its ts_ms); oldest first
        self._last: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def _mac(self, header: bytes, body: bytes) -> bytes:
        assert self._secret is not None
        m = hmac.new(self._secret, MAGIC, hashlib.sha256)
        m.update(struct.pack("<I", len(header)))
        m.update(header)
        m.update(body)
        return m.digest()

    def pack(
        self, msg: Message, reply_to: int = 0, recipient: str = "", *, sign: bool = True
    ) -> tuple[int, list[bytes]]:
        """Frames for ``msg`` to ``recipient``; returns ``(seq, frames)``. ``sign=False``
        only for the unsigned ``auth_failed`` answer to a peer we cannot authenticate."""
        seq = next(self._seq)
        header = _encoder.encode(Header(self.sender, recipient, seq, time.time_ns() // 1_000_000, reply_to))
        body = encode(msg)
        mac = self._mac(header, body) if self._secret is not None and sign else b""
        return seq, [MAGIC, header, body, mac]

    def unpack(self, frames: Sequence[bytes]) -> tuple[Header, Message]:
        """Check framing, size, authenticity, recipient and freshness, then decode the body."""
        if len(frames) != 4:
            raise FrameError(f"expected 4 frames, got {len(frames)}")
        magic, header_b, body, mac = (bytes(f) for f in frames)
        size = sum(len(f) for f in frames)
        if size > self.max_message_nbytes:
            raise FrameError(f"message of {size} bytes exceeds {self.max_message_nbytes}")
        if magic != MAGIC:
            raise FrameError("bad magic / protocol version")
        try:
            header = _header_decoder.decode(header_b)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise FrameError(f"bad header: {e}") from None
        if self._secret is not None:
            if len(mac) != MAC_NBYTES or not hmac.compare_digest(mac, self._mac(header_b, body)):
                raise AuthError(
                    "missing MAC (the peer has no shared secret)"
                    if not mac
                    else "bad MAC (the shared secrets differ, or the message was altered)",
                    header,
                )
        elif mac:
            raise AuthMismatch(
                "the peer signs its messages (it has a shared secret) but this side has auth 'none'", header
            )
        if header.recipient not in (self.sender, ""):
            raise AuthError(f"message addressed to {header.recipient[:64]!r}, not to {self.sender!r}")
        if self._secret is not None:
            self._check_fresh(header)
        try:
            msg = decode(body, self.max_message_nbytes)
        except ProtocolError as e:
            raise FrameError(str(e), header) from None
        return header, msg

    def unpack_unsigned_refusal(self, frames: Sequence[bytes]) -> tuple[Header, ErrorMsg] | None:
        """An UNSIGNED ``ErrorMsg(auth_failed)`` addressed to us (a server that cannot
        authenticate us says so), else None. Only meaningful as the answer to our Hello:
        the caller matches ``reply_to`` against a pending handshake."""
        if len(frames) != 4 or bytes(frames[0]) != MAGIC or bytes(frames[3]):
            return None
        if sum(len(f) for f in frames) > 4096:
            return None
        try:
            header = _header_decoder.decode(bytes(frames[1]))
            msg = decode(bytes(frames[2]), 4096)
        except (msgspec.DecodeError, msgspec.ValidationError, ProtocolError):
            return None
        if header.recipient != self.sender or not isinstance(msg, ErrorMsg) or msg.code != "auth_failed":
            return None
        return header, msg

    def _check_fresh(self, h: Header) -> None:
        now = time.time_ns() // 1_000_000
        if abs(now - h.ts_ms) > self._window_ms:
            raise AuthError(f"timestamp outside the {self._window_ms} ms window")
        with self._lock:
            last = self._last.get(h.sender)
            if last is not None and h.seq <= last[0]:
                raise AuthError("replayed or reordered sequence number")
            if last is None and len(self._last) >= self._max_peers:
                # Forget senders whose last message is older than the window: anything
                # they could replay is now rejected by the timestamp check.
                while self._last:
                    sender, (_s, ts) = next(iter(self._last.items()))
                    if now - ts <= self._window_ms:
                        break
                    del self._last[sender]
                if len(self._last) >= self._max_peers:
                    raise AuthError("too many active senders")
            self._last[h.sender] = (h.seq, h.ts_ms)
            self._last.move_to_end(h.sender)
