"""The life cycle of a request share on the prefill, as one state table.

A decode asks for a request by *share* (:func:`share_key`: the id for share 0, the whole
request). Each share of a request has one :class:`ShareRecord` whose :class:`ShareState`
moves only along :data:`LEGAL_MOVES`, through :meth:`ShareRecord.move`, which raises
:class:`IllegalTransition` (naming both states) for any other move:

* ``PARKED``: its KVRequest came before the engine's hand-over and waits
  (:mod:`~vllm_hawk.kvflow.early`);
* ``HELD``: the request's blocks are held and no KVRequest of the share is in flight
  (handed over, never asked for, or a serve that failed before any KVReady);
* ``SERVING``: accepted and queued or being produced (layer groups: some group still is);
* ``SERVED``: its KVReady is out, waiting for the Release;
* ``CANCELLED``: a Release came while it was serving; the worker frees its range;
* ``RELEASED``: done (Release, or a cancel the worker finished): terminal;
* ``EXPIRED``: freed by a lease expiry, the engine dropping it, or a hand-over that
  never came: terminal.

A :class:`RequestRecord` holds what the engine handed over (blocks, token count, lease)
and the records of its shares; :class:`RequestTable` holds the live requests and the ids of
finished ones (bounded, to answer late messages precisely). The records carry no lock:
:class:`~vllm_hawk.kvflow.ledger.Ledger` holds them, and the endpoint's lock guards it.

A message the prefill will not act on is answered with a :class:`Refusal`, the one
shape of a refusal (the ledger's, the early arrivals', the worker's): the wire error
code, the detail, and the reason it is counted under in ``stats.refusals`` (if any).
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vllm_hawk.protocol.messages import ErrorCode

MAX_GONE = 4096  # finished ids remembered to answer late messages precisely


def share_key(req_id: str, share: int = 0) -> str:
    """The key of share ``share`` of a request (share 0, also the whole request: the id)."""
    return req_id if not share else f"{req_id}\x00s{share}"


class ShareState(enum.Enum):
    PARKED = "parked"
    HELD = "held"
    SERVING = "serving"
    SERVED = "served"
    CANCELLED = "cancelled"
    RELEASED = "released"
    EXPIRED = "expired"


S = ShareState
LEGAL_MOVES: dict[ShareState, frozenset[ShareState]] = {
    S.PARKED: frozenset({S.HELD, S.EXPIRED}),  # the hand-over came / never came
    S.HELD: frozenset({S.SERVING, S.RELEASED, S.EXPIRED}),  # KVRequest accepted / Release / lease
    # KVReady out (the last group in flight) / Release before KVReady / serve failed with no
    # KVReady out / lease (of another share) or the engine dropped the request
    S.SERVING: frozenset({S.SERVED, S.CANCELLED, S.HELD, S.EXPIRED}),
    S.SERVED: frozenset({S.SERVING, S.RELEASED, S.EXPIRED}),  # a further layer group / Release / lease
    S.CANCELLED: frozenset({S.RELEASED, S.EXPIRED}),  # the worker freed the range / lease
    S.RELEASED: frozenset(),
    S.EXPIRED: frozenset(),
}
IN_FLIGHT = frozenset({S.SERVING, S.SERVED, S.CANCELLED})  # a KVRequest accepted, not yet done
del S


class Refusal(NamedTuple):
    """Why a message is not acted on: ``reason`` (counted in ``stats.refusals`` and logged,
    rate-limited; '' = neither), the wire error ``code`` (``ErrorMsg.code``) and ``detail``.
    The endpoint turns it into the ErrorMsg it sends, in one place."""

    reason: str
    code: ErrorCode
    detail: str


class IllegalTransition(RuntimeError):
    """A share was asked to move along an edge :data:`LEGAL_MOVES` does not have."""


@dataclass
class Stream:
    """How a share in flight is served: as layer groups (``whole`` False: each KVRequest
    names ``first_layer``/``num_layers``) or as one group of all layers (``whole``). The
    bytes are planned and reserved once, by the first group served; each group is
    produced and announced on its own."""

    whole: bool
    requested: set = field(default_factory=set)  # first_layer of every group asked for
    inflight: int = 0  # groups queued or being served
    served: int = 0  # groups whose KVReady went out
    prep: object = None  # the source's Prepared plan, once planned
    offset: int = -1  # ring offset once reserved
    lock: object = None  # the producer's planning lock: the first group plans for all


@dataclass
class ShareRecord:
    """One share of a request: its state, when its latest KVReady went out, how it is served."""

    key: str
    state: ShareState = ShareState.HELD
    served_at: float | None = None  # monotonic time of its latest KVReady; None = none out
    stream: Stream | None = None  # set while in flight
    parked: list = field(default_factory=list)  # PARKED: its (KVRequest, reply, peer) triples
    cancelled: bool = False  # it was CANCELLED at some point (a later expiry keeps the cancel silent)

    def move(self, to: ShareState) -> None:
        """Move to state ``to``; raises :class:`IllegalTransition` unless the table allows it."""
        if to not in LEGAL_MOVES[self.state]:
            raise IllegalTransition(f"share {self.key!r}: {self.state.value} -> {to.value} is not a legal move")
        self.state = to
        self.cancelled = self.cancelled or to is ShareState.CANCELLED

    @property
    def in_flight(self) -> bool:
        return self.state in IN_FLIGHT

    @property
    def kvready_out(self) -> bool:
        """A KVReady of this share is out and not yet released (its lease runs from it)."""
        return self.served_at is not None and self.state in IN_FLIGHT


@dataclass
class RequestRecord:
    """What the engine handed over for one id, and the records of its shares."""

    src_blocks: np.ndarray
    num_tokens: int
    expiry: float  # unix s; 0 = never (until Release)
    hold_end: float = 0.0  # unix s: renewals never move expiry past this; 0 = unbounded
    handover: bool = True  # no renewal yet: held until ``expiry``, the end of its hand-over hold
    owners: set = field(default_factory=set)  # peers whose KVRequests were accepted; empty = nobody yet
    consumers: int = 1  # shares to release before the blocks are free (the most any KVRequest said)
    ok: bool = True  # every released share reported success
    shares: dict[str, ShareRecord] = field(default_factory=dict)  # share key -> its record

    def may_claim(self, peer: str, consumers: int) -> bool:
        """``peer`` owns the id already, or there is room for one more owner."""
        return peer in self.owners or len(self.owners) < max(self.consumers, consumers)

    def share(self, key: str) -> ShareRecord:
        """The record of share ``key``, a new ``HELD`` one if it has none yet."""
        rec = self.shares.get(key)
        if rec is None:
            rec = self.shares[key] = ShareRecord(key)
        return rec

    def state(self, key: str) -> ShareState | None:
        rec = self.shares.get(key)
        return rec.state if rec is not None else None

    def in_flight(self) -> bool:
        """Some share has a KVRequest accepted and not yet done (its lease runs from KVReady)."""
        return any(s.in_flight for s in self.shares.values())

    def released(self) -> int:
        return sum(s.state is ShareState.RELEASED for s in self.shares.values())


class RequestTable:
    """The live requests (id -> :class:`RequestRecord`) and the last :data:`MAX_GONE`
    finished ids with why (``"released"`` or ``"expired"``)."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestRecord] = {}
        self.gone: collections.OrderedDict[str, str] = collections.OrderedDict()

    def get(self, rid: str) -> RequestRecord | None:
        return self.requests.get(rid)

    def forget(self, rid: str, why: str) -> None:
        """``rid`` is finished (``why``: released or expired): drop it, remember why."""
        self.requests.pop(rid, None)
        self.gone[rid] = why
        self.gone.move_to_end(rid)
        if len(self.gone) > MAX_GONE:
            self.gone.popitem(last=False)

    def shares(self):
        """Every live share record."""
        for req in self.requests.values():
            yield from req.shares.values()

    def count(self, states) -> int:
        return sum(s.state in states for s in self.shares())

    def kvready_out(self) -> int:
        """Shares whose KVReady is out and not released (``served_live``)."""
        return sum(s.kvready_out for s in self.shares())
