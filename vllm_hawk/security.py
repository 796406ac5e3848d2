"""Leaf helpers shared by the side channel and the transports (imports nothing of vllm_hawk).

* :func:`derive_key` — a purpose-bound 32-byte key from the shared secret (HMAC-SHA256
  as a KDF, one label per use), so the side-channel MAC, the CurveZMQ key pairs and the
  host-staged connection MAC never share a key.
* :func:`curve_keypairs` — the CurveZMQ server and client key pairs every holder of the
  shared secret derives alike (z85, as pyzmq wants them).
* :class:`RateLimitedLog` — logs rejected input at most ``burst`` times per ``period_s``
  per key, then once a summary of how many were suppressed.
* :class:`Refusals` — named counters of refused input (thread-safe), for stats/metrics.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import threading
import time

MIN_SECRET_NBYTES = 16


def derive_key(secret: bytes, label: str) -> bytes:
    """32 bytes bound to ``label`` (e.g. ``"side-channel-mac"``)."""
    if len(secret) < MIN_SECRET_NBYTES:
        raise ValueError(f"the shared secret must be at least {MIN_SECRET_NBYTES} bytes, got {len(secret)}")
    return hmac.new(secret, b"vllm-hawk/kdf/v1\0" + label.encode(), hashlib.sha256).digest()


def curve_keypairs(secret: bytes) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """``((server_public, server_secret), (client_public, client_secret))`` in z85.

    Both are derived from the shared secret: a decode that holds it can open the
    server's CURVE box and prove the client key; the ZAP handler admits only that client
    key, so a peer without the secret never completes the ZMTP handshake."""
    import zmq
    from zmq.utils import z85

    out = []
    for who in ("server", "client"):
        sk = z85.encode(derive_key(secret, f"curve-{who}"))
        out.append((zmq.curve_public(sk), sk))
    return out[0], out[1]


class RateLimitedLog:
    """``log(key, msg, *args)``: at most ``burst`` records per ``period_s`` per key; the
    first record after a suppressed stretch says how many were dropped. Keys are few
    (one per kind of rejection), the table is bounded by ``max_keys``."""

    def __init__(
        self,
        logger: logging.Logger,
        level: int = logging.WARNING,
        *,
        burst: int = 5,
        period_s: float = 10.0,
        max_keys: int = 64,
    ) -> None:
        self.logger, self.level, self.burst, self.period_s, self.max_keys = logger, level, burst, period_s, max_keys
        self._lock = threading.Lock()
        self._state: collections.OrderedDict[str, list] = collections.OrderedDict()  # key -> [start, n, suppressed]
        self.suppressed = 0

    def __call__(self, key: str, msg: str, *args) -> bool:
        now = time.monotonic()
        with self._lock:
            st = self._state.get(key)
            if st is None or now - st[0] >= self.period_s:
                dropped = st[2] if st else 0
                st = [now, 0, 0]
                self._state[key] = st
                self._state.move_to_end(key)
                while len(self._state) > self.max_keys:
                    self._state.popitem(last=False)
            else:
                dropped = 0
            st[1] += 1
            if st[1] > self.burst:
                st[2] += 1
                self.suppressed += 1
                return False
        if dropped:
            msg += f" ({dropped} similar messages suppressed in the last {self.period_s:.0f} s)"
        self.logger.log(self.level, msg, *args)
        return True


class Refusals:
    """Counters of refused input by reason (``count('early_full')``, ``snapshot()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: collections.Counter = collections.Counter()

    def count(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._c[reason] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def total(self) -> int:
        with self._lock:
            return sum(self._c.values())
