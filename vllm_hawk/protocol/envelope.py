"""Framing and optional shared-secret authentication of side-channel messages.

One message = four ZMQ frames: ``[MAGIC, header, body, mac]``.

* ``header``: msgpack ``[sender, seq, ts_ms, reply_to]``: who sends, a per-sender
  sequence number (strictly increasing; starts at the sender's start time in ns so a
  restart never reuses one), the send time (unix ms) and, in replies, the ``seq`` of the
  request answered.
* ``body``: one :mod:`~vllm_hawk.protocol.messages` message.
* ``mac``: empty without a secret; else HMAC-SHA256(secret, MAGIC | len(header) |
  header | body), compared in constant time. The receiver then requires ``ts_ms``
  within ``window_s`` of its clock and ``seq`` above the last one it accepted from that
  sender (replay protection); the table of senders is bounded.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import struct
import threading
import time
from typing import Annotated, Sequence

import msgspec
from msgspec import Meta, Struct

from vllm_hawk.protocol.messages import U64, Message, ProtocolError, decode, encode

MAGIC = b"HAWK/1"
MAC_NBYTES = 32
DEFAULT_MAX_MESSAGE_NBYTES = 1 << 20


class Header(Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    sender: Annotated[str, Meta(min_length=1, max_length=128)]
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
    """MAC missing or wrong, stale timestamp, or replayed sequence number."""


_header_decoder = msgspec.msgpack.Decoder(Header)
_encoder = msgspec.msgpack.Encoder()


class Envelope:
    """Packs and unpacks frames for one endpoint (client or server); thread-safe.

    sender: our id in headers. secret: shared key (bytes) or None for no auth.
    window_s: accepted clock skew / message age (seconds). max_peers: replay table size.
    """

    def __init__(self, sender: str, secret: bytes | None = None, *, window_s: float = 30.0,
                 max_peers: int = 4096,
                 max_message_nbytes: int = DEFAULT_MAX_MESSAGE_NBYTES) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("the shared secret must be at least 16 bytes")
        if not 1 <= len(sender) <= 128:
            raise ValueError("sender id must be 1..128 characters")
        self.sender = sender
        self._secret = secret
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

    def pack(self, msg: Message, reply_to: int = 0) -> tuple[int, list[bytes]]:
        """Frames for ``msg``; returns ``(seq, frames)``."""
        seq = next(self._seq)
        header = _encoder.encode(Header(self.sender, seq, time.time_ns() // 1_000_000, reply_to))
        body = encode(msg)
        mac = self._mac(header, body) if self._secret is not None else b""
        return seq, [MAGIC, header, body, mac]

    def unpack(self, frames: Sequence[bytes]) -> tuple[Header, Message]:
        """Check framing, size, authenticity and freshness, then decode the body."""
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
                raise AuthError("bad or missing MAC")
            self._check_fresh(header)
        elif mac:
            raise FrameError("peer authenticates but this side has no shared secret", header)
        try:
            msg = decode(body, self.max_message_nbytes)
        except ProtocolError as e:
            raise FrameError(str(e), header) from None
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
