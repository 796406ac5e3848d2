"""The host-staged transport's connection handshake (see the authentication paragraph of
:mod:`~vllm_hawk.transport.host_staged`).

hello  client ``<4sB3xQ32s32s>``: magic b"HKHA", flags (1 = has a secret), time (unix ms),
       nonce, MAC = HMAC-SHA256(k, "c" | time | nonce) (zeros without a secret);
answer server ``<B7x32s>``: status (``AUTH_*``), MAC = HMAC(k, "s" | nonce | time) (zeros
       without a secret).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import socket
import struct
import time

from vllm_hawk.security import Refusals
from vllm_hawk.transport.staged_wire import PeerError, recv_exact, rlog

GREET_MAGIC = b"HKHA"
HELLO = struct.Struct("<4sB3xQ32s32s")
ANSWER = struct.Struct("<B7x32s")
AUTH_WINDOW_S = 30.0
AUTH_OK, AUTH_REQUIRED, AUTH_FAILED, AUTH_NONE_HERE = 0, 1, 2, 3
_ANSWER_TEXT = {
    AUTH_REQUIRED: "requires the shared secret and this side has none (auth 'none')",
    AUTH_FAILED: "refused this side's proof of the shared secret: the secrets differ (or the clocks "
    "differ by more than 30 s)",
    AUTH_NONE_HERE: "runs without authentication (auth 'none') and this side has a shared secret: "
    "configure both sides alike",
}
FLAG_AUTH = 1


class AuthFailed(PeerError):
    """The peer could not prove the shared secret (or the auth settings differ)."""


def _mac(key: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, role + a + b, hashlib.sha256).digest()


def client_handshake(s: socket.socket, key: bytes | None, peer: str) -> None:
    """Send our hello on ``s`` and check the server's answer (and, with ``key``, its
    proof); AuthFailed names the cause."""
    ts, nonce = int(time.time() * 1000), os.urandom(32)
    flags = FLAG_AUTH if key else 0
    mac = _mac(key, b"c", ts.to_bytes(8, "little"), nonce) if key else bytes(32)
    s.sendall(HELLO.pack(GREET_MAGIC, flags, ts, nonce, mac))
    ans = bytearray(ANSWER.size)
    try:
        recv_exact(s, memoryview(ans))
    except (OSError, ConnectionError) as e:
        raise AuthFailed(
            f"{peer} closed the connection before answering ({e}): not a host-staged peer "
            "of this version, or it is overloaded"
        ) from e
    status, proof = ANSWER.unpack(ans)
    if status != AUTH_OK:
        raise AuthFailed(f"{peer} {_ANSWER_TEXT.get(status, f'answered status {status}')}")
    if key and not hmac.compare_digest(proof, _mac(key, b"s", nonce, ts.to_bytes(8, "little"))):
        raise AuthFailed(f"{peer} could not prove the shared secret: the secrets differ (or an impostor)")


class HelloCheck:
    """The server's side: checks a client's hello against ``key`` (None: no secret) and
    a replay cache of nonces; counts refusals in ``stats``. Used by one thread."""

    def __init__(self, key: bytes | None, stats: Refusals, endpoint: str) -> None:
        self._key = key
        self._stats = stats
        self._endpoint = endpoint
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # nonce -> monotonic s

    def check(self, raw: bytes) -> tuple[int, bytes]:
        """(answer status, answer MAC) for the ``HELLO.size`` bytes ``raw``."""
        magic, flags, ts, nonce, mac = HELLO.unpack(raw)
        if magic != GREET_MAGIC:
            self._stats.count("bad_hello")
            return AUTH_FAILED, bytes(32)
        if self._key is None:
            if flags & FLAG_AUTH:
                self._stats.count("auth_mismatch")
                return AUTH_NONE_HERE, bytes(32)
            return AUTH_OK, bytes(32)
        if not flags & FLAG_AUTH:
            self._stats.count("auth_missing")
            rlog("auth", "host-staged server %s: a peer without the shared secret connected", self._endpoint)
            return AUTH_REQUIRED, bytes(32)
        tsb = ts.to_bytes(8, "little")
        fresh = abs(time.time() * 1000 - ts) <= AUTH_WINDOW_S * 1000
        if not (fresh and hmac.compare_digest(mac, _mac(self._key, b"c", tsb, nonce)) and self._first_use(nonce)):
            self._stats.count("auth_failed")
            rlog(
                "auth",
                "host-staged server %s: a connection failed authentication (wrong secret, stale or replayed proof)",
                self._endpoint,
            )
            return AUTH_FAILED, bytes(32)
        return AUTH_OK, _mac(self._key, b"s", nonce, tsb)

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
            self._stats.count("replay_cache_evicted")
        seen[nonce] = now
        return True
