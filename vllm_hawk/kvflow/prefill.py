"""The prefill endpoint of Algorithm 1 (P1-P9): leases, the ring, cancels and replies.

Three parts: :class:`~vllm_hawk.kvflow.ledger.Ledger` decides (admission, renewal,
release, expiry, every share's state) and touches nothing;
:class:`~vllm_hawk.kvflow.prefill_serve.Producer` is the worker-thread path that
produces and announces the bytes (P4-P7) and frees ranges (P8); :class:`PrefillEndpoint`
here takes the engine's hand-overs and the side channel's messages, asks the ledger
under its lock and carries out what it decides (ring, exposure, replies, ``on_finished``).
A Release's or an expiry's ranges are freed after the lock (unregistering may take a
while on RDMA; the ledger has already retired the shares); a failed serve's with it held.
Replies and engine notifications are sent after it.

One request's life through these parts (P1-P9, by function) and the threads that run
each step: ``docs/architecture.md``.

Each share of a request (see tensor parallelism below) has one record whose state moves
only along the table of :mod:`~vllm_hawk.kvflow.lifecycle` (parked, held, serving,
served, cancelled, released, expired); messages that beat the hand-over wait in
:class:`~vllm_hawk.kvflow.early.EarlyArrivals`. A whole request is served as the layer
group of all its layers: one path reserves, produces and announces either.

Failure semantics, all here:

* a KVRequest that beats the engine's hand-over waits for it until its own deadline
  (:func:`~vllm_hawk.kvflow.early.early_wait_s`), or until :meth:`engine_step` counted
  the engine steps by which the hand-over would have come (then ``unknown_request``);
  the layer groups of one request from the same decode wait together, and are all
  served, in arrival order, once it comes;
* a Release that beats the hand-over is remembered (bounded) and finishes the request
  when it arrives; one for a request held but never requested frees it (the decode had
  the prefix locally or was aborted);
* a Release while the request is still being served cancels it: the worker frees the
  range as soon as it sees the flag (after reserving, after producing) and sends no
  KVReady;
* the hand-over hold: a request is held ``handover_s`` after the engine hands it over
  without anyone renewing it. That is the time the front (``hawk proxy``, vLLM's router,
  anything that forwards the prefill's ``kv_transfer_params``) and the decode's API
  server may take to bring it to a decode engine, whose heartbeat then takes over; the
  prefill needs nothing from the front for it (vLLM's router renews nothing);
* a held request nobody asks for is freed at its expiry (the hand-over hold, or the last
  renewal's lease): a request a decode refused before its engine saw it, or one whose
  decode died; a served range without Release ``lease_s`` after its KVReady
  (``KVReady.lease_ms``), with every other share of its request (one still being
  produced is then answered ``unknown_request``); the engine hears
  ``on_finished(req_id, False)``;
* ``Renew`` (the decode's heartbeat, one per interval for every id it still wants, e.g.
  requests waiting in its queue) ends the hand-over hold: the expiry of a held, not yet
  requested request moves to ``lease_s`` from now (earlier than the hold's end, too: from
  then on a decode that dies frees it ``lease_s`` after its last heartbeat), but never
  past ``max_hold_s`` after the hand-over: a request that never reaches a decode's engine
  is freed at the latest then (0 = no bound). Ids no longer held are answered in
  ``Renewed.gone``;
* ring space is waited for at most ``claim_wait_s`` (and the request's deadline), then
  refused with ``no_space``.

Registration (:mod:`~vllm_hawk.kvflow.exposure`): ``registration="auto"`` (default) is
``whole`` for memory on a device (a GPU ring or cache: registered once, at start) and
``per_request`` for host memory. With ``per_request`` only live requests' memory is
registered with the transport: a ring range from P5 to P8, or for a source served in
place (GG-Direct) the request's block runs from KVReady to Release or lease expiry (a
request served by layer groups: one ring range for all its groups); a peer's READ of
anything else is refused by the transport. ``whole`` registers the ring (or the
source's exports) once.

The ring (:class:`~vllm_hawk.kvflow.ring.RingBuffer`, ``ring_nbytes`` bytes) is on the
source's device when the transport reaches memory there (:func:`ring_device`), else in
host memory, pinned next to a CUDA cache (:func:`~vllm_hawk.kvflow.ring.pin_host_ring`).
A request larger than the whole ring is refused at once (``layout_mismatch``, counted
``ring_too_small``), naming its bytes and the ring's.

Tensor parallelism (:mod:`vllm_hawk.layout.tp`): a decode rank or chip that holds only
some of this rank's KV heads asks for a *share* (``KVRequest.head_start`` /
``num_heads``, numbered ``share`` of ``consumers``). Each share is produced, reserved, announced and released on its own
(ring ranges, exposure and layer-group streams are keyed by the share); the request's
blocks are freed when ``consumers`` shares (the most any KVRequest announced) have been
released, or at a lease expiry (which frees every share).

Ownership and bounds (peers are the side channel's authenticated sender ids):

* the decodes whose KVRequests for an id are accepted own it (at most ``consumers``
  peers: the decode ranks that pull shares of it); a KVRequest, Release or Renew for
  that id from any other peer is refused (``unknown_request``, counted ``not_owner``),
  so a stranger cannot free ring space a decode is still reading; before that, any
  authenticated peer may Release or Renew it (a Renew can end its hand-over hold early:
  no more than the Release it could send instead). This is what lets the proxy (a
  control peer with the shared secret, which may only Release) free a request its decode
  refused before the decode's engine saw it: an unclaimed request only, never a claimed
  one. A further consumer
  that had nothing to pull may Release its own share while fewer than ``consumers``
  peers own the id, never a share that is claimed or already released;
* early KVRequests are parked at most :data:`MAX_EARLY` at once and
  :data:`MAX_EARLY_BLOCK_IDS` destination block ids in all (about 10 MB; each parked
  KVRequest, layer groups included, counts at least one); beyond that a
  new one is refused at once (``early_full``); early Releases at most :data:`MAX_EARLY`
  (the oldest is forgotten, ``early_release_evicted``) for ``EARLY_RELEASE_S``;
* every refusal is counted in ``stats.refusals`` (with the side channel's, see
  :meth:`PrefillEndpoint.refused_input`) and logged rate-limited.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time

from vllm_hawk.kvflow.device import memory_location
from vllm_hawk.kvflow.early import EARLY_RELEASE_S, EARLY_REQUEST_WAIT_S, MAX_EARLY, MAX_EARLY_BLOCK_IDS
from vllm_hawk.kvflow.exposure import Exposure, resolve_registration
from vllm_hawk.kvflow.ledger import (
    MAX_DST_BLOCK_ID,
    NEVER_HANDED_OVER,
    Ledger,
    Notify,
    Outcome,
    PrefillStats,
    Serve,
)
from vllm_hawk.kvflow.lifecycle import MAX_GONE, Refusal, share_key
from vllm_hawk.kvflow.prefill_serve import Producer
from vllm_hawk.kvflow.ring import RingBuffer, pin_host_ring
from vllm_hawk.kvflow.sources import KVSource
from vllm_hawk.protocol import Ack, CompatFields, KVRequest, ProtocolServer, Release, Renew, Renewed
from vllm_hawk.security import RateLimitedLog
from vllm_hawk.transport.base import TransportError, check_location

__all__ = [
    "EARLY_RELEASE_S",
    "EARLY_REQUEST_WAIT_S",
    "MAX_DST_BLOCK_ID",
    "MAX_EARLY",
    "MAX_EARLY_BLOCK_IDS",
    "MAX_GONE",
    "PrefillEndpoint",
    "PrefillStats",
    "share_key",
]

logger = logging.getLogger("vllm.hawk.kvflow.prefill")


class PrefillEndpoint:
    """One prefill instance's side of Algorithm 1 (see module doc). Thread-safe.

    source: a :class:`~vllm_hawk.kvflow.sources.KVSource`; transport: a started
    transport; compat: our compatibility fields; ring_nbytes: ring size in bytes
    (sources that use one); claim_wait_s: longest wait for ring space; lease_s: how long
    the bytes of a request stay held without Release after a renewal and after its KVReady
    (0 = forever); handover_s: how long a request is held after its hand-over before any
    renewal (None = ``lease_s``); max_hold_s: renewals never hold a request longer than
    this after its hand-over (0 = no bound); on_finished(req_id, ok): the request's source blocks are free
    for the engine; observer(req_id, msg, src_blocks): called before its bytes are
    produced (debug dumps); tp_info: HelloAck's tensor-parallel fields (see
    :meth:`tp_info`). A failing ``__init__`` leaves nothing registered or running.
    """

    def __init__(
        self,
        source: KVSource,
        transport,
        compat: CompatFields,
        *,
        ring_nbytes: int = 64 << 20,
        bind: str = "tcp://127.0.0.1:0",
        secret: bytes | None = None,
        auth: str | None = None,
        claim_wait_s: float = 5.0,
        lease_s: float = 60.0,
        handover_s: float | None = None,
        max_hold_s: float = 600.0,
        workers: int = 1,
        on_finished=None,
        observer=None,
        server_id: str = "",
        registration: str = "auto",
        tp_info: dict | None = None,
    ) -> None:
        self.source, self.transport, self.compat = source, transport, compat
        self._tp_info = dict(tp_info or {})
        self.claim_wait_s, self.lease_s, self.max_hold_s = claim_wait_s, lease_s, max_hold_s
        self.handover_s = lease_s if handover_s is None else handover_s
        self.on_finished, self.observer = on_finished, observer
        self.stats = PrefillStats()
        self.ledger = Ledger(
            block_size=source.layout.block_size,
            lease_s=lease_s,
            handover_s=self.handover_s,
            max_hold_s=max_hold_s,
            check_source=source.check,
            layer_groups=source.caps.layer_groups,
            source_name=source.name,
            stats=self.stats,
        )
        self._lock = threading.Lock()  # held around every ledger call (the ledger is not thread-safe)
        self._table = self.ledger.table  # the requests and their shares' states
        self.ring: RingBuffer | None = None
        self._exported: list[int] = []
        self._registration = registration  # as given: a ring resolves "auto" for its own memory
        self.registration = resolve_registration(registration, memory_location(source.device))
        self.exposure = Exposure(transport, memory_location(source.device))  # a source served in place
        self.export_regions: list[tuple[int, int]] = []
        self._producer = Producer(self, self.ledger, self._lock, self._notify, RateLimitedLog(logger))
        self._fw_hosts: dict[str, str] = {}  # peer -> the address admitted for it (firewall)
        self._rlog = RateLimitedLog(logger)
        self._stop = threading.Event()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._reaper: threading.Thread | None = None
        self.server: ProtocolServer | None = None
        try:
            self._setup(ring_nbytes, workers, bind=bind, secret=secret, auth=auth, server_id=server_id)
        except BaseException:
            self.close()
            raise
        self.endpoint = self.server.endpoint

    def _setup(self, ring_nbytes: int, workers: int, **server) -> None:
        """The ring (or the source's exports), the workers, the lease reaper, the server."""
        source, transport, registration = self.source, self.transport, self.registration
        if source.uses_ring:
            registration = self._registration
            device = ring_device(source, transport)
            pin = pin_host_ring(device, source.device)
            self.ring = RingBuffer(ring_nbytes, transport, registration=registration, device=device, pin_memory=pin)
            self.registration = self.ring.registration  # where the ring is decides "auto"
            self.export_base, self.export_nbytes = self.ring.base_addr, self.ring.capacity
        else:
            location = memory_location(source.device)
            check_location(transport, location, f"transport {transport.endpoint}")
            regions = source.exports()
            self.export_regions = list(regions)
            for a, n in regions if registration == "whole" else ():
                transport.register(a, n, location)
                self._exported.append(a)
            self.export_base = min(a for a, _ in regions)
            self.export_nbytes = max(a + n for a, n in regions) - self.export_base
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hawk-prefill")
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="hawk-prefill-lease")
        self._reaper.start()
        server_id = server.pop("server_id") or None
        self.server = ProtocolServer(self, self.compat, server_id=server_id, **server)

    # ------------------------------------------------------------------ engine side (P1-P3)
    def add_request(self, req_id: str, src_blocks, num_tokens: int, lease_expiry: float | None = None) -> None:
        """The engine finished prefill of ``req_id``: its KV is in ``src_blocks`` (cache block
        ids, in token order), held until Release or ``lease_expiry`` (unix s, the end of its
        hand-over hold; default now + ``handover_s``). KVRequests parked for it are served
        now, in arrival order (layer groups: the first one opens the stream); a Release that
        came first frees it at once."""
        with self._lock:
            out = self.ledger.hand_over(req_id, src_blocks, num_tokens, lease_expiry, time.time())
        self._carry_out(out)
        for msg, reply, peer in out.arrivals:
            answer = self.on_kv_request(peer, msg, reply)
            if answer is not None:
                reply(answer)

    def snapshot(self) -> dict:
        """Counters for tests and the idle check: held requests, shares with a KVReady out
        (``served_live``) or not yet (``pending``), early arrivals, ring occupancy (bytes)."""
        with self._lock:
            out = self.ledger.counts()
        if self.ring is not None:
            out.update(
                ring_capacity=self.ring.capacity,
                ring_used=self.ring.alloc.used_bytes(),
                ring_live=len(self.ring.alloc.live()),
            )
        return out

    def produce_seconds(self, req_id: str) -> float | None:
        """Seconds producing ``req_id``'s bytes took (transform or gather; last 1024), or None."""
        with self._lock:
            return self.stats.produce_s.get(req_id)

    # ------------------------------------------------------------------ ProtocolHandler
    def hello_info(self) -> tuple[str, int, int]:
        return self.transport.endpoint, self.export_base, self.export_nbytes

    def tp_info(self) -> dict:
        """HelloAck's tensor-parallel fields (tp_size, tp_rank, num_kv_heads, head_start,
        num_heads); empty without TP information."""
        return dict(self._tp_info)

    def refused_input(self) -> int:
        """Side-channel input refused so far: this endpoint's refusals plus the server's."""
        n = self.stats.refusals.total()
        if self.server is not None:
            n += self.server.stats.refusals.total()
        return n

    def on_kv_request(self, peer: str, msg: KVRequest, reply):
        """D1: accept ``msg`` and queue it for a worker (None: the worker replies), park it
        until the hand-over, or answer why not."""
        with self._lock:
            out = self.ledger.admit(peer, msg, reply, closing=self._stop.is_set())
            if isinstance(out, Serve):
                self._admit(peer)  # before its KVReady: the decode READs right after
                try:
                    self._pool.submit(self._serve, msg, reply)
                    return None
                except RuntimeError:  # pool shut down
                    out = self.ledger.unqueue(msg)
        if isinstance(out, Refusal):
            return self._producer.error(msg.req_id, out)
        logger.debug("prefill: KVRequest for %s came before the engine's hand-over; waiting", msg.req_id)
        return None

    def _serve(self, msg: KVRequest, reply) -> None:
        """Worker: produce and announce one accepted layer group (P4-P7,
        :meth:`~vllm_hawk.kvflow.prefill_serve.Producer.serve`)."""
        self._producer.serve(msg, reply)

    def on_release(self, peer: str, msg: Release, reply):
        """D8: share ``msg.share`` is done (P8: its range is freed; P9 once every share is).
        While it is still being served the worker cancels it instead."""
        with self._lock:
            out = self.ledger.release(peer, msg)
        self._producer.free(out.free)  # P8, outside the lock: the share is released, never served again
        if out.refusal is not None:
            return self._producer.error(msg.req_id, out.refusal)
        if out.free and not msg.ok:  # the share is done (not cancelled, not early)
            logger.warning("prefill: decode reported a failed transfer of %s", msg.req_id)
        self._carry_out(out)  # P9: the blocks are free for the engine
        self._revoke_idle()
        return Ack(req_id=msg.req_id)

    def on_renew(self, peer: str, msg: Renew, reply):
        """Heartbeat: renew the lease of every id in ``msg`` that is held, not yet
        requested, and unclaimed or claimed by ``peer`` (see module doc). Ids in flight
        (KVRequest accepted) are left alone: their lease runs from KVReady. Ids not held
        and not finished (the hand-over may still come) are ignored. (Control sessions
        never get here: the server refuses their Renew.)"""
        now = time.time()
        with self._lock:
            out = self.ledger.renew(peer, msg.req_ids, now)
        if out.refusal is not None:
            self._producer.error(msg.req_ids[0], out.refusal)
        return Renewed(renewed=out.renewed, gone=out.gone)

    # ------------------------------------------------------------------ the engine's firewall
    def _admit(self, peer: str) -> None:
        """Open the transport's firewall (:attr:`MooncakeTransport.firewall`) to the address
        ``peer``'s authenticated side-channel connection comes from. Lock held."""
        fw = getattr(self.transport, "firewall", None)
        if fw is None:
            return
        host = self.server.peer_host(peer) if self.server is not None else None
        if host is None:
            self._rlog("fw", "prefill: no address for peer %s; its READs will be refused", peer)
            return
        try:
            fw.admit(host)
        except TransportError as e:  # nftables failed: the decode's READs will be refused
            self._rlog("fw", "prefill: %s", e)
            return
        self._fw_hosts[peer] = host

    def _revoke_idle(self) -> None:
        """Close the firewall to every admitted address whose decodes own no live request any
        more (Release, expiry): their open connections are reset. Under the lock, so that an
        admission of the same address cannot interleave."""
        fw = getattr(self.transport, "firewall", None)
        if fw is None or not self._fw_hosts:
            return
        with self._lock:
            live = self.ledger.owners()
            for p in [p for p in self._fw_hosts if p not in live]:
                del self._fw_hosts[p]
            needed = set(self._fw_hosts.values())
            for host in fw.admitted() - needed:
                fw.revoke(host)

    def _carry_out(self, out: Outcome) -> None:
        """The effects of ``out`` that run without the lock: answer the KVRequests of ids
        never handed over, tell the engine (P9)."""
        for rid, parked in out.late:
            for _m, reply, _p in parked.arrivals:
                reply(self._producer.error(rid, NEVER_HANDED_OVER))
        for n in out.notify:
            self._notify(n)

    def _notify(self, n: Notify) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(n.req_id, n.ok)
        except Exception:  # noqa: BLE001 - the caller (server, reaper) must keep running
            logger.exception("prefill: on_finished(%s) failed", n.req_id)

    # ------------------------------------------------------------------ leases and shutdown
    def _reap_loop(self) -> None:
        while not self._stop.wait(0.2):
            self.reap_expired()

    def reap_expired(self) -> list[str]:
        """Free every request whose lease ran out (held and never asked for, or a share
        served without Release: then all its shares), and answer early KVRequests whose
        hand-over never came. The engine hears ``on_finished(req_id, False)`` for each
        freed one. Returns their ids."""
        with self._lock:
            out = self.ledger.expire(time.time(), time.monotonic())
        self._producer.free(out.free)  # P8, outside the lock: the shares are expired, never served again
        for n in out.notify:
            logger.warning("prefill: lease of %s expired without Release; freeing it", n.req_id)
        self._carry_out(out)  # P9: the blocks are free for the engine
        self._revoke_idle()
        return [n.req_id for n in out.notify]

    def engine_step(self) -> None:
        """The engine began a step (the worker calls this after the step's hand-overs): early
        KVRequests whose hand-over would have come by now are answered ``unknown_request``
        (:meth:`~vllm_hawk.kvflow.early.EarlyArrivals.overdue`)."""
        with self._lock:
            out = self.ledger.step()
        self._carry_out(out)

    def close(self) -> None:
        """Stop serving; waiting reservations fail at once (ring abort), then workers drain.
        Safe on a partly constructed endpoint."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.server is not None:
            self.server.close()
        if self.ring is not None:
            self.ring.abort()  # a worker waiting for ring space must not hold up shutdown
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5.0)
        if self.ring is not None:
            self.ring.close()
        for a in self._exported:
            with contextlib.suppress(Exception):  # transport closed already
                self.transport.unregister(a)
        self._exported = []
        self.exposure.close()


def ring_beside_cache(source: KVSource, transport) -> bool:
    """The ring goes on the source's device: the transport reaches memory there."""
    return transport is None or transport.accepts_memory(memory_location(source.device))


def ring_device(source: KVSource, transport):
    """Where the ring goes: on the source's device (the KV cache's GPU: G' stays there and
    the decode's NIC reads it with GPUDirect RDMA) when the transport reaches memory there,
    else host memory (the host-staged baselines: the gather is then the GPU -> host copy)."""
    if ring_beside_cache(source, transport):
        return source.device
    logger.info(
        "prefill: the ring is in host memory: transport %s cannot reach %s memory",
        type(transport).__name__,
        memory_location(source.device),
    )
    return "cpu"
