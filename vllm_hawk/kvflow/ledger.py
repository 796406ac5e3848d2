"""The prefill's request ledger: what to do with each hand-over, KVRequest, Release,
Renew, expiry and served or failed layer group, apart from doing it.

The ledger holds the handed-over requests and their shares' states
(:class:`~vllm_hawk.kvflow.lifecycle.RequestTable`, moving only along
:data:`~vllm_hawk.kvflow.lifecycle.LEGAL_MOVES`), the messages that beat the hand-over
(:class:`~vllm_hawk.kvflow.early.EarlyArrivals`) and the counters of
:class:`PrefillStats`. Each method takes a message, ids or times and returns a decision:
:class:`Serve` (queue the KVRequest for a worker), :class:`Wait` (parked until the
hand-over), a :class:`~vllm_hawk.kvflow.lifecycle.Refusal` (the wire error code to
answer), :class:`Cancelled` (stop serving, send nothing) or an :class:`Outcome`: the
share keys whose ring range and registrations to free (P8), the :class:`Notify` for the
engine (P9), parked KVRequests to answer or to serve again. The endpoint
(:class:`~vllm_hawk.kvflow.prefill.PrefillEndpoint`) carries them out; the ledger
touches no ring, transport, socket or thread.

Not thread-safe: the endpoint holds its lock around every call, and frees the ranges an
outcome names before it lets go of the lock. Times: ``now`` unix s (hand-over holds and
renewals), ``mono`` monotonic s (a KVReady's lease).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_hawk.integrity.checksum import ALGORITHM
from vllm_hawk.kvflow.early import ALREADY_IN_FLIGHT, NOT_OWNER, EarlyArrivals
from vllm_hawk.kvflow.lifecycle import (
    Refusal,
    RequestRecord,
    RequestTable,
    ShareRecord,
    ShareState,
    Stream,
    share_key,
)
from vllm_hawk.protocol.messages import KVRequest, Release
from vllm_hawk.security import Refusals

MAX_DST_BLOCK_ID = 1 << 24
PENDING = frozenset({ShareState.SERVING, ShareState.CANCELLED})  # KVReady not sent yet (``pending``)

BAD_ID = Refusal("", "bad_message", "request id contains a NUL byte")
CLOSING = Refusal("", "internal", "prefill endpoint is closing")
DROPPED = Refusal("", "unknown_request", "request dropped by the engine")
NEVER_HANDED_OVER = Refusal("", "unknown_request", "no finished prefill with this id")
SHARE_RELEASED = Refusal("", "unknown_request", "this share was already released")
NOT_RELEASER = Refusal("not_owner", "unknown_request", "only the decode that requested this id may release it")


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


@dataclass(frozen=True)
class Serve:
    """The KVRequest is accepted: queue it for a worker (share ``key`` is ``SERVING``)."""

    key: str


@dataclass(frozen=True)
class Wait:
    """The KVRequest is parked until the engine hands its request over: no reply yet."""


@dataclass(frozen=True)
class Cancelled:
    """The decode released the share before its KVReady: stop serving it, send nothing."""


@dataclass(frozen=True)
class Notify:
    """Tell the engine ``req_id``'s source blocks are free (P9); ``ok``: every share succeeded."""

    req_id: str
    ok: bool


@dataclass(frozen=True)
class Outcome:
    """What a hand-over, Release, expiry or engine step leads to, in the order to do it:
    ``free`` share keys' ring ranges and registrations (P8, under the endpoint's lock),
    then ``refusal`` as the reply (None: the usual one), ``late`` (req_id,
    :class:`~vllm_hawk.kvflow.early.Parked`) of ids never handed over, answered
    :data:`NEVER_HANDED_OVER`, ``notify`` the engine, and ``arrivals`` (KVRequest, reply,
    peer) parked before the hand-over, to be taken again in arrival order."""

    free: tuple[str, ...] = ()
    refusal: Refusal | None = None
    late: tuple = ()
    notify: tuple[Notify, ...] = ()
    arrivals: tuple = ()


@dataclass(frozen=True)
class Renewal:
    """A Renew's answer: ``renewed`` leases, ids ``gone``, and the refusal counted for ids
    claimed by another decode (the Renewed goes out anyway)."""

    renewed: int
    gone: list[str]
    refusal: Refusal | None = None


