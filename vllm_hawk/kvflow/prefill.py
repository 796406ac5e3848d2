"""The prefill endpoint of Algorithm 1 (P1-P9): leases, the ring, cancels and replies.

The engine hands over finished requests (:meth:`PrefillEndpoint.add_request`: source
block ids, token count, lease expiry). A decode's D1 ``KVRequest`` is checked (shared
bounds here, layout bounds in the :mod:`source <vllm_hawk.kvflow.sources>`), queued to
a worker thread, and answered with P7 ``KVReady``: the source plans the bytes of the
requested blocks; when it produces them into a ring range (staged gather, GN-HAWK
transform) the endpoint reserves the range first (P5). ``Release`` (D8) frees the range
(P8) and tells the engine the blocks are free (P9, ``on_finished(req_id, ok)``).

Failure semantics, all here:

* a KVRequest that beats the engine's hand-over waits up to :data:`EARLY_REQUEST_WAIT_S`
  (the layer groups of one request from the same decode wait together, and are all
  served, in arrival order, once it comes);
* a Release that beats the hand-over is remembered (bounded) and finishes the request
  when it arrives; one for a request held but never requested frees it (the decode had
  the prefix locally or was aborted);
* a Release while the request is still being served cancels it: the worker frees the
  range as soon as it sees the flag (after reserving, after producing) and sends no
  KVReady;
* a held request nobody asks for is freed at its lease expiry; a served range without
  Release ``lease_s`` after its KVReady (``KVReady.lease_ms``); the engine hears
  ``on_finished(req_id, False)``;
* ``Renew`` (the decode's heartbeat, one per interval for every id it still wants, e.g.
  requests waiting in its queue) moves a held, not yet requested request's expiry to
  ``lease_s`` from now, but never past ``max_hold_s`` after the hand-over: a request
  that never reaches a decode's engine is freed at the latest then (0 = no bound). Ids
  no longer held are answered in ``Renewed.gone``. The proxy, a control peer, renews a
  request while it hands it to a decode (its API server, then its engine, may keep it
  longer than the lease under load); once a decode has claimed it, the proxy's Renew is
  answered ``gone`` for it, since the claim's own lease (from KVReady) governs it then;
* ring space is waited for at most ``claim_wait_s`` (and the request's deadline), then
  refused with ``no_space``.

Only live requests' memory is registered with the transport (``registration=
"per_request"``, :mod:`~vllm_hawk.kvflow.exposure`): a ring range from P5 to P8, or for a
source served in place (GG-Direct) the request's block runs from KVReady to Release or
lease expiry (a request served by layer groups: one ring range for all its groups). A
peer's READ of anything else is refused by the transport.
``registration="whole"`` registers the ring (or the source's exports) once, as before.

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
  authenticated peer may Release or Renew it. This is what lets the proxy (a control
  peer with the shared secret) free a request its decode refused before the decode's
  engine saw it: an unclaimed request only, never a claimed one. A further consumer
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

import collections
import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from vllm_hawk.kvflow.errors import BufferFull, RingClosed
from vllm_hawk.kvflow.exposure import Exposure, check_registration
from vllm_hawk.kvflow.ring import RingBuffer
from vllm_hawk.kvflow.sources import KVSource
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

logger = logging.getLogger("vllm.hawk.kvflow.prefill")

EARLY_REQUEST_WAIT_S = 3.0  # a KVRequest may beat the engine's hand-over by this much
EARLY_RELEASE_S = 10.0  # a Release may beat the hand-over by this much
MAX_EARLY = 1024  # early KVRequests / Releases remembered at once
MAX_EARLY_BLOCK_IDS = 1 << 18  # destination block ids of all parked early KVRequests together
MAX_GONE = 4096  # finished ids remembered to answer late messages precisely
MAX_DST_BLOCK_ID = 1 << 24


def share_key(req_id: str, share: int = 0) -> str:
    """The key of share ``share`` of a request (share 0, also the whole request: the id)."""
    return req_id if not share else f"{req_id}\x00s{share}"


@dataclass
class _Req:
    src_blocks: np.ndarray
    num_tokens: int
    expiry: float  # unix s; 0 = never (until Release)
    hold_end: float = 0.0  # unix s: renewals never move expiry past this; 0 = unbounded
    owners: set = field(default_factory=set)  # peers whose KVRequests were accepted; empty = nobody yet
    consumers: int = 1  # shares to release before the blocks are free (the most any KVRequest said)
    shares: set = field(default_factory=set)  # share keys pending or served (hold ring / exposure state)
    done: set = field(default_factory=set)  # share keys released
    ok: bool = True  # every released share reported success

    def may_claim(self, peer: str, consumers: int) -> bool:
        return peer in self.owners or len(self.owners) < max(self.consumers, consumers)


@dataclass
class _Stream:
    """A request served by layer groups: its bytes are planned and reserved once (by the
    first group served), each group is produced and announced on its own."""

    requested: set = field(default_factory=set)  # first_layer of every group asked for
    inflight: int = 0  # groups queued or being served
    served: int = 0  # groups whose KVReady went out
    prep: object = None
    offset: int = -1  # ring offset once reserved
    lock: threading.Lock = field(default_factory=threading.Lock)


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


class PrefillEndpoint:
    """One prefill instance's side of Algorithm 1 (see module doc). Thread-safe.

    source: a :class:`~vllm_hawk.kvflow.sources.KVSource`; transport: a started
    transport; compat: our compatibility fields; ring_nbytes: ring size in bytes
    (sources that use one); claim_wait_s: longest wait for ring space; lease_s: how long
    the bytes of a request stay held without Release (from hand-over, and again from
    KVReady; 0 = forever); max_hold_s: renewals never hold a request longer than this after
    its hand-over (0 = no bound); on_finished(req_id, ok): the request's source blocks are free
    for the engine; observer(req_id, msg, src_blocks): called before its bytes are
    produced (debug dumps); tp_info: HelloAck's tensor-parallel fields (see
    :meth:`tp_info`). A failing ``__init__`` leaves nothing registered or running.
    """

    def __init__(self, source: KVSource, transport, compat: CompatFields, *, ring_nbytes: int = 64 << 20,
                 bind: str = "tcp://127.0.0.1:0", secret: bytes | None = None, auth: str | None = None,
                 claim_wait_s: float = 5.0,
                 lease_s: float = 60.0, max_hold_s: float = 600.0, workers: int = 1, on_finished=None, observer=None,
                 server_id: str = "", registration: str = "per_request", tp_info: dict | None = None) -> None:
        self.source, self.transport, self.compat = source, transport, compat
        self._tp_info = dict(tp_info or {})
        self.claim_wait_s, self.lease_s, self.max_hold_s = claim_wait_s, lease_s, max_hold_s
        self.on_finished, self.observer = on_finished, observer
        self.stats = PrefillStats()
        self._lock = threading.Lock()
        self._requests: dict[str, _Req] = {}
        self._served: dict[str, tuple[float, str]] = {}  # share key -> (monotonic time of its KVReady, req_id)
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()  # pending requests whose decode already sent Release
        # rid -> ([(msg, reply, peer)], until): parked KVRequests (several: layer groups, shares)
        self._early: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._early_ids = 0  # destination block ids held by _early
        self._early_release: collections.OrderedDict[str, float] = collections.OrderedDict()  # rid -> until
        self._rlog = RateLimitedLog(logger)
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # rid -> "released"|"expired"
        self._streams: dict[str, _Stream] = {}  # share key -> its layer-group stream
        self.ring: RingBuffer | None = None
        self._exported: list[int] = []
        self.registration = check_registration(registration)
        self.exposure = Exposure(transport)  # per-request registrations of a source served in place
        self._export_regions: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._reaper: threading.Thread | None = None
        self.server: ProtocolServer | None = None
        try:
            if source.uses_ring:
                self.ring = RingBuffer(ring_nbytes, transport, registration=registration)
                self.export_base, self.export_nbytes = self.ring.base_addr, self.ring.capacity
            else:
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
            self.server = ProtocolServer(self, compat, bind=bind, secret=secret, auth=auth,
                                         server_id=server_id or None)
        except BaseException:
            self.close()
            raise
        self.endpoint = self.server.endpoint

    # ------------------------------------------------------------------ engine side (P1-P3)
    def add_request(self, req_id: str, src_blocks, num_tokens: int, lease_expiry: float | None = None) -> None:
        """The engine finished prefill of ``req_id``: its KV is in ``src_blocks`` (cache block
        ids, in token order), held until Release or ``lease_expiry`` (unix s; default now +
        ``lease_s``)."""
        src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
        bs = self.compat.block_size
        if num_tokens <= 0 or num_tokens > src.size * bs:
            raise ValueError(f"add_request {req_id!r}: {num_tokens} tokens do not fit {src.size} blocks of {bs}")
        if src.size and src.min() < 0:
            raise ValueError(f"add_request {req_id!r}: negative block id")
        now = time.time()
        if lease_expiry is None:
            lease_expiry = now + self.lease_s if self.lease_s else 0.0
        hold_end = now + self.max_hold_s if self.max_hold_s and lease_expiry else 0.0
        serve = None
        with self._lock:
            if self._early_release.pop(req_id, None) is not None:
                self._remember_gone_locked(req_id, "released")
                self.stats.released += 1
                early_release = True
            else:
                early_release = False
                self._requests[req_id] = _Req(src, num_tokens, lease_expiry, hold_end)
                serve = self._early.pop(req_id, None)
        if early_release:  # the decode released it before the hand-over: free at once
            self._notify(req_id, True)
        elif serve is not None:
            pairs, _until = serve
            with self._lock:
                self._early_ids -= sum(max(1, len(m.dst_block_ids)) for m, _r, _p in pairs)
            for msg, reply, peer in pairs:  # in arrival order (layer groups: the first one opens the stream)
                out = self.on_kv_request(peer, msg, reply)
                if out is not None:
                    reply(out)

    def drop_request(self, req_id: str) -> None:
        with self._lock:
            self._requests.pop(req_id, None)

    def snapshot(self) -> dict:
        """Counters for tests and the idle check: held requests, ring occupancy (bytes)."""
        with self._lock:
            out = {"requests": len(self._requests), "served_live": len(self._served),
                   "pending": len(self._pending), "early": len(self._early),
                   "early_release": len(self._early_release), "early_block_ids": self._early_ids,
                   "served": self.stats.served,
                   "released": self.stats.released, "refused": self.stats.refused,
                   "expired": self.stats.expired, "renewed": self.stats.renewed,
                   "cancelled": self.stats.cancelled}
        if self.ring is not None:
            out.update(ring_capacity=self.ring.capacity, ring_used=self.ring.alloc.used_bytes(),
                       ring_live=len(self.ring.alloc.live()))
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
        rid = msg.req_id
        key = share_key(rid, msg.share)
        grouped = bool(msg.num_layers or msg.first_layer)
        if "\x00" in rid:
            return ErrorMsg(code="bad_message", detail="request id contains a NUL byte", req_id=rid[:256])
        with self._lock:
            req = self._requests.get(rid)
            if req is not None and not req.may_claim(peer, msg.consumers):
                return self._refuse("not_owner", rid, "unknown_request", "another decode requested this id")
            if req is not None and key in req.done:
                return ErrorMsg(code="unknown_request", detail="this share was already released", req_id=rid)
            st = self._streams.get(key)
            if key in self._pending or key in self._served:
                if not grouped or st is None or msg.first_layer in st.requested or key in self._cancelled:
                    return ErrorMsg(code="bad_message", detail="request already in flight", req_id=rid)
                err = self._check_layers(msg)
                if err:
                    self.stats.refused += 1
                    return ErrorMsg(code="layout_mismatch", detail=err[:1000], req_id=rid)
                st.requested.add(msg.first_layer)  # a further layer group of a request being served
                st.inflight += 1
                self._pending.add(key)
                return self._submit_serve(msg, reply)
            early = self._early.get(rid)
            if early is not None:  # parked before the hand-over: further groups or shares join
                pairs, _until = early
                same = [(m, p) for m, _r, p in pairs if share_key(rid, m.share) == key]
                if same and (not grouped or same[0][1] != peer or not same[0][0].num_layers
                             or any(m.first_layer == msg.first_layer for m, _p in same)):
                    return ErrorMsg(code="bad_message", detail="request already in flight", req_id=rid)
                if not same and len({p for _m, _r, p in pairs} | {peer}) > max(m.consumers for m, _r, _p in pairs):
                    return self._refuse("not_owner", rid, "unknown_request", "another decode requested this id")
                n_ids = max(1, len(msg.dst_block_ids))
                if self._early_ids + n_ids > MAX_EARLY_BLOCK_IDS:
                    return self._refuse("early_full", rid, "unknown_request",
                                        f"no finished prefill with this id, and early requests already hold "
                                        f"{self._early_ids} block ids")
                pairs.append((msg, reply, peer))
                self._early_ids += n_ids
                return None
            if req is None:
                gone = self._gone.get(rid)
                if gone is not None:
                    self.stats.refused += 1
                    return ErrorMsg(code="expired" if gone == "expired" else "unknown_request",
                                    detail=f"the request's blocks were {gone}", req_id=rid)
                if self._stop.is_set():
                    return ErrorMsg(code="internal", detail="prefill endpoint is closing", req_id=rid)
                n_ids = max(1, len(msg.dst_block_ids))
                if len(self._early) >= MAX_EARLY or self._early_ids + n_ids > MAX_EARLY_BLOCK_IDS:
                    return self._refuse("early_full", rid, "unknown_request",
                                        f"no finished prefill with this id, and {len(self._early)} early requests "
                                        f"({self._early_ids} block ids) already wait for theirs")
                # (KVRequest, reply, peer) triples (several: layer groups, shares), until
                self._early[rid] = ([(msg, reply, peer)], time.monotonic() + EARLY_REQUEST_WAIT_S)
                self._early_ids += n_ids
                logger.debug("prefill: KVRequest for %s came before the engine's hand-over; waiting", rid)
            else:
                err = self._check(msg, req) or (self._check_layers(msg) if grouped else "") or self.source.check(msg)
                if err:
                    self.stats.refused += 1
                    return ErrorMsg(code="layout_mismatch", detail=err[:1000], req_id=rid)
                req.owners.add(peer)
                req.consumers = max(req.consumers, msg.consumers)
                req.shares.add(key)
                self._pending.add(key)
                if grouped:
                    self._streams[key] = _Stream(requested={msg.first_layer}, inflight=1)
        if req is None:
            return None
        with self._lock:
            return self._submit_serve(msg, reply)

    def _submit_serve(self, msg: KVRequest, reply):
        """Queue ``msg`` for a worker (lock held); undo the pending mark if the pool is closed."""
        key = share_key(msg.req_id, msg.share)
        try:
            self._pool.submit(self._serve, msg, reply)
        except RuntimeError:  # pool shut down
            st = self._streams.get(key)
            if st is not None:
                st.inflight -= 1
            if st is None or (st.inflight == 0 and st.served == 0):
                self._pending.discard(key)
                self._streams.pop(key, None)
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
        rid = msg.req_id
        key = share_key(rid, msg.share)
        with self._lock:
            req = self._requests.get(rid)
            if req is not None and req.owners and peer not in req.owners:
                # a further consumer that had nothing to pull may end its own, unclaimed share
                if not (msg.share < req.consumers and len(req.owners) < req.consumers
                        and key not in req.shares and key not in req.done):
                    return self._refuse("not_owner", rid, "unknown_request",
                                        "only the decode that requested this id may release it")
                req.owners.add(peer)
            if key in self._pending:  # KVReady not sent yet: the worker cancels it
                self._cancelled.add(key)
                return Ack(req_id=rid)
            if req is None:
                gone = self._gone.get(rid)
                if gone is not None:
                    return ErrorMsg(code="unknown_request", detail=f"nothing to release: already {gone}",
                                    req_id=rid)
                self._early_release[rid] = time.monotonic() + EARLY_RELEASE_S
                self._early_release.move_to_end(rid)
                if len(self._early_release) > MAX_EARLY:
                    self._early_release.popitem(last=False)
                    self.stats.refusals.count("early_release_evicted")
                return Ack(req_id=rid)  # it beat the hand-over
            served = self._served.pop(key, None) is not None
            finished, ok = self._share_done_locked(rid, req, key, msg.ok)
        if served and self.ring is not None:
            self.ring.release(key)  # P8
        self.exposure.release(key)
        if not msg.ok:
            logger.warning("prefill: decode reported a failed transfer of %s", rid)
        if finished:
            self._notify(rid, ok)  # P9: the blocks are free for the engine
        return Ack(req_id=rid)

    def _share_done_locked(self, rid: str, req: _Req, key: str, ok: bool, count: bool = True) -> tuple[bool, bool]:
        """Share ``key`` of ``rid`` is released (lock held; ``count``: a Release, not a
        cancel). Returns (the whole request is finished and forgotten, all its shares
        succeeded)."""
        req.shares.discard(key)
        self._streams.pop(key, None)
        req.done.add(key)
        req.ok = req.ok and ok
        if len(req.done) < req.consumers:
            return False, req.ok
        self._requests.pop(rid, None)
        self._remember_gone_locked(rid, "released")
        self.stats.released += count
        return True, req.ok

    def on_renew(self, peer: str, msg: Renew, reply):
        """Heartbeat: extend the lease of every id in ``msg`` that is held, not yet
        requested, and unclaimed or claimed by ``peer`` (see module doc). Ids in flight
        (KVRequest accepted) are left alone: their lease runs from KVReady. Ids not held
        and not finished (the hand-over may still come) are ignored. A control peer's
        (the proxy's) Renew of a claimed id answers it ``gone``: the proxy's part is over."""
        now = time.time()
        control = bool(getattr(reply, "control", False))
        gone, renewed, strangers = [], 0, 0
        with self._lock:
            for rid in msg.req_ids:
                req = self._requests.get(rid)
                if req is None:
                    if rid in self._gone:
                        gone.append(rid)
                    continue
                if req.owners and peer not in req.owners:
                    if control:
                        gone.append(rid)
                    else:
                        strangers += 1
                    continue
                if not req.expiry or req.shares:  # in flight: its lease runs from KVReady
                    continue
                new = now + self.lease_s
                if req.hold_end:
                    new = min(new, req.hold_end)
                if new > req.expiry:
                    req.expiry = new
                    renewed += 1
            self.stats.renewed += renewed
        if strangers:
            self._refuse("not_owner", msg.req_ids[0], "unknown_request",
                         f"{strangers} renewed id(s) were claimed by another decode")
        return Renewed(renewed=renewed, gone=gone)

    # ------------------------------------------------------------------ P4-P7
    def _serve(self, msg: KVRequest, reply) -> None:
        rid = msg.req_id
        key = share_key(rid, msg.share)
        with self._lock:
            st = self._streams.get(key)
        if st is not None:
            self._serve_group(msg, reply, st, key)
            return
        reserved = False
        try:
            with self._lock:
                req = self._requests.get(rid)
            if req is None:
                raise _Refuse("unknown_request", "request dropped by the engine")
            if self._is_cancelled(key):
                raise _Cancelled()
            src = req.src_blocks[msg.first_block:msg.first_block + len(msg.dst_block_ids)]
            prep = self.source.prepare(msg, src, self.export_base)
            off = 0
            if prep.nbytes:
                off = self._reserve(key, msg, prep.nbytes)  # P5
                reserved = True
                if self._is_cancelled(key):
                    raise _Cancelled()
                if self.observer is not None:
                    self.observer(rid, msg, src)
                t0 = time.perf_counter()
                prep.fill(self.ring.base_addr + off, self.ring.view(off, prep.nbytes))  # P4 + P6
                self._note_produce(rid, time.perf_counter() - t0, add=key != rid)
            elif self.observer is not None:
                self.observer(rid, msg, src)
            segs = prep.segments(off)
            if len(segs) > MAX_SEGMENTS:  # a KVReady the decode would drop: refuse now, naming why
                raise _Refuse("layout_mismatch", _too_many_segments(len(segs), self.source, msg))
            if not prep.nbytes and self.registration == "per_request":  # served in place: expose its runs
                self.exposure.acquire(key, [(self.export_base + s.offset_bytes, s.nbytes) for s in segs],
                                      domains=self._export_regions)
            out = KVReady(req_id=rid, ring_offset=off, total_nbytes=sum(s.nbytes for s in segs), segments=segs,
                          lease_ms=int(self.lease_s * 1000), chip=msg.dst_chip)
            with self._lock:  # the cancel check and the move to _served are one step
                if key in self._cancelled:
                    raise _Cancelled()
                self._pending.discard(key)
                self._served[key] = (time.monotonic(), rid)
                self.stats.served += 1
            reply(out)  # P7
        except Exception as e:  # noqa: BLE001 - every failure becomes a typed reply
            if reserved:
                self.ring.release(key)  # P8
            self.exposure.release(key)
            finished = False
            with self._lock:
                self._pending.discard(key)
                cancelled = key in self._cancelled
                self._cancelled.discard(key)
                req = self._requests.get(rid)
                if cancelled:  # the decode gave up and sent Release: this share is done (P9 when all are)
                    self.stats.cancelled += 1
                    if req is not None:
                        finished, _ok = self._share_done_locked(rid, req, key, False, count=False)
                else:
                    self.stats.refused += 1
                    if req is not None:
                        req.shares.discard(key)
            self._fail_reply(rid, e, cancelled, reply, finished)

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

    def _fail_reply(self, rid: str, e: Exception, cancelled: bool, reply, finished: bool = False) -> None:
        if cancelled:  # no reply: nobody waits for it
            logger.warning("prefill: %s released by the decode before its KVReady (%s); range freed",
                           rid, "cancelled" if isinstance(e, _Cancelled) else f"{type(e).__name__}: {e}")
            if finished:
                self._notify(rid, False)
            return
        if isinstance(e, _Refuse):
            reply(ErrorMsg(code=e.code, detail=str(e)[:1000], req_id=rid))
        else:
            logger.exception("prefill: serving %s failed", rid)
            reply(ErrorMsg(code="internal", detail=f"{type(e).__name__}: {str(e)[:900]}", req_id=rid))

    def _serve_group(self, msg: KVRequest, reply, st: _Stream, key: str) -> None:
        """One layer group of a request's share (P4-P7 for layers first_layer..+num_layers).
        The first group served plans and reserves the whole share's range; each group
        fills its own bytes and sends its own KVReady. The range is freed by Release
        (P8), or here when the last group in flight fails or is cancelled while no
        KVReady of the share is out."""
        rid = msg.req_id
        lo, hi = msg.first_layer, msg.first_layer + msg.num_layers
        try:
            with self._lock:
                req = self._requests.get(rid)
            if req is None:
                raise _Refuse("unknown_request", "request dropped by the engine")
            if self._is_cancelled(key):
                raise _Cancelled()
            src = req.src_blocks[msg.first_block:msg.first_block + len(msg.dst_block_ids)]
            with st.lock:  # the first group plans and reserves for all
                if st.prep is None:
                    prep = self.source.prepare(msg, src, self.export_base)
                    if not prep.nbytes or prep.fill_layers is None:
                        raise _Refuse("layout_mismatch", "this source does not serve layer groups")
                    st.offset = self._reserve(key, msg, prep.nbytes)  # P5
                    st.prep = prep
                    if self.observer is not None:
                        self.observer(rid, msg, src)
            prep, off = st.prep, st.offset
            if self._is_cancelled(key):
                raise _Cancelled()
            t0 = time.perf_counter()
            prep.fill_layers(self.ring.base_addr + off, self.ring.view(off, prep.nbytes), lo, hi)  # P4 + P6
            self._note_produce(rid, time.perf_counter() - t0, add=True)
            segs = prep.segments_layers(off, lo, hi)
            out = KVReady(req_id=rid, ring_offset=off, total_nbytes=sum(s.nbytes for s in segs), segments=segs,
                          lease_ms=int(self.lease_s * 1000), chip=msg.dst_chip)
            with self._lock:
                if key in self._cancelled:
                    raise _Cancelled()
                st.inflight -= 1
                st.served += 1
                if st.inflight == 0:
                    self._pending.discard(key)
                self._served[key] = (time.monotonic(), rid)
                if st.served == 1:
                    self.stats.served += 1
            reply(out)  # P7 for this group
        except Exception as e:  # noqa: BLE001 - every failure becomes a typed reply
            finished = False
            with self._lock:
                st.inflight -= 1
                last = st.inflight == 0
                cancelled = key in self._cancelled
                free = last and st.offset >= 0 and (cancelled or st.served == 0)
                if last:
                    self._pending.discard(key)
                req = self._requests.get(rid)
                if cancelled and last:  # the decode gave up and sent Release: this share is done
                    self._cancelled.discard(key)
                    self._served.pop(key, None)
                    self.stats.cancelled += 1
                    if req is not None:
                        finished, _ok = self._share_done_locked(rid, req, key, False, count=False)
                elif not cancelled:
                    self.stats.refused += 1
                    if last and st.served == 0 and req is not None:
                        req.shares.discard(key)
                        self._streams.pop(key, None)
                if free:
                    st.offset = -1
            if free:
                self.ring.release(key)  # P8
            if cancelled and not last:
                return  # the last group still in flight finishes the cancel
            self._fail_reply(rid, e, cancelled, reply, finished)

    def _check(self, msg: KVRequest, req: _Req) -> str:
        """'' when the request's token and block counts can be served, else why not."""
        if msg.num_tokens <= 0 or msg.num_tokens > req.num_tokens:
            return f"num_tokens {msg.num_tokens} not in [1, {req.num_tokens}] (the prefill's length)"
        if msg.dst_layout.block_size != self.compat.block_size:
            return (f"destination block_size {msg.dst_layout.block_size} differs from the handshake's "
                    f"{self.compat.block_size}")
        n_req = -(-msg.num_tokens // self.compat.block_size)
        ids = msg.dst_block_ids
        if not ids or msg.first_block + len(ids) != n_req:
            return (f"first_block {msg.first_block} + {len(ids)} destination block ids do not end the "
                    f"{n_req} blocks of {msg.num_tokens} tokens (need at least one)")
        if len(set(ids)) != len(ids):
            return "destination block ids must be distinct"
        if max(ids) >= MAX_DST_BLOCK_ID:
            return f"destination block id {max(ids)} >= {MAX_DST_BLOCK_ID}"
        return ""

    def _note_produce(self, rid: str, seconds: float, add: bool = False) -> None:
        with self._lock:
            t = self.stats.produce_s
            t[rid] = seconds + (t.get(rid, 0.0) if add else 0.0)
            if len(t) > 1024:
                t.pop(next(iter(t)))

    def produce_seconds(self, req_id: str) -> float | None:
        """Seconds producing ``req_id``'s bytes took (transform or gather; last 1024), or None."""
        with self._lock:
            return self.stats.produce_s.get(req_id)

    def _is_cancelled(self, key: str) -> bool:
        with self._lock:
            return key in self._cancelled

    def _remember_gone_locked(self, rid: str, why: str) -> None:
        self._streams.pop(rid, None)
        self._gone[rid] = why
        self._gone.move_to_end(rid)
        if len(self._gone) > MAX_GONE:
            self._gone.popitem(last=False)

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
        now, mono = time.time(), time.monotonic()
        late, keys = [], []
        with self._lock:
            dead = list(dict.fromkeys(r for t, r in self._served.values() if self.lease_s and mono - t > self.lease_s))
            dead += [r for r, q in self._requests.items()
                     if q.expiry and now > q.expiry and not q.shares and r not in dead]
            for r in dead:
                q = self._requests.pop(r, None)
                shares = (q.shares if q is not None else set()) | {r}
                for k in shares:
                    self._served.pop(k, None)
                    self._streams.pop(k, None)
                keys.append((r, shares))
                self._remember_gone_locked(r, "expired")
                self.stats.expired += 1
            while self._early and next(iter(self._early.values()))[1] < mono:
                late.append(self._early.popitem(last=False))
                self._early_ids -= sum(max(1, len(m.dst_block_ids)) for m, _r, _p in late[-1][1][0])
            while self._early_release and next(iter(self._early_release.values())) < mono:
                self._early_release.popitem(last=False)
        for rid, (pairs, _u) in late:
            for _m, reply, _p in pairs:
                reply(ErrorMsg(code="unknown_request", detail="no finished prefill with this id", req_id=rid))
        for r, shares in keys:
            logger.warning("prefill: lease of %s expired without Release; freeing it", r)
            for k in shares:
                if self.ring is not None and k in self.ring.alloc.live():
                    self.ring.release(k)
                self.exposure.release(k)
            self._notify(r, False)  # P9: the blocks are free for the engine
        return dead

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
            try:
                self.transport.unregister(a)
            except Exception:  # noqa: BLE001 - transport closed already
                pass
        self._exported = []
        self.exposure.close()


class _Cancelled(Exception):
    """Internal: the decode sent Release while the request was still being served."""


def _too_many_segments(n: int, source, msg: KVRequest) -> str:
    share = f"heads {msg.head_start}..{msg.head_start + msg.num_heads - 1} of " if msg.num_heads else ""
    return (f"KVReady would carry {n} segments ({share}{len(msg.dst_block_ids)} blocks served in place by "
            f"{source.name}: one per byte run per layer), the protocol allows "
            f"{MAX_SEGMENTS}; use mode staged (the ring gathers each layer into one segment), contiguous blocks, "
            "or a head-outer cache layout for shares")


class _Refuse(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
