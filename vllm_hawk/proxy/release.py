"""The proxy's control peer at the prefills: Renew during the hand-over, Release for
requests a decode refused before its engine saw them.

Between the prefill's answer and the decode engine's first heartbeat for a request, only
the proxy holds it: in its own queue, then in the decode's API server, which under load
can take longer than the prefill's ``lease_s`` to hand it to its engine. So from the
prefill's answer until the decode answers, the proxy renews the request's lease
(:meth:`PrefillReleaser.hold`, a :class:`~vllm_hawk.protocol.leases.LeaseKeeper` every
``renew_interval_s``); the prefill answers ``gone`` once a decode has claimed it (or it is
freed), and the proxy stops. The prefill's ``max_hold_s`` bounds the hold as for a
decode's heartbeat; a proxy that dies stops renewing, and the lease frees the blocks.

When the decode's API server answers a request with an error (``max_tokens`` out of
range, a prompt longer than the decode's ``max_model_len`` ...), no decode engine ever
knows the request, so nobody would tell the prefill, which would hold its KV until its
lease ends. The proxy knows: it sends the prefill's side channel (named in the request's
``kv_transfer_params``) a ``Release`` as a control peer (``ControlHello``: no
compatibility fields, Release and Renew only), authenticated with the same shared
secret and ``auth`` as the connectors. The prefill accepts it only for a request no
decode has claimed (:mod:`vllm_hawk.kvflow.prefill`, "Ownership"), so the proxy can
never free KV a decode is reading.

One control client per prefill side channel, at most :data:`MAX_PEERS` (the oldest is
closed); the blocking side-channel calls run in a worker thread, each within
``timeout_s``. A Release that fails is logged and counted; the lease frees the blocks.
When the decode's engine did see the request (some refusals happen there) the decode
releases it itself, and the proxy's Release is answered ``unknown_request`` (counted
``already``).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading

from vllm_hawk.protocol import LeaseKeeper, ProtocolClient, RemoteError

logger = logging.getLogger(__name__)

MAX_PEERS = 64


def side_channel_of(params: dict) -> tuple[str, str] | None:
    """``(side channel endpoint, remote request id)`` from a prefill's
    ``kv_transfer_params``, or None when they do not name one."""
    host, port, rid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) \
            or not 0 < port < 65536 or not isinstance(rid, str) or not rid:
        return None
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}", rid


class PrefillReleaser:
    """Renews handed-over requests and sends ``Release`` for refused ones (see module
    doc). secret/auth: as the connectors' (``auth`` None: ``curve`` with a secret, else
    ``none``); renew_interval_s: seconds between two Renews to one prefill (keep it well
    below the prefills' ``lease_s``)."""

    def __init__(self, secret: bytes | None, auth: str | None = None, timeout_s: float = 2.0,
                 renew_interval_s: float = 1.0) -> None:
        self.secret, self.auth, self.timeout_s = secret, auth, timeout_s
        self._clients: collections.OrderedDict[str, ProtocolClient] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.released = 0
        self.already = 0  # the decode's engine saw the request and released it first
        self.failed = 0
        self.keeper = LeaseKeeper(self._client, renew_interval_s)

    def hold(self, params: dict) -> None:
        """Renew the lease of the request ``params`` names until :meth:`unhold` (or until
        its prefill answers it ``gone``: a decode claimed it)."""
        where = side_channel_of(params)
        if where is not None:
            self.keeper.want(*where)

    def unhold(self, params: dict) -> None:
        """The decode has answered the request: stop renewing it."""
        where = side_channel_of(params)
        if where is not None:
            self.keeper.drop(where[1], where[0])

    async def release(self, params: dict) -> bool:
        """Tell the prefill named in ``params`` to free the request; True when it did."""
        where = side_channel_of(params)
        if where is None:
            return False
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._release_sync, *where)
        except RemoteError as e:
            if e.code != "unknown_request":
                raise
            self.already += 1  # released (or claimed) already: nothing to do
            logger.debug("proxy: Release of %s: %s", where[1][:64], e)
            return False
        except Exception as e:  # noqa: BLE001 - the prefill's lease frees it anyway
            self.failed += 1
            logger.warning("proxy: Release of %s at %s failed (%s: %s); its lease frees it", where[1][:64],
                           where[0], type(e).__name__, e)
            return False
        self.released += 1
        return True

    def _client(self, endpoint: str) -> ProtocolClient:
        with self._lock:
            c = self._clients.get(endpoint)
            if c is not None:
                self._clients.move_to_end(endpoint)
                return c
        c = ProtocolClient(endpoint, None, secret=self.secret, auth=self.auth, timeout_s=self.timeout_s)
        try:
            c.handshake(self.timeout_s)
        except Exception:
            c.close()
            raise
        with self._lock:
            old = self._clients.pop(endpoint, None)
            self._clients[endpoint] = c
            evicted = self._clients.popitem(last=False)[1] if len(self._clients) > MAX_PEERS else None
        for x in (old, evicted):
            if x is not None:
                x.close()
        return c

    def _release_sync(self, endpoint: str, req_id: str) -> None:
        try:
            self._client(endpoint).release(req_id, ok=False, timeout_s=self.timeout_s)
        except RemoteError:
            raise  # an answer: the client is fine
        except Exception:
            with self._lock:  # a broken client is not reused
                c = self._clients.pop(endpoint, None)
            if c is not None:
                c.close()
            raise

    def close(self) -> None:
        self.keeper.close()
        with self._lock:
            clients, self._clients = list(self._clients.values()), collections.OrderedDict()
        for c in clients:
            c.close()
