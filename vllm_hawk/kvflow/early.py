"""Messages that beat the engine's hand-over of a request, bounded.

A decode's KVRequest can reach the prefill before the engine hands the request over
(:meth:`~vllm_hawk.kvflow.prefill.PrefillEndpoint.add_request`); so can its Release.
:class:`EarlyArrivals` parks such KVRequests (the layer groups and shares of one id wait
together, in arrival order) until shortly before the first one's own deadline
(``KVRequest.deadline_ms``, the decode's pull deadline), never less than
:data:`EARLY_REQUEST_WAIT_S` nor more than :data:`EARLY_REQUEST_MAX_WAIT_S`, and remembers
such Releases for :data:`EARLY_RELEASE_S`.

Why the decode's deadline: a decode asks only for an id the prefill announced, and the
engine hands a finished request over one engine step after it finished. That step can
come seconds later on a host short of CPU: on a 2-core host running a TP=2 prefill and a
TP=2 decode it came more than 3 s after the decode's KVRequest.

An id that is never handed over (a stale or made-up one) is refused sooner when the
engine steps: the hand-over of a request the decode could know of comes in the metadata
of the next step scheduled after it finished, so once :data:`HAND_OVER_STEPS` engine
steps have begun since a KVRequest arrived (:meth:`EarlyArrivals.overdue`, counted by
the endpoint), its id is unknown. One step more than needed covers vLLM's asynchronous
scheduling (a step scheduled before the request's finish may begin after the KVRequest).

Bounds: at most :data:`MAX_EARLY` ids parked and :data:`MAX_EARLY_BLOCK_IDS`
destination block ids in all (each parked KVRequest counts at least one); a KVRequest
beyond that is refused (``early_full``). At most :data:`MAX_EARLY` early Releases: a
further one makes the oldest forgotten. Not thread-safe: the endpoint's lock guards it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from vllm_hawk.kvflow.lifecycle import Refusal, ShareRecord, ShareState, share_key
from vllm_hawk.protocol.messages import KVRequest

EARLY_REQUEST_WAIT_S = 3.0  # the least a KVRequest that beats the hand-over waits for it
EARLY_REQUEST_MAX_WAIT_S = 60.0  # the most, whatever its deadline (or none) says
EARLY_REPLY_MARGIN_S = 1.0  # the refusal goes out this long before the decode's deadline
HAND_OVER_STEPS = 3  # engine steps begun since a KVRequest's arrival after which its id is unknown
EARLY_RELEASE_S = 10.0  # a Release may beat the hand-over by this much
MAX_EARLY = 1024  # early KVRequests / Releases remembered at once
MAX_EARLY_BLOCK_IDS = 1 << 18  # destination block ids of all parked early KVRequests together


ALREADY_IN_FLIGHT = Refusal("", "bad_message", "request already in flight")
NOT_OWNER = Refusal("not_owner", "unknown_request", "another decode requested this id")


@dataclass
class Parked:
    """One id's parked KVRequests: ``arrivals`` (KVRequest, reply, peer) in arrival
    order, ``shares`` their records (``PARKED``) by share key, answered by ``until`` or
    :data:`HAND_OVER_STEPS` engine steps after ``step``."""

    arrivals: list
    shares: dict[str, ShareRecord]
    until: float  # monotonic
    step: int = 0  # the endpoint's engine step count when the first KVRequest arrived


def early_wait_s(msg: KVRequest, now: float | None = None) -> float:
    """Seconds ``msg`` (the first KVRequest of an id not handed over yet) waits for the
    hand-over: until :data:`EARLY_REPLY_MARGIN_S` before its deadline (so that the decode
    hears ``unknown_request`` rather than nothing), within [:data:`EARLY_REQUEST_WAIT_S`,
    :data:`EARLY_REQUEST_MAX_WAIT_S`] (the deadline is on the decode's clock: the bounds keep
    a skewed one harmless)."""
    if not msg.deadline_ms:
        return EARLY_REQUEST_MAX_WAIT_S
    left = msg.deadline_ms / 1e3 - EARLY_REPLY_MARGIN_S - (time.time() if now is None else now)
    return min(max(left, EARLY_REQUEST_WAIT_S), EARLY_REQUEST_MAX_WAIT_S)


def _n_ids(msg: KVRequest) -> int:
    return max(1, len(msg.dst_block_ids))


class EarlyArrivals:
    """Parked early KVRequests and remembered early Releases (see module doc)."""

    def __init__(self) -> None:
        self._parked: collections.OrderedDict[str, Parked] = collections.OrderedDict()
        self._releases: collections.OrderedDict[str, float] = collections.OrderedDict()  # rid -> until
        self.block_ids = 0  # destination block ids of every parked KVRequest

    def __len__(self) -> int:
        return len(self._parked)

    def releases(self) -> int:
        return len(self._releases)

    def waiting(self, rid: str) -> bool:
        return rid in self._parked

    def park(self, peer: str, msg: KVRequest, reply, step: int = 0) -> Refusal | None:
        """Park the first KVRequest of an id not handed over yet (``step``: the engine steps
        begun so far); a Refusal when full."""
        n = _n_ids(msg)
        if len(self._parked) >= MAX_EARLY or self.block_ids + n > MAX_EARLY_BLOCK_IDS:
            return Refusal(
                "early_full",
                "unknown_request",
                f"no finished prefill with this id, and {len(self._parked)} early requests "
                f"({self.block_ids} block ids) already wait for theirs",
            )
        key = share_key(msg.req_id, msg.share)
        self._parked[msg.req_id] = Parked([], {}, time.monotonic() + early_wait_s(msg), step)
        self._add(self._parked[msg.req_id], key, (msg, reply, peer), n)
        return None

    def join(self, peer: str, msg: KVRequest, reply) -> Refusal | None:
        """Add a further layer group or share to an id already parked; a Refusal when it
        repeats one, comes from a peer past the id's consumers, or the bound is reached."""
        entry = self._parked[msg.req_id]
        key = share_key(msg.req_id, msg.share)
        rec = entry.shares.get(key)
        if rec is not None and not _joins_groups(rec.parked, peer, msg):
            return ALREADY_IN_FLIGHT
        if rec is None:
            peers = {p for _m, _r, p in entry.arrivals} | {peer}
            if len(peers) > max(m.consumers for m, _r, _p in entry.arrivals):
                return NOT_OWNER
        n = _n_ids(msg)
        if self.block_ids + n > MAX_EARLY_BLOCK_IDS:
            return Refusal(
                "early_full",
                "unknown_request",
                f"no finished prefill with this id, and early requests already hold {self.block_ids} block ids",
            )
        self._add(entry, key, (msg, reply, peer), n)
        return None

    def _add(self, entry: Parked, key: str, arrival: tuple, n: int) -> None:
        rec = entry.shares.get(key)
        if rec is None:
            rec = entry.shares[key] = ShareRecord(key, ShareState.PARKED)
        rec.parked.append(arrival)
        entry.arrivals.append(arrival)
        self.block_ids += n

    def take(self, rid: str) -> Parked | None:
        """The hand-over of ``rid`` came: its parked KVRequests (None if none)."""
        entry = self._parked.pop(rid, None)
        if entry is not None:
            self.block_ids -= sum(_n_ids(m) for m, _r, _p in entry.arrivals)
        return entry

    def expire(self, now_mono: float) -> list[tuple[str, Parked]]:
        """Drop parked ids whose wait is over (their shares move to ``EXPIRED``) and
        Releases remembered too long; returns the dropped ids with what was parked."""
        late = self._drop([rid for rid, entry in self._parked.items() if entry.until < now_mono])
        while self._releases and next(iter(self._releases.values())) < now_mono:
            self._releases.popitem(last=False)
        return late

    def overdue(self, step: int) -> list[tuple[str, Parked]]:
        """Drop parked ids whose hand-over would have come by engine step ``step`` (see
        module doc); returns them with what was parked."""
        return self._drop([rid for rid, e in self._parked.items() if step - e.step >= HAND_OVER_STEPS])

    def _drop(self, rids: list[str]) -> list[tuple[str, Parked]]:
        out = []
        for rid in rids:
            entry = self._parked.pop(rid)
            self.block_ids -= sum(_n_ids(m) for m, _r, _p in entry.arrivals)
            for rec in entry.shares.values():
                rec.move(ShareState.EXPIRED)
            out.append((rid, entry))
        return out

    def remember_release(self, rid: str) -> bool:
        """Remember a Release of ``rid`` (not handed over yet); True when the oldest one
        was forgotten to stay within :data:`MAX_EARLY`."""
        self._releases[rid] = time.monotonic() + EARLY_RELEASE_S
        self._releases.move_to_end(rid)
        if len(self._releases) > MAX_EARLY:
            self._releases.popitem(last=False)
            return True
        return False

    def take_release(self, rid: str) -> bool:
        """The hand-over of ``rid`` came: True (and forgotten) if its Release came first."""
        return self._releases.pop(rid, None) is not None


def _joins_groups(same: list, peer: str, msg: KVRequest) -> bool:
    """A KVRequest for a share already parked may only be a further layer group of it,
    from the same peer, for a first layer not asked for yet."""
    first, _reply, first_peer = same[0]
    grouped = bool(msg.num_layers or msg.first_layer)
    return (
        grouped
        and first_peer == peer
        and bool(first.num_layers)
        and all(m.first_layer != msg.first_layer for m, _r, _p in same)
    )