@dataclass(frozen=True)
class Failure:
    """A layer group could not be served: ``free`` these keys (P8); ``cancelled``: the
    decode had sent Release (no reply; ``notify`` the engine if that finished the
    request); ``quiet``: another group of the share still in flight finishes the cancel
    (nothing to log or answer). Otherwise the group is answered with its error."""

    free: tuple[str, ...]
    cancelled: bool
    quiet: bool = False
    notify: Notify | None = None


def grouped(msg: KVRequest) -> bool:
    """``msg`` asks for one layer group (else for all layers, the whole request)."""
    return bool(msg.num_layers or msg.first_layer)


def layers(msg: KVRequest) -> tuple[int, int]:
    """The layers ``lo..hi-1`` that ``msg`` asks for (a whole request: all of them)."""
    if grouped(msg):
        return msg.first_layer, msg.first_layer + msg.num_layers
    return 0, msg.dst_layout.num_layers


def check_counts(msg: KVRequest, req: RequestRecord) -> str:
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


def check_checksum(msg: KVRequest) -> str:
    """'' when this prefill computes the checksum ``msg`` asks for (or none)."""
    if msg.checksum and msg.checksum != ALGORITHM:
        return (
            f"checksum {msg.checksum[:32]!r} asked for; this prefill computes {ALGORITHM!r} (run both sides at "
            "the same vllm-hawk version, or set integrity false on the decode)"
        )
    return ""


def check_layers(msg: KVRequest, layer_groups: bool, source_name: str) -> str:
    """'' when ``msg``'s layer group can be served, else why not."""
    if not layer_groups:
        return f"this prefill's source ({source_name}) does not serve layer groups"
    L = msg.dst_layout.num_layers
    if msg.num_layers <= 0 or msg.first_layer + msg.num_layers > L:
        return f"layer group {msg.first_layer} + {msg.num_layers} is not inside the {L} layers"
    return ""


def lapsed(table: RequestTable, lease_s: float, now: float, mono: float) -> list[str]:
    """Ids whose lease ran out: a KVReady older than ``lease_s`` without Release, or
    held past its expiry with nothing in flight."""
    served = [
        rid
        for rid, req in table.requests.items()
        if lease_s and any(s.kvready_out and mono - s.served_at > lease_s for s in req.shares.values())
    ]
    held = [
        rid
        for rid, req in table.requests.items()
        if req.expiry and now > req.expiry and not req.in_flight() and rid not in served
    ]
    return served + held


