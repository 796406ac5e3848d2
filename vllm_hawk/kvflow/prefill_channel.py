"""The decode's side channel to one prefill: the D1 KVRequest, asked again while the
prefill's ring is full, and the D8 Releases of
:class:`~vllm_hawk.kvflow.decode.DecodeEndpoint` (see its module doc)."""

from __future__ import annotations

import logging
import threading
import time

import msgspec

from vllm_hawk.kvflow.errors import PeerFailed
from vllm_hawk.protocol import CompatFields, KVReady, KVRequest, ProtocolClient, ProtocolTimeout, RemoteError

logger = logging.getLogger("vllm.hawk.kvflow.decode")

RELEASE_TIMEOUT_S = 0.5  # Release(ok=False) on a failure path: the prefill's lease frees it anyway
NO_SPACE_BACKOFF_S = 0.05  # first wait before asking a full prefill ring again
NO_SPACE_BACKOFF_MAX_S = 0.5


class PrefillChannel:
    """A handshaken :class:`~vllm_hawk.protocol.ProtocolClient` (``client``) to the
    prefill at ``endpoint``. ``timeout_s``: its default deadline per call (seconds);
    ``handshake_timeout_s``: the first Hello's. ``backpressured`` counts KVRequests asked
    again after a ``no_space`` refusal. Thread-safe."""

    def __init__(
        self,
        endpoint: str,
        compat: CompatFields,
        *,
        secret: bytes | None,
        auth: str | None,
        timeout_s: float,
        handshake_timeout_s: float,
    ) -> None:
        self._lock = threading.Lock()
        self.backpressured = 0
        self.client = ProtocolClient(endpoint, compat, secret=secret, auth=auth, timeout_s=timeout_s)
        try:
            self.client.handshake(handshake_timeout_s)
        except Exception:
            self.client.close()
            raise

    def request_kv(self, msg: KVRequest, deadline: float) -> KVReady:
        """D1 -> P7; a ``no_space`` refusal (the prefill's ring is full) is asked again,
        backing off from :data:`NO_SPACE_BACKOFF_S` to :data:`NO_SPACE_BACKOFF_MAX_S`,
        until ``deadline`` (monotonic s)."""
        delay, refused = NO_SPACE_BACKOFF_S, None
        while True:
            try:
                return self.client.request_kv(msg, timeout_s=max(deadline - time.monotonic(), 1e-3))
            except ProtocolTimeout:
                if refused is not None:  # the last try ran into the deadline: the ring stayed full
                    raise refused from None
                raise
            except RemoteError as e:
                if e.code != "no_space" or time.monotonic() + delay >= deadline:
                    raise
                refused = e
            with self._lock:
                self.backpressured += 1
            time.sleep(delay)
            delay = min(2 * delay, NO_SPACE_BACKOFF_MAX_S)

    def ask_layers(self, fs, base: KVRequest, groups: list[tuple[int, int]]) -> list:
        """D1 for every layer group ``(lo, hi)`` of fetch ``fs`` at once (``base``: its
        whole KVRequest); the futures of their answers. PeerFailed, after a Release, if a
        lost connection's handshake again fails."""
        try:  # call_async does not handshake again itself: after a lost connection, do it now
            self.client.ensure_session(max(1e-3, fs.deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - timeout, refusal: nothing asked for yet
            self.release_quietly(fs.req_id, False, fs.share.index)  # the same Release a failed whole request sends
            raise PeerFailed(f"request {fs.req_id}: handshake with the prefill again failed: {e}", fs.req_id) from e
        return [
            self.client.call_async(msgspec.structs.replace(base, first_layer=lo, num_layers=hi - lo))
            for lo, hi in groups
        ]

    def release_quietly(self, req_id: str, ok: bool, share_index: int) -> None:
        """D8 on a failure path, within :data:`RELEASE_TIMEOUT_S`: errors are logged only."""
        try:
            self.client.release(req_id, ok=ok, timeout_s=RELEASE_TIMEOUT_S, share=share_index)
        except Exception as e:  # noqa: BLE001 - the prefill's lease frees it anyway
            logger.debug("release of %s failed: %s", req_id, e)

    def release_read(self, fs, timeout_s: float) -> None:
        """D8 once fetch ``fs`` (a ``decode._Fetch``) has its KV in place; PeerFailed if
        refused. A prefill that no longer knows the request (``unknown_request``: its
        lease ran out) may have reused the range mid-read."""
        req_id, ready = fs.req_id, fs.ready
        try:
            self.client.release(req_id, ok=True, timeout_s=timeout_s, share=fs.share.index)
        except RemoteError as e:
            if e.code == "unknown_request":
                age = time.monotonic() - fs.t_ready
                lease = (
                    f"its lease of {ready.lease_ms} ms ran out ({age:.2f} s since KVReady)"
                    if ready.lease_ms
                    else "it dropped the request"
                )
                raise PeerFailed(
                    f"request {req_id}: Release refused ({e}): {lease}, so it may have freed and "
                    f"reused the range while it was being read; the KV in destination blocks "
                    f"{[int(b) for b in fs.dst]} may be corrupt",
                    req_id,
                ) from e
            raise PeerFailed(f"request {req_id}: KV is in place but Release failed: {e}", req_id) from e
        except ProtocolTimeout as e:
            raise PeerFailed(f"request {req_id}: KV is in place but Release failed: {e}", req_id) from e
