"""The proxy's control peer at the prefills: a Release for each request a decode refused
before its engine saw it.

When the decode's API server answers a request with an error (``max_tokens`` out of
range, a prompt longer than the decode's ``max_model_len`` ...), no decode engine ever
knows the request, so nobody would tell the prefill, which would hold its KV until its
hand-over hold (``handover_s``) ends. The proxy knows: it sends the prefill's side
channel (named in the request's ``kv_transfer_params``) a ``Release`` as a control peer
(``ControlHello``: no compatibility fields, Release only), authenticated with the same
shared secret and ``auth`` as the connectors. The prefill accepts it only for a request
no decode has claimed (:mod:`vllm_hawk.kvflow.prefill`, "Ownership"), so the proxy can
never free KV a decode is reading.

One control client per prefill side channel (every TP rank of a prefill has its own),
at most :data:`MAX_PEERS` (the oldest is closed); the blocking side-channel calls run in
a worker thread, each within ``timeout_s``. A Release that fails is logged and counted;
the hand-over hold frees the blocks. When the decode's engine did see the request (some
refusals happen there) the decode releases it itself, and the proxy's Release is
answered ``unknown_request`` (counted ``already``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from vllm_hawk.protocol import MAX_TP_RANKS, ProtocolClient, RemoteError, side_channel_endpoint

logger = logging.getLogger(__name__)

MAX_PEERS = 64
RETRY_AFTER_S = 30.0  # a side channel whose handshake failed is not tried again before this


def side_channels_of(params: dict) -> tuple[list[str], str] | None:
    """``(side channel endpoint of every prefill TP rank, remote request id)`` from a
    prefill's ``kv_transfer_params`` (:func:`~vllm_hawk.protocol.side_channel_endpoint`),
    or None when they do not name one."""
    host, port, rid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    tp, stride = params.get("remote_tp_size") or 1, params.get("remote_port_stride") or 1
    if (
        not isinstance(host, str)
        or not host
        or not isinstance(rid, str)
        or not rid
        or any(isinstance(v, bool) or not isinstance(v, int) for v in (port, tp, stride))
        or not 1 <= tp <= MAX_TP_RANKS
        or not 1 <= stride <= MAX_TP_RANKS
        or not port > 0
        or not port + (tp - 1) * stride < 65536
    ):
        return None
    return [side_channel_endpoint(host, port, r, stride) for r in range(tp)], rid


class PrefillReleaser:
    """Sends ``Release`` for refused requests to every prefill TP rank (see module doc).
    secret/auth: as the connectors' (``auth`` None: ``curve`` with a secret, else
    ``none``). A side channel whose handshake failed (wrong secret, unreachable) is left
    alone for :data:`RETRY_AFTER_S`, so a misconfigured proxy does not handshake with it at
    every refused request."""

    def __init__(self, secret: bytes | None, auth: str | None = None, timeout_s: float = 2.0) -> None:
        self.secret, self.auth, self.timeout_s = secret, auth, timeout_s
        self._clients: collections.OrderedDict[str, ProtocolClient] = collections.OrderedDict()
        self._failed_at: collections.OrderedDict[str, float] = collections.OrderedDict()  # endpoint -> monotonic s
        self._lock = threading.Lock()
        self.released = 0
        self.already = 0  # the decode's engine saw the request and released it first
        self.failed = 0

    async def release(self, params: dict) -> bool:
        """Tell every prefill rank named in ``params`` to free the request; True when one did."""
        where = side_channels_of(params)
        if where is None:
            return False
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(
            *(loop.run_in_executor(None, self._release_sync, ep, where[1]) for ep in where[0]), return_exceptions=True
        )
        freed = False
        for endpoint, out in zip(where[0], done, strict=False):
            if isinstance(out, RemoteError) and out.code == "unknown_request":
                self.already += 1  # released (or claimed) already: nothing to do
                logger.debug("proxy: Release of %s at %s: %s", where[1][:64], endpoint, out)
            elif isinstance(out, BaseException):  # the prefill's lease frees it anyway
                self.failed += 1
                logger.warning(
                    "proxy: Release of %s at %s failed (%s: %s); its lease frees it",
                    where[1][:64],
                    endpoint,
                    type(out).__name__,
                    out,
                )
            else:
                self.released += 1
                freed = True
        return freed

    def _client(self, endpoint: str) -> ProtocolClient:
        """The session with ``endpoint`` (made on first use; shared by the Release threads)."""
        with self._lock:
            c = self._clients.get(endpoint)
            if c is not None:
                self._clients.move_to_end(endpoint)
                return c
            ago = time.monotonic() - self._failed_at.get(endpoint, float("-inf"))
            if ago < RETRY_AFTER_S:
                raise ConnectionError(
                    f"no session with {endpoint}: its handshake failed {ago:.0f} s ago (wrong "
                    f"shared secret or auth, or unreachable); tried again {RETRY_AFTER_S:.0f} s "
                    "after it"
                )
        c = ProtocolClient(endpoint, None, secret=self.secret, auth=self.auth, timeout_s=self.timeout_s)
        try:
            c.handshake(self.timeout_s)
        except Exception:
            c.close()
            with self._lock:
                self._failed_at[endpoint] = time.monotonic()
                self._failed_at.move_to_end(endpoint)
                while len(self._failed_at) > MAX_PEERS:
                    self._failed_at.popitem(last=False)
            raise
        with self._lock:
            have = self._clients.get(endpoint)
            if have is None:
                self._clients[endpoint] = c
                self._failed_at.pop(endpoint, None)
                evicted = self._clients.popitem(last=False)[1] if len(self._clients) > MAX_PEERS else None
            else:  # another thread made one meanwhile: use that one, close ours
                self._clients.move_to_end(endpoint)
                evicted, c = c, have
        if evicted is not None:
            evicted.close()
        return c

    def _release_sync(self, endpoint: str, req_id: str) -> None:
        c = self._client(endpoint)
        try:
            c.release(req_id, ok=False, timeout_s=self.timeout_s)
        except RemoteError:
            raise  # an answer: the client is fine
        except Exception:
            with self._lock:  # a broken client is not reused (only this one: another may have replaced it)
                if self._clients.get(endpoint) is c:
                    del self._clients[endpoint]
                else:
                    c = None
            if c is not None:
                c.close()
            raise

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), collections.OrderedDict()
        for c in clients:
            c.close()
