"""The prefill endpoint of Algorithm 1 (P1-P9): leases, the ring, cancels and replies.

The engine hands over finished requests (:meth:`PrefillEndpoint.add_request`: source
block ids, token count, lease expiry). A decode's D1 ``KVRequest`` is checked (shared
bounds here, layout bounds in the :mod:`source <vllm_hawk.kvflow.sources>`), queued to
a worker thread, and answered with P7 ``KVReady``: the source plans the bytes of the
requested blocks; when it produces them into a ring range (staged gather, GN-HAWK
transform) the endpoint reserves the range first (P5). ``Release`` (D8) frees the range
(P8) and tells the engine the blocks are free (P9, ``on_finished(req_id, ok)``).

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

Only live requests' memory is registered with the transport (``registration=
"per_request"``, :mod:`~vllm_hawk.kvflow.exposure`): a ring range from P5 to P8, or for a
source served in place (GG-Direct) the request's block runs from KVReady to Release or
lease expiry (a request served by layer groups: one ring range for all its groups). A
peer's READ of anything else is refused by the transport.
``registration="whole"`` registers the ring (or the source's exports) once.

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
from dataclasses import dataclass, field

import numpy as np

from vllm_hawk.kvflow.device import memory_location
from vllm_hawk.kvflow.early import (
    EARLY_RELEASE_S,
    EARLY_REQUEST_WAIT_S,
    MAX_EARLY,
    MAX_EARLY_BLOCK_IDS,
    EarlyArrivals,
    Refusal,
)
from vllm_hawk.kvflow.errors import BufferFull, RingClosed
from vllm_hawk.kvflow.exposure import Exposure, check_registration
from vllm_hawk.kvflow.lifecycle import (
    MAX_GONE,
    RequestRecord,
    RequestTable,
    ShareRecord,
    ShareState,
    Stream,
    share_key,
)
from vllm_hawk.kvflow.ring import RingBuffer
from vllm_hawk.kvflow.sources import KVSource, src_block_span
from vllm_hawk.protocol import (
    Ack,
    CompatFields,
    ErrorMsg,
    KVReady,
    KVRequest,
    ProtocolServer,
    Release,
    Renew,
    Renewed,
)
from vllm_hawk.protocol.messages import MAX_SEGMENTS
from vllm_hawk.security import RateLimitedLog, Refusals
from vllm_hawk.transport.base import check_location

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

MAX_DST_BLOCK_ID = 1 << 24
_PENDING = frozenset({ShareState.SERVING, ShareState.CANCELLED})  # KVReady not sent yet (``pending``)


@dataclass
class PrefillStats:
    served: int = 0
    released: int = 0
    refused: int = 0
    expired: int = 0
    renewed: int = 0  # leases extended by Renew (one per id and heartbeat)
    cancelled: int = 0  # Release arrived before KVReady; the range was freed, no KVReady sent
    produce_s: dict = field(default_factory=dict)  # req_id -> seconds producing its bytes (last 1024)
    refusals: Refusals = field(default_factory=Refusals)  # refused input by reason


def _grouped(msg: KVRequest) -> bool:
    """``msg`` asks for one layer group (else for all layers, the whole request)."""
    return bool(msg.num_layers or msg.first_layer)


def _layers(msg: KVRequest) -> tuple[int, int]:
    """The layers ``lo..hi-1`` that ``msg`` asks for (a whole request: all of them)."""
    if _grouped(msg):
        return msg.first_layer, msg.first_layer + msg.num_layers
    return 0, msg.dst_layout.num_layers


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
        registration: str = "per_request",
        tp_info: dict | None = None,
    ) -> None:
        self.source, self.transport, self.compat = source, transport, compat
        self._tp_info = dict(tp_info or {})
        self.claim_wait_s, self.lease_s, self.max_hold_s = claim_wait_s, lease_s, max_hold_s
        self.handover_s = lease_s if handover_s is None else handover_s
        self.on_finished, self.observer = on_finished, observer
        self.stats = PrefillStats()
        self._lock = threading.Lock()  # guards the table, the early arrivals and the stats counters
        self._table = RequestTable()  # handed-over requests, their shares' states, finished ids
        self._early = EarlyArrivals()  # KVRequests and Releases that beat the hand-over
        self._steps = 0  # engine steps begun (engine_step), for EarlyArrivals.overdue
        self._rlog = RateLimitedLog(logger)
        self.ring: RingBuffer | None = None
        self._exported: list[int] = []
        self.registration = check_registration(registration)
        self.exposure = Exposure(transport, memory_location(source.device))  # a source served in place
        self._export_regions: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._reaper: threading.Thread | None = None
        self.server: ProtocolServer | None = None
        try:
            if source.uses_ring:
                self.ring = RingBuffer(
                    ring_nbytes, transport, registration=registration, device=ring_device(source, transport)
                )
                self.export_base, self.export_nbytes = self.ring.base_addr, self.ring.capacity
            else:
                check_location(transport, memory_location(source.device), f"transport {transport.endpoint}")
                regions = source.exports()
                self._export_regions = list(regions)
                for a, n in regions if registration == "whole" else ():
                    transport.register(a, n)
                    self._exported.append(a)
                self.export_base = min(a for a, _ in regions)
                self.export_nbytes = max(a + n for a, n in regions) - self.export_base
            self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hawk-prefill")
            self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="hawk-prefill-lease")
            self._reaper.start()
            self.server = ProtocolServer(self, compat, bind=bind, secret=secret, auth=auth, server_id=server_id or None)
        except BaseException:
            self.close()
            raise
        self.endpoint = self.server.endpoint

    # ------------------------------------------------------------------ engine side (P1-P3)
    def add_request(self, req_id: str, src_blocks, num_tokens: int, lease_expiry: float | None = None) -> None:
        """The engine finished prefill of ``req_id``: its KV is in ``src_blocks`` (cache block
        ids, in token order), held until Release or ``lease_expiry`` (unix s, the end of its
        hand-over hold; default now + ``handover_s``). KVRequests parked for it are served
        now, in arrival order (layer groups: the first one opens the stream); a Release that
        came first frees it at once."""
        src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
        bs = self.source.layout.block_size
        if num_tokens <= 0 or num_tokens > src.size * bs:
            raise ValueError(f"add_request {req_id!r}: {num_tokens} tokens do not fit {src.size} blocks of {bs}")
        if src.size and src.min() < 0:
            raise ValueError(f"add_request {req_id!r}: negative block id")
        now = time.time()
        if lease_expiry is None:
            lease_expiry = now + self.handover_s if self.lease_s else 0.0
        hold_end = now + self.max_hold_s if self.max_hold_s and lease_expiry else 0.0
        parked = None
        with self._lock:
            released_early = self._early.take_release(req_id)
            if released_early:
                self._table.forget(req_id, "released")
                self.stats.released += 1
            else:
                req = self._table.requests[req_id] = RequestRecord(src, num_tokens, lease_expiry, hold_end)
                parked = self._early.take(req_id)
                for rec in parked.shares.values() if parked is not None else ():
                    rec.move(ShareState.HELD)
                    req.shares[rec.key] = rec
        if released_early:  # the decode released it before the hand-over: free at once
            self._notify(req_id, True)
            return
        for msg, reply, peer in parked.arrivals if parked is not None else ():
            out = self.on_kv_request(peer, msg, reply)
            if out is not None:
                reply(out)

    def snapshot(self) -> dict:
        """Counters for tests and the idle check: held requests, shares with a KVReady out
        (``served_live``) or not yet (``pending``), early arrivals, ring occupancy (bytes)."""
        with self._lock:
            out = {
                "requests": len(self._table.requests),
                "served_live": self._table.kvready_out(),
                "pending": self._table.count(_PENDING),
                "early": len(self._early),
                "early_release": self._early.releases(),
                "early_block_ids": self._early.block_ids,
                "served": self.stats.served,
                "released": self.stats.released,
                "refused": self.stats.refused,
                "expired": self.stats.expired,
                "renewed": self.stats.renewed,
                "cancelled": self.stats.cancelled,
            }
        if self.ring is not None:
            out.update(
                ring_capacity=self.ring.capacity,
                ring_used=self.ring.alloc.used_bytes(),
                ring_live=len(self.ring.alloc.live()),
            )
        return out

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

    def _refuse(self, reason: str, rid: str, code: str, detail: str) -> ErrorMsg:
        self.stats.refusals.count(reason)
        self._rlog(reason, "prefill: refused input for %s (%s): %s", rid[:64], reason, detail)
        return ErrorMsg(code=code, detail=detail, req_id=rid)

    def on_kv_request(self, peer: str, msg: KVRequest, reply):
        """D1: accept ``msg`` and queue it for a worker (None: the worker replies), park it
        until the hand-over, or answer why not."""
        rid = msg.req_id
        if "\x00" in rid:
            return ErrorMsg(code="bad_message", detail="request id contains a NUL byte", req_id=rid[:256])
        with self._lock:
            req = self._table.get(rid)
            if req is None:
                return self._park_locked(peer, msg, reply)
            out = self._accept_locked(peer, msg, req)
            return out if out is not None else self._submit_serve(msg, reply)

    def _park_locked(self, peer: str, msg: KVRequest, reply):
        """A KVRequest for an id not held: join those parked for it, answer a finished id,
        or park it until the hand-over (lock held)."""
        rid = msg.req_id
        if self._early.waiting(rid):  # parked before the hand-over: further groups or shares join
            return self._refusal(rid, self._early.join(peer, msg, reply))
        gone = self._table.gone.get(rid)
        if gone is not None:
            self.stats.refused += 1
            return ErrorMsg(
                code="expired" if gone == "expired" else "unknown_request",
                detail=f"the request's blocks were {gone}",
                req_id=rid,
            )
        if self._stop.is_set():
            return ErrorMsg(code="internal", detail="prefill endpoint is closing", req_id=rid)
        out = self._refusal(rid, self._early.park(peer, msg, reply, self._steps))
        if out is None:
            logger.debug("prefill: KVRequest for %s came before the engine's hand-over; waiting", rid)
        return out

    def _refusal(self, rid: str, r: Refusal | None) -> ErrorMsg | None:
        """The ErrorMsg of an early arrival's refusal (counted when it has a reason)."""
        if r is None:
            return None
        if r.reason:
            return self._refuse(r.reason, rid, r.code, r.detail)
        return ErrorMsg(code=r.code, detail=r.detail, req_id=rid)

    def _accept_locked(self, peer: str, msg: KVRequest, req: RequestRecord) -> ErrorMsg | None:
        """Take ``msg`` for a held request (lock held): None when it is to be served."""
        rid = msg.req_id
        if not req.may_claim(peer, msg.consumers):
            return self._refuse("not_owner", rid, "unknown_request", "another decode requested this id")
        rec = req.shares.get(share_key(rid, msg.share))
        if rec is not None and rec.state is ShareState.RELEASED:
            return ErrorMsg(code="unknown_request", detail="this share was already released", req_id=rid)
        if rec is not None and rec.in_flight:
            return self._join_locked(msg, rec)
        err = self._check(msg, req) or (self._check_layers(msg) if _grouped(msg) else "") or self.source.check(msg)
        if err:
            self.stats.refused += 1
            return ErrorMsg(code="layout_mismatch", detail=err[:1000], req_id=rid)
        req.owners.add(peer)
        req.consumers = max(req.consumers, msg.consumers)
        rec = req.share(share_key(rid, msg.share))
        rec.move(ShareState.SERVING)
        rec.stream = Stream(whole=not _grouped(msg), requested={msg.first_layer}, inflight=1)
        return None

    def _join_locked(self, msg: KVRequest, rec: ShareRecord) -> ErrorMsg | None:
        """A further layer group of a share in flight (lock held): None when it is to be
        served; a repeated group, or any other KVRequest of the share, is refused."""
        st = rec.stream
        if not _grouped(msg) or st.whole or msg.first_layer in st.requested or rec.state is ShareState.CANCELLED:
            return ErrorMsg(code="bad_message", detail="request already in flight", req_id=msg.req_id)
        err = self._check_layers(msg)
        if err:
            self.stats.refused += 1
            return ErrorMsg(code="layout_mismatch", detail=err[:1000], req_id=msg.req_id)
        st.requested.add(msg.first_layer)
        st.inflight += 1
        if rec.state is ShareState.SERVED:
            rec.move(ShareState.SERVING)
        return None

    def _submit_serve(self, msg: KVRequest, reply):
        """Queue ``msg`` for a worker (lock held); undo its accept if the pool is closed."""
        try:
            self._pool.submit(self._serve, msg, reply)
        except RuntimeError:  # pool shut down
            rec = self._table.get(msg.req_id).shares[share_key(msg.req_id, msg.share)]
            rec.stream.inflight -= 1
            if rec.stream.inflight == 0:
                self._settle_locked(rec)
            return ErrorMsg(code="internal", detail="prefill endpoint is closing", req_id=msg.req_id)
        return None

    def _check_layers(self, msg: KVRequest) -> str:
        """'' when ``msg``'s layer group can be served, else why not."""
        if not self.source.caps.layer_groups:
            return f"this prefill's source ({self.source.name}) does not serve layer groups"
        L = msg.dst_layout.num_layers
        if msg.num_layers <= 0 or msg.first_layer + msg.num_layers > L:
            return f"layer group {msg.first_layer} + {msg.num_layers} is not inside the {L} layers"
        return ""

    def on_release(self, peer: str, msg: Release, reply):
        """D8: share ``msg.share`` is done (P8: its range is freed; P9 once every share is).
        While it is still being served the worker cancels it instead."""
        rid = msg.req_id
        key = share_key(rid, msg.share)
        with self._lock:
            req = self._table.get(rid)
            if req is None:
                return self._release_unheld_locked(rid)
            if req.owners and peer not in req.owners:
                # a further consumer that had nothing to pull may end its own, unclaimed share
                if not (
                    msg.share < req.consumers
                    and len(req.owners) < req.consumers
                    and req.state(key) in (None, ShareState.HELD)
                ):
                    return self._refuse(
                        "not_owner", rid, "unknown_request", "only the decode that requested this id may release it"
                    )
                req.owners.add(peer)
            rec = req.share(key)
            if rec.state in _PENDING:  # KVReady not sent yet: the worker cancels it
                if rec.state is ShareState.SERVING:
                    rec.move(ShareState.CANCELLED)
                return Ack(req_id=rid)
            served = rec.state is ShareState.SERVED
            finished, ok = self._share_done_locked(rid, req, rec, msg.ok)
        if served:
            self._free(key)  # P8
        else:
            self.exposure.release(key)
        if not msg.ok:
            logger.warning("prefill: decode reported a failed transfer of %s", rid)
        if finished:
            self._notify(rid, ok)  # P9: the blocks are free for the engine
        return Ack(req_id=rid)

    def _release_unheld_locked(self, rid: str) -> Ack | ErrorMsg:
        """A Release for an id not held: finished already, or it beat the hand-over."""
        gone = self._table.gone.get(rid)
        if gone is not None:
            return ErrorMsg(code="unknown_request", detail=f"nothing to release: already {gone}", req_id=rid)
        if self._early.remember_release(rid):
            self.stats.refusals.count("early_release_evicted")
        return Ack(req_id=rid)

    def _share_done_locked(
        self, rid: str, req: RequestRecord, rec: ShareRecord, ok: bool, count: bool = True
    ) -> tuple[bool, bool]:
        """Share ``rec`` of ``rid`` is released (lock held; ``count``: a Release, not a
        cancel). Returns (the whole request is finished and forgotten, all its shares
        succeeded)."""
        if rec.state is not ShareState.RELEASED:
            rec.move(ShareState.RELEASED)
        rec.stream = None
        req.ok = req.ok and ok
        if req.released() < req.consumers:
            return False, req.ok
        self._table.forget(rid, "released")
        self.stats.released += count
        return True, req.ok

    def on_renew(self, peer: str, msg: Renew, reply):
        """Heartbeat: renew the lease of every id in ``msg`` that is held, not yet
        requested, and unclaimed or claimed by ``peer`` (see module doc). Ids in flight
        (KVRequest accepted) are left alone: their lease runs from KVReady. Ids not held
        and not finished (the hand-over may still come) are ignored. (Control sessions
        never get here: the server refuses their Renew.)"""
        now = time.time()
        gone, renewed, strangers = [], 0, 0
        with self._lock:
            for rid in msg.req_ids:
                req = self._table.get(rid)
                if req is None:
                    if rid in self._table.gone:
                        gone.append(rid)
                    continue
                if req.owners and peer not in req.owners:
                    strangers += 1
                    continue
                renewed += self._renew_locked(req, now)
            self.stats.renewed += renewed
        if strangers:
            self._refuse(
                "not_owner",
                msg.req_ids[0],
                "unknown_request",
                f"{strangers} renewed id(s) were claimed by another decode",
            )
        return Renewed(renewed=renewed, gone=gone)

    def _renew_locked(self, req: RequestRecord, now: float) -> int:
        """Move a held, not yet requested request's expiry to ``lease_s`` from ``now``
        (never past its ``hold_end``); the first renewal ends its hand-over hold, so it may
        move the expiry earlier. 1 when it moved."""
        if not req.expiry or req.in_flight():  # in flight: its lease runs from KVReady
            return 0
        new = now + self.lease_s
        if req.hold_end:
            new = min(new, req.hold_end)
        if new <= req.expiry and not req.handover:
            return 0
        req.handover = False
        req.expiry = new
        return 1

    # ------------------------------------------------------------------ P4-P7
    def _serve(self, msg: KVRequest, reply) -> None:
        """Worker: produce and announce one layer group of a share (a whole request is the
        group of all its layers). The first group served plans and reserves the whole
        share's range (P5); each group fills its own bytes (P4 + P6) and sends its own
        KVReady (P7). On failure see :meth:`_serve_failed`."""
        key = share_key(msg.req_id, msg.share)
        with self._lock:
            req = self._table.get(msg.req_id)
            rec = req.shares.get(key) if req is not None else None
        try:
            out = self._produce(msg, req, rec)
        except Exception as e:  # noqa: BLE001 - every failure becomes a typed reply
            self._serve_failed(msg, req, rec, e, reply)
            return
        reply(out)  # P7

    def _produce(self, msg: KVRequest, req: RequestRecord | None, rec: ShareRecord | None) -> KVReady:
        """Produce ``msg``'s layer group into the share's range and mark it served; raises
        :class:`_Refuse` or :class:`_Cancelled` (or whatever the source raises)."""
        if rec is None or rec.state is ShareState.EXPIRED:
            raise _Refuse("unknown_request", "request dropped by the engine")
        self._raise_if_cancelled(rec)
        first, end, _ = src_block_span(
            msg.first_block, msg.dst_layout.block_size, msg.num_tokens, self.source.layout.block_size
        )
        src = req.src_blocks[first:end]
        st = rec.stream
        prep, off, planned = self._plan(msg, st, src, rec.key)
        if prep.nbytes:
            self._raise_if_cancelled(rec)
        if planned and self.observer is not None:
            self.observer(msg.req_id, msg, src)
        lo, hi = _layers(msg)
        if prep.nbytes:
            t0 = time.perf_counter()
            view = self.ring.view(off, prep.nbytes)
            if st.whole:
                prep.fill(self.ring.base_addr + off, view)  # P4 + P6
            else:
                prep.fill_layers(self.ring.base_addr + off, view, lo, hi)
            self.ring.synchronize()  # on a GPU: the bytes are in the ring before KVReady announces them
            self._note_produce(msg.req_id, time.perf_counter() - t0, add=not st.whole or rec.key != msg.req_id)
        segs = prep.segments(off) if st.whole else prep.segments_layers(off, lo, hi)
        if len(segs) > MAX_SEGMENTS:  # a KVReady the decode would drop: refuse now, naming why
            raise _Refuse("layout_mismatch", _too_many_segments(len(segs), self.source, msg))
        if not prep.nbytes and self.registration == "per_request":  # served in place: expose its runs
            self.exposure.acquire(
                rec.key, [(self.export_base + s.offset_bytes, s.nbytes) for s in segs], domains=self._export_regions
            )
        out = KVReady(
            req_id=msg.req_id,
            ring_offset=off,
            total_nbytes=sum(s.nbytes for s in segs),
            segments=segs,
            lease_ms=int(self.lease_s * 1000),
            chip=msg.dst_chip,
        )
        with self._lock:  # the cancel check and the move to served are one step
            self._mark_served_locked(rec)
        return out

    def _plan(self, msg: KVRequest, st: Stream, src: np.ndarray, key: str):
        """The share's plan and ring offset: made (and the range reserved, P5) by the first
        group served, shared by the others. Returns (prep, offset, made now)."""
        with st.lock:
            if st.prep is not None:
                return st.prep, max(st.offset, 0), False
            prep = self.source.prepare(msg, src, self.export_base)
            if not st.whole and (not prep.nbytes or prep.fill_layers is None):
                raise _Refuse("layout_mismatch", "this source does not serve layer groups")
            if prep.nbytes:
                st.offset = self._reserve(key, msg, prep.nbytes)  # P5
            st.prep = prep
            return prep, max(st.offset, 0), True

    def _mark_served_locked(self, rec: ShareRecord) -> None:
        """A group's KVReady goes out (lock held): the share is served once no group of it
        is in flight; ``stats.served`` counts each share once."""
        self._raise_if_cancelled_locked(rec)
        if rec.state is not ShareState.SERVING:  # expired while it was produced
            raise _Refuse("unknown_request", "request dropped by the engine")
        st = rec.stream
        st.inflight -= 1
        st.served += 1
        if st.inflight == 0:
            rec.move(ShareState.SERVED)
        rec.served_at = time.monotonic()
        if st.served == 1:
            self.stats.served += 1

    def _serve_failed(
        self, msg: KVRequest, req: RequestRecord | None, rec: ShareRecord | None, e: Exception, reply
    ) -> None:
        """A group could not be served. Not cancelled: it is refused (``stats.refused``) and
        answered ErrorMsg; once no group is in flight the share is served (some KVReady
        out) or held again, its range freed if no KVReady is out. Cancelled (Release came):
        no reply; the last group in flight frees the range and ends the share."""
        rid = msg.req_id
        finished, drop, cancelled = False, True, False
        with self._lock:
            if rec is None or rec.state is ShareState.EXPIRED:  # its request was freed meanwhile
                cancelled = rec is not None and rec.cancelled  # the decode had sent Release: no reply
                if cancelled:
                    self.stats.cancelled += 1
                else:
                    self.stats.refused += 1
                if rec is not None:
                    self._free(rec.key)  # P8
            else:
                st = rec.stream
                st.inflight -= 1
                last = st.inflight == 0
                cancelled = rec.state is ShareState.CANCELLED
                drop = last and (cancelled or st.served == 0)
                if drop:  # P8, before the share can be asked for again (a new serve reserves the same key)
                    self._free(rec.key)
                if cancelled and last:  # the decode gave up and sent Release: this share is done
                    self.stats.cancelled += 1
                    finished, _ok = self._share_done_locked(rid, req, rec, False, count=False)
                elif not cancelled:
                    self.stats.refused += 1
                    if last:
                        self._settle_locked(rec)
        if cancelled and not drop:
            return  # the last group still in flight finishes the cancel
        self._fail_reply(rid, e, cancelled, reply, finished)

    def _settle_locked(self, rec: ShareRecord) -> None:
        """No group of ``rec`` is in flight any more and it was not cancelled: served if a
        KVReady of it is out, else held again (a new KVRequest starts afresh)."""
        if rec.stream.served:
            rec.move(ShareState.SERVED)
        else:
            rec.move(ShareState.HELD)
            rec.stream = None

    def _reserve(self, key: str, msg: KVRequest, nbytes: int) -> int:
        timeout = self.claim_wait_s  # a far-future deadline must not hold the worker
        if msg.deadline_ms:
            timeout = min(timeout, max(0.0, msg.deadline_ms / 1000.0 - time.time()))
        try:
            return self.ring.reserve(key, nbytes, timeout)
        except RingClosed as e:
            raise _Refuse("internal", f"prefill endpoint is closing: {e}") from None
        except BufferFull as e:
            raise _Refuse("no_space", str(e)) from None

    def _free(self, key: str) -> None:
        """Let go of share ``key``'s ring range (if it holds one) and registrations (P8).
        Called with or without ``self._lock``: the ring and the exposure take only their own
        locks and never call back, so the lock order is always endpoint -> ring/exposure."""
        if self.ring is not None and key in self.ring.alloc.live():
            with contextlib.suppress(KeyError):  # freed by another thread meanwhile
                self.ring.release(key)
        self.exposure.release(key)

    def _fail_reply(self, rid: str, e: Exception, cancelled: bool, reply, finished: bool = False) -> None:
        if cancelled:  # no reply: nobody waits for it
            logger.warning(
                "prefill: %s released by the decode before its KVReady (%s); range freed",
                rid,
                "cancelled" if isinstance(e, _Cancelled) else f"{type(e).__name__}: {e}",
            )
            if finished:
                self._notify(rid, False)
            return
        if isinstance(e, _Refuse):
            reply(ErrorMsg(code=e.code, detail=str(e)[:1000], req_id=rid))
        else:
            logger.exception("prefill: serving %s failed", rid)
            reply(ErrorMsg(code="internal", detail=f"{type(e).__name__}: {str(e)[:900]}", req_id=rid))

    def _check(self, msg: KVRequest, req: RequestRecord) -> str:
        """'' when the request's token and block counts can be served, else why not."""
        if msg.num_tokens <= 0 or msg.num_tokens > req.num_tokens:
            return f"num_tokens {msg.num_tokens} not in [1, {req.num_tokens}] (the prefill's length)"
        n_req = -(-msg.num_tokens // msg.dst_layout.block_size)  # destination blocks (the source checks the sizes)
        ids = msg.dst_block_ids
        if not ids or msg.first_block + len(ids) != n_req:
            return (
                f"first_block {msg.first_block} + {len(ids)} destination block ids do not end the "
                f"{n_req} blocks of {msg.num_tokens} tokens (need at least one)"
            )
        if len(set(ids)) != len(ids):
            return "destination block ids must be distinct"
        if max(ids) >= MAX_DST_BLOCK_ID:
            return f"destination block id {max(ids)} >= {MAX_DST_BLOCK_ID}"
        return ""

    def _note_produce(self, rid: str, seconds: float, add: bool = False) -> None:
        """Record the seconds producing ``rid``'s bytes took (``add``: to those of its
        other groups or shares)."""
        with self._lock:
            t = self.stats.produce_s
            t[rid] = seconds + (t.get(rid, 0.0) if add else 0.0)
            if len(t) > 1024:
                t.pop(next(iter(t)))

    def produce_seconds(self, req_id: str) -> float | None:
        """Seconds producing ``req_id``'s bytes took (transform or gather; last 1024), or None."""
        with self._lock:
            return self.stats.produce_s.get(req_id)

    def _raise_if_cancelled(self, rec: ShareRecord) -> None:
        with self._lock:
            self._raise_if_cancelled_locked(rec)

    @staticmethod
    def _raise_if_cancelled_locked(rec: ShareRecord) -> None:
        if rec.state is ShareState.CANCELLED:
            raise _Cancelled()

    def _notify(self, rid: str, ok: bool) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(rid, ok)
        except Exception:  # noqa: BLE001 - the caller (server, reaper) must keep running
            logger.exception("prefill: on_finished(%s) failed", rid)

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
            dead = self._lapsed_locked(time.time(), time.monotonic())
            freed = []
            for rid in dead:
                req = self._table.requests[rid]
                freed.append((rid, {rid, *req.shares}))
                self._expire_shares_locked(req)
                self._table.forget(rid, "expired")
                self.stats.expired += 1
            late = self._early.expire(time.monotonic())
        _refuse_unknown(late)
        for rid, keys in freed:
            logger.warning("prefill: lease of %s expired without Release; freeing it", rid)
            for key in keys:
                self._free(key)
            self._notify(rid, False)  # P9: the blocks are free for the engine
        return dead

    def engine_step(self) -> None:
        """The engine began a step (the worker calls this after the step's hand-overs): early
        KVRequests whose hand-over would have come by now are answered ``unknown_request``
        (:meth:`~vllm_hawk.kvflow.early.EarlyArrivals.overdue`)."""
        with self._lock:
            self._steps += 1
            late = self._early.overdue(self._steps)
        _refuse_unknown(late)

    def _lapsed_locked(self, now: float, mono: float) -> list[str]:
        """Ids whose lease ran out (lock held): a KVReady older than ``lease_s`` without
        Release, or held past its expiry with nothing in flight."""
        served = [
            rid
            for rid, req in self._table.requests.items()
            if self.lease_s and any(s.kvready_out and mono - s.served_at > self.lease_s for s in req.shares.values())
        ]
        held = [
            rid
            for rid, req in self._table.requests.items()
            if req.expiry and now > req.expiry and not req.in_flight() and rid not in served
        ]
        return served + held

    @staticmethod
    def _expire_shares_locked(req: RequestRecord) -> None:
        """Every share of ``req`` not done yet expires (lock held)."""
        for rec in req.shares.values():
            if rec.state not in (ShareState.RELEASED, ShareState.EXPIRED):
                rec.move(ShareState.EXPIRED)

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


def _refuse_unknown(late) -> None:
    """Answer the parked KVRequests of ids never handed over."""
    for rid, parked in late:
        for _m, reply, _p in parked.arrivals:
            reply(ErrorMsg(code="unknown_request", detail="no finished prefill with this id", req_id=rid))


def ring_device(source: KVSource, transport):
    """Where the ring goes: on the source's device (the KV cache's GPU: G' stays there and
    the decode's NIC reads it with GPUDirect RDMA) when the transport reaches memory there,
    else host memory (the host-staged baselines: the gather is then the GPU -> host copy)."""
    if transport is None or transport.accepts_memory(memory_location(source.device)):
        return source.device
    logger.info(
        "prefill: the ring is in host memory: transport %s cannot reach %s memory",
        type(transport).__name__,
        memory_location(source.device),
    )
    return "cpu"


class _Cancelled(Exception):
    """Internal: the decode sent Release while the request was still being served."""


def _too_many_segments(n: int, source, msg: KVRequest) -> str:
    share = f"heads {msg.head_start}..{msg.head_start + msg.num_heads - 1} of " if msg.num_heads else ""
    return (
        f"KVReady would carry {n} segments ({share}{len(msg.dst_block_ids)} blocks served in place by "
        f"{source.name}: one per byte run per layer), the protocol allows "
        f"{MAX_SEGMENTS}; use mode staged (the ring gathers each layer into one segment), contiguous blocks, "
        "or a head-outer cache layout for shares"
    )


class _Refuse(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
