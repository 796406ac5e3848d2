"""The decode's side channels: one :class:`~vllm_hawk.kvflow.DecodeEndpoint` per prefill
side channel (each prefill TP rank listens on its own), opened at the first pull, Release
or lease renewal that names it and kept until shutdown.

At most ``max_peers`` (:data:`MAX_PEERS`) are open at once: a pull to one more is refused
with :class:`~vllm_hawk.kvflow.PeerFailed` and counted (``on_refused``), so that
``kv_transfer_params`` naming ever new side channels cannot open sockets without bound.

Locking: one lock (``_lock``) guards the pool's dicts; it is held only to read or change
them, never during a handshake, a close or a callback. Handshakes with one side channel
run one at a time (its own gate, taken without ``_lock`` held): pulls that want the same
prefill at once wait for the first handshake and share its endpoint, while handshakes
with other prefills go on in parallel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vllm_hawk.kvflow import DecodeEndpoint, PeerFailed

# The worker side's log: under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk.worker")

MAX_PEERS = 64  # decode: prefill side channels kept open at once; a pull to one more is refused (counted)

__all__ = ["MAX_PEERS", "PeerPool"]


class PeerPool:
    """DecodeEndpoints by side channel (``tcp://host:port``).

    connect: ``side channel -> DecodeEndpoint`` (its handshake; raises on failure).
    on_refused: called once per pull refused at ``max_peers``.
    """

    def __init__(
        self,
        connect: Callable[[str], DecodeEndpoint],
        *,
        on_refused: Callable[[], None] = lambda: None,
        max_peers: int = MAX_PEERS,
    ) -> None:
        self._connect, self._on_refused, self.max_peers = connect, on_refused, max_peers
        self._lock = threading.Lock()
        self._peers: dict[str, DecodeEndpoint] = {}
        self._gates: dict[str, threading.Lock] = {}  # side channel -> its handshake gate
        self._engines: dict[str, str] = {}  # side channel -> remote engine id (for messages)
        self._connecting: set[str] = set()  # side channels the lease keeper is handshaking with

    def get(self, ep: str, engine_id: str) -> DecodeEndpoint:
        """The endpoint of side channel ``ep`` (prefill ``engine_id``, for messages),
        handshaking first if none is open. Raises PeerFailed when the pool is full or the
        handshake fails."""
        with self._lock:
            got = self._peers.get(ep)
            if got is not None:
                return got
            gate = self._gates.setdefault(ep, threading.Lock())
        with gate:
            with self._lock:
                got = self._peers.get(ep)
                full = got is None and len(self._peers) >= self.max_peers
            if got is not None:  # another thread's handshake finished while this one waited
                return got
            if full:
                self._on_refused()
                raise PeerFailed(
                    f"pull from prefill {engine_id} at {ep} refused: this decode already "
                    f"talks to {self.max_peers} prefills (kv_transfer_params name too many side channels)"
                )
            try:
                got = self._connect(ep)
            except Exception as e:
                raise PeerFailed(f"handshake with prefill {engine_id} at {ep} failed: {e}") from e
            with self._lock:
                self._peers[ep] = got
            return got

    def note_engine(self, ep: str, engine_id: str) -> None:
        """Remember that side channel ``ep`` is prefill ``engine_id`` (for the lease
        keeper's messages); bounded like the peers."""
        with self._lock:
            if len(self._engines) < 4 * self.max_peers:
                self._engines.setdefault(ep, engine_id)

    def for_keeper(self, ep: str) -> DecodeEndpoint:
        """The lease keeper's endpoint for side channel ``ep``. A handshake (up to the
        handshake timeout, longer for a dead prefill) runs in its own thread, so that it
        never delays the heartbeats to other prefills; until it is done this raises
        PeerFailed."""
        with self._lock:
            got = self._peers.get(ep)
            if got is not None:
                return got
            busy = ep in self._connecting
            self._connecting.add(ep)
            engine_id = self._engines.get(ep, "?")
        if not busy:
            threading.Thread(
                target=self._connect_for_keeper, args=(ep, engine_id), daemon=True, name="hawk-keeper-connect"
            ).start()
        raise PeerFailed(f"no side channel to prefill {engine_id} at {ep} yet (connecting)")

    def _connect_for_keeper(self, ep: str, engine_id: str) -> None:
        try:
            self.get(ep, engine_id)
        except Exception as e:  # noqa: BLE001 - the keeper retries at its next heartbeat
            logger.debug("HawkConnector decode: lease keeper: %s", e)
        finally:
            with self._lock:
                self._connecting.discard(ep)

    def release(self, ep: str, engine_id: str, req_id: str, *, rank: int, share, timeout_s: float) -> None:
        """Release (D8 without a fetch) ``share`` of ``req_id`` on side channel ``ep``
        (prefill TP rank ``rank``). A failure is logged, not raised: the prefill's lease
        frees the request."""
        try:
            self.get(ep, engine_id).release(req_id, ok=True, timeout_s=timeout_s, share=share)
        except Exception as e:  # noqa: BLE001 - the prefill's lease frees it
            logger.warning(
                "HawkConnector decode: release of %s on prefill rank %d not delivered (%s); the "
                "prefill frees it when its lease expires",
                req_id,
                rank,
                e,
            )

    def endpoints(self) -> list[DecodeEndpoint]:
        """The endpoints open now."""
        with self._lock:
            return list(self._peers.values())

    def close(self) -> None:
        """Close every open endpoint (the pool stays usable: a later ``get`` opens anew)."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.close()