class Ledger:
    """The requests one prefill endpoint holds, and its decisions (see module doc).

    block_size: the source's tokens per block; lease_s, handover_s, max_hold_s: as
    :class:`~vllm_hawk.kvflow.prefill.PrefillEndpoint`'s; check_source(msg): '' when the
    source can serve ``msg``'s layout, else why not; layer_groups: the source serves
    layer groups; source_name: for refusals; stats: the counters to keep.
    """

    def __init__(
        self,
        *,
        block_size: int,
        lease_s: float,
        handover_s: float,
        max_hold_s: float,
        check_source=lambda msg: "",
        layer_groups: bool = True,
        source_name: str = "source",
        stats: PrefillStats | None = None,
    ) -> None:
        self.block_size, self.lease_s, self.handover_s, self.max_hold_s = block_size, lease_s, handover_s, max_hold_s
        self.check_source, self.layer_groups, self.source_name = check_source, layer_groups, source_name
        self.stats = PrefillStats() if stats is None else stats
        self.table = RequestTable()  # handed-over requests, their shares' states, finished ids
        self.early = EarlyArrivals()  # KVRequests and Releases that beat the hand-over
        self.steps = 0  # engine steps begun (:meth:`step`), for EarlyArrivals.overdue

    # ------------------------------------------------------------------ hand-over, engine steps
    def hand_over(self, rid: str, src_blocks, num_tokens: int, lease_expiry: float | None, now: float) -> Outcome:
        """The engine finished ``rid`` (see ``PrefillEndpoint.add_request``); raises
        ``ValueError`` for blocks that cannot hold ``num_tokens``. A Release that came first
        finishes it at once; KVRequests parked for it are to be taken again."""
        src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
        bs = self.block_size
        if num_tokens <= 0 or num_tokens > src.size * bs:
            raise ValueError(f"add_request {rid!r}: {num_tokens} tokens do not fit {src.size} blocks of {bs}")
        if src.size and src.min() < 0:
            raise ValueError(f"add_request {rid!r}: negative block id")
        if lease_expiry is None:
            lease_expiry = now + self.handover_s if self.lease_s else 0.0
        hold_end = now + self.max_hold_s if self.max_hold_s and lease_expiry else 0.0
        if self.early.take_release(rid):  # the decode released it before the hand-over
            self.table.forget(rid, "released")
            self.stats.released += 1
            return Outcome(notify=(Notify(rid, True),))
        req = self.table.requests[rid] = RequestRecord(src, num_tokens, lease_expiry, hold_end)
        parked = self.early.take(rid)
        if parked is None:
            return Outcome()
        for rec in parked.shares.values():
            rec.move(ShareState.HELD)
            req.shares[rec.key] = rec
        return Outcome(arrivals=tuple(parked.arrivals))

    def step(self) -> Outcome:
        """The engine began a step: ids parked so long that their hand-over would have come
        by now are ``late`` (:meth:`~vllm_hawk.kvflow.early.EarlyArrivals.overdue`)."""
        self.steps += 1
        return Outcome(late=tuple(self.early.overdue(self.steps)))

    # ------------------------------------------------------------------ KVRequest (D1)
    def admit(self, peer: str, msg: KVRequest, reply, closing: bool = False) -> Serve | Wait | Refusal:
        """Take a KVRequest from ``peer`` (``reply``: kept with it if it is parked;
        ``closing``: the endpoint is shutting down, nothing is parked any more)."""
        if "\x00" in msg.req_id:
            return BAD_ID
        req = self.table.get(msg.req_id)
        if req is None:
            return self._park(peer, msg, reply, closing)
        return self._accept(peer, msg, req)

    def _park(self, peer: str, msg: KVRequest, reply, closing: bool) -> Wait | Refusal:
        """A KVRequest for an id not held: join those parked for it, refuse a finished id,
        or park it until the hand-over."""
        rid = msg.req_id
        if self.early.waiting(rid):  # parked before the hand-over: further groups or shares join
            return self.early.join(peer, msg, reply) or Wait()
        gone = self.table.gone.get(rid)
        if gone is not None:
            self.stats.refused += 1
            code = "expired" if gone == "expired" else "unknown_request"
            return Refusal("", code, f"the request's blocks were {gone}")
        if closing:
            return CLOSING
        return self.early.park(peer, msg, reply, self.steps) or Wait()

    def _accept(self, peer: str, msg: KVRequest, req: RequestRecord) -> Serve | Refusal:
        rid = msg.req_id
        if not req.may_claim(peer, msg.consumers):
            return NOT_OWNER
        key = share_key(rid, msg.share)
        rec = req.shares.get(key)
        if rec is not None and rec.state is ShareState.RELEASED:
            return SHARE_RELEASED
        if rec is not None and rec.in_flight:
            return self._join(msg, rec)
        err = (
            check_counts(msg, req)
            or check_checksum(msg)
            or (self._check_layers(msg) if grouped(msg) else "")
            or self.check_source(msg)
        )
        if err:
            self.stats.refused += 1
            return Refusal("", "layout_mismatch", err)
        req.owners.add(peer)
        req.consumers = max(req.consumers, msg.consumers)
        rec = req.share(key)
        rec.move(ShareState.SERVING)
        rec.stream = Stream(whole=not grouped(msg), requested={msg.first_layer}, inflight=1)
        return Serve(key)

    def _join(self, msg: KVRequest, rec: ShareRecord) -> Serve | Refusal:
        """A further layer group of a share in flight; a repeated group, or any other
        KVRequest of the share, is refused."""
        st = rec.stream
        if not grouped(msg) or st.whole or msg.first_layer in st.requested or rec.state is ShareState.CANCELLED:
            return ALREADY_IN_FLIGHT
        err = self._check_layers(msg)
        if err:
            self.stats.refused += 1
            return Refusal("", "layout_mismatch", err)
        st.requested.add(msg.first_layer)
        st.inflight += 1
        if rec.state is ShareState.SERVED:
            rec.move(ShareState.SERVING)
        return Serve(rec.key)

    def _check_layers(self, msg: KVRequest) -> str:
        return check_layers(msg, self.layer_groups, self.source_name)

    def unqueue(self, msg: KVRequest) -> Refusal:
        """An accepted KVRequest could not be queued (the workers are gone): undo its accept."""
        rec = self.table.get(msg.req_id).shares[share_key(msg.req_id, msg.share)]
        rec.stream.inflight -= 1
        if rec.stream.inflight == 0:
            self._settle(rec)
        return CLOSING

    # ------------------------------------------------------------------ the worker's steps (P4-P7)
    def job(self, msg: KVRequest) -> tuple[RequestRecord | None, ShareRecord | None]:
        """The request and share record a worker serves ``msg`` for (None once dropped)."""
        req = self.table.get(msg.req_id)
        return req, req.shares.get(share_key(msg.req_id, msg.share)) if req is not None else None

    @staticmethod
    def interrupt(rec: ShareRecord | None, dropped: bool = True) -> Cancelled | Refusal | None:
        """Whether a worker stops serving ``rec``: :class:`Cancelled` when the decode sent
        Release; with ``dropped``, :data:`DROPPED` when its request is gone; else None."""
        if dropped and (rec is None or rec.state is ShareState.EXPIRED):
            return DROPPED
        return Cancelled() if rec.state is ShareState.CANCELLED else None

    def served(self, rec: ShareRecord, mono: float) -> Cancelled | Refusal | None:
        """A group's KVReady is to go out (None: it may): the share is served once no group
        of it is in flight; ``stats.served`` counts each share once."""
        if rec.state is ShareState.CANCELLED:
            return Cancelled()
        if rec.state is not ShareState.SERVING:  # expired while it was produced
            return DROPPED
        st = rec.stream
        st.inflight -= 1
        st.served += 1
        if st.inflight == 0:
            rec.move(ShareState.SERVED)
        rec.served_at = mono
        if st.served == 1:
            self.stats.served += 1
        return None

    def failed(self, msg: KVRequest, req: RequestRecord | None, rec: ShareRecord | None) -> Failure:
        """A group could not be served. Not cancelled: it is refused (``stats.refused``);
        once no group is in flight the share is served (some KVReady out) or held again,
        its range freed if no KVReady is out. Cancelled (Release came): the last group in
        flight frees the range and ends the share."""
        if rec is None or rec.state is ShareState.EXPIRED:  # its request was freed meanwhile
            cancelled = rec is not None and rec.cancelled  # the decode had sent Release: no reply
            if cancelled:
                self.stats.cancelled += 1
            else:
                self.stats.refused += 1
            return Failure(free=(rec.key,) if rec is not None else (), cancelled=cancelled)
        st = rec.stream
        st.inflight -= 1
        last = st.inflight == 0
        cancelled = rec.state is ShareState.CANCELLED
        drop = last and (cancelled or st.served == 0)  # free before the share can be asked for again
        free = (rec.key,) if drop else ()
        if cancelled and not last:
            return Failure(free=free, cancelled=True, quiet=True)  # the last group in flight finishes it
        if cancelled:  # the decode gave up and sent Release: this share is done
            self.stats.cancelled += 1
            finished, _ok = self._share_done(msg.req_id, req, rec, False, count=False)
            return Failure(free=free, cancelled=True, notify=Notify(msg.req_id, False) if finished else None)
        self.stats.refused += 1
        if last:
            self._settle(rec)
        return Failure(free=free, cancelled=False)

    def _settle(self, rec: ShareRecord) -> None:
        """No group of ``rec`` is in flight any more and it was not cancelled: served if a
        KVReady of it is out, else held again (a new KVRequest starts afresh)."""
        if rec.stream.served:
            rec.move(ShareState.SERVED)
        else:
            rec.move(ShareState.HELD)
            rec.stream = None

    def note_produce(self, rid: str, seconds: float, add: bool = False) -> None:
        """Record the seconds producing ``rid``'s bytes took (``add``: to those of its
        other groups or shares; the last 1024 ids)."""
        t = self.stats.produce_s
        t[rid] = seconds + (t.get(rid, 0.0) if add else 0.0)
        if len(t) > 1024:
            t.pop(next(iter(t)))

    # ------------------------------------------------------------------ Release (D8), Renew
    def release(self, peer: str, msg: Release) -> Outcome:
        """Share ``msg.share`` is done: its key is freed (P8) and the engine notified once
        every share is (P9). While it is still being served it is cancelled instead (the
        worker frees it). A Release that beats the hand-over is remembered."""
        rid = msg.req_id
        key = share_key(rid, msg.share)
        req = self.table.get(rid)
        if req is None:
            return self._release_unheld(rid)
        if req.owners and peer not in req.owners:
            # a further consumer that had nothing to pull may end its own, unclaimed share
            if not (
                msg.share < req.consumers
                and len(req.owners) < req.consumers
                and req.state(key) in (None, ShareState.HELD)
            ):
                return Outcome(refusal=NOT_RELEASER)
            req.owners.add(peer)
        rec = req.share(key)
        if rec.state in PENDING:  # KVReady not sent yet: the worker cancels it
            if rec.state is ShareState.SERVING:
                rec.move(ShareState.CANCELLED)
            return Outcome()
        finished, ok = self._share_done(rid, req, rec, msg.ok)
        return Outcome(free=(key,), notify=(Notify(rid, ok),) if finished else ())

    def _release_unheld(self, rid: str) -> Outcome:
        """A Release for an id not held: finished already, or it beat the hand-over (a
        remembered one forgotten to make room is counted ``early_release_evicted``)."""
        gone = self.table.gone.get(rid)
        if gone is not None:
            return Outcome(refusal=Refusal("", "unknown_request", f"nothing to release: already {gone}"))
        if self.early.remember_release(rid):
            self.stats.refusals.count("early_release_evicted")
        return Outcome()

    def _share_done(
        self, rid: str, req: RequestRecord, rec: ShareRecord, ok: bool, count: bool = True
    ) -> tuple[bool, bool]:
        """Share ``rec`` of ``rid`` is released (``count``: a Release, not a cancel).
        Returns (the whole request is finished and forgotten, all its shares succeeded)."""
        if rec.state is not ShareState.RELEASED:
            rec.move(ShareState.RELEASED)
        rec.stream = None
        req.ok = req.ok and ok
        if req.released() < req.consumers:
            return False, req.ok
        self.table.forget(rid, "released")
        self.stats.released += count
        return True, req.ok

    def renew(self, peer: str, req_ids, now: float) -> Renewal:
        """Renew the lease of every id that is held, not yet requested, and unclaimed or
        claimed by ``peer``; ids in flight are left alone (their lease runs from KVReady),
        ids not held and not finished are ignored (the hand-over may still come)."""
        gone, renewed, strangers = [], 0, 0
        for rid in req_ids:
            req = self.table.get(rid)
            if req is None:
                if rid in self.table.gone:
                    gone.append(rid)
                continue
            if req.owners and peer not in req.owners:
                strangers += 1
                continue
            renewed += self._renew(req, now)
        self.stats.renewed += renewed
        if not strangers:
            return Renewal(renewed, gone)
        why = f"{strangers} renewed id(s) were claimed by another decode"
        return Renewal(renewed, gone, Refusal("not_owner", "unknown_request", why))

    def _renew(self, req: RequestRecord, now: float) -> int:
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

    # ------------------------------------------------------------------ leases
    def expire(self, now: float, mono: float) -> Outcome:
        """Free every request whose lease ran out (held and never asked for, or a share
        served without Release: then all its shares; the engine hears ``ok`` False), and
        the early arrivals whose wait is over (``late``)."""
        free, notify = [], []
        for rid in lapsed(self.table, self.lease_s, now, mono):
            req = self.table.requests[rid]
            free += dict.fromkeys([rid, *req.shares])
            for rec in req.shares.values():
                if rec.state not in (ShareState.RELEASED, ShareState.EXPIRED):
                    rec.move(ShareState.EXPIRED)
            self.table.forget(rid, "expired")
            self.stats.expired += 1
            notify.append(Notify(rid, False))
        return Outcome(free=tuple(free), late=tuple(self.early.expire(mono)), notify=tuple(notify))

    def owners(self) -> set[str]:
        """The peers that own a live request (their accepted KVRequests' leases are not over)."""
        return set().union(*(req.owners for req in self.table.requests.values()))

    def counts(self) -> dict:
        """Held requests, shares with a KVReady out (``served_live``) or not yet
        (``pending``), early arrivals, and the counters."""
        s = self.stats
        return {
            "requests": len(self.table.requests),
            "served_live": self.table.kvready_out(),
            "pending": self.table.count(PENDING),
            "early": len(self.early),
            "early_release": self.early.releases(),
            "early_block_ids": self.early.block_ids,
            "served": s.served,
            "released": s.released,
            "refused": s.refused,
            "expired": s.expired,
            "renewed": s.renewed,
            "cancelled": s.cancelled,
        }
