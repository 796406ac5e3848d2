"""The prefill's request ledger (:mod:`vllm_hawk.kvflow.ledger`), with no socket, ring or
thread: every legal move of the share life cycle
(:data:`~vllm_hawk.kvflow.lifecycle.LEGAL_MOVES`) made through the ledger's public
methods, and every decode message the table has no move for refused with its wire error
code, leaving the share as it was. The moves and states are taken from the table, so a
new state or edge fails here until it has a driver and a row."""

from __future__ import annotations

import collections

import pytest

from vllm_hawk.kvflow.early import HAND_OVER_STEPS
from vllm_hawk.kvflow.ledger import (
    BAD_ID,
    CLOSING,
    DROPPED,
    Cancelled,
    Ledger,
    Notify,
    Outcome,
    Serve,
    Wait,
)
from vllm_hawk.kvflow.lifecycle import LEGAL_MOVES, Refusal, ShareState, share_key
from vllm_hawk.protocol import KVRequest, LayoutDesc, Release
from vllm_hawk.protocol.messages import ERROR_CODES

S = ShareState
RID, OWNER, STRANGER = "r", "d", "x"
LEASE_S, HANDOVER_S = 60.0, 30.0
LAYOUT = LayoutDesc(
    name="t",
    dtype="bfloat16",
    block_size=32,
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    num_banks=2,
    tile_nbytes=2048,
    page_nbytes=2048,
)


def kvreq(*, group: int | None = 0, share: int = 0, consumers: int = 1, rid: str = RID) -> KVRequest:
    """A KVRequest for both blocks of ``rid``: layer group ``group`` (layers 2g, 2g+1) or,
    with None, all layers."""
    layers = {} if group is None else {"first_layer": 2 * group, "num_layers": 2}
    return KVRequest(
        req_id=rid, dst_layout=LAYOUT, num_tokens=64, dst_block_ids=[7, 8], share=share, consumers=consumers, **layers
    )


class Walk:
    """One ledger and request ``RID``, whose share 0 is the share walked."""

    def __init__(self) -> None:
        self.led = Ledger(block_size=32, lease_s=LEASE_S, handover_s=HANDOVER_S, max_hold_s=600.0)
        self.now, self.mono = 1_000.0, 500.0
        self._rec = None  # the share's record, kept once seen (a finished one leaves the table)

    def state(self) -> ShareState:
        req = self.led.table.get(RID)
        if req is not None:
            if RID not in req.shares:
                return S.HELD  # handed over, no record yet: held
            self._rec = req.shares[RID]
        elif self.led.early.waiting(RID):
            return S.PARKED
        if self._rec is None:  # finished before it had a record
            return {"released": S.RELEASED, "expired": S.EXPIRED}[self.led.table.gone[RID]]
        return self._rec.state

    def rec(self):
        self.state()
        return self._rec

    def hand_over(self) -> Outcome:
        return self.led.hand_over(RID, [1, 2], 64, None, self.now)

    def admit(self, msg: KVRequest, peer: str = OWNER):
        return self.led.admit(peer, msg, reply=f"reply-{peer}")

    def release(self, peer: str = OWNER, share: int = 0, ok: bool = True) -> Outcome:
        return self.led.release(peer, Release(req_id=RID, share=share, ok=ok))

    def serve_sibling(self) -> None:
        """Share 1 of the request is served: its KVReady's lease now runs."""
        assert isinstance(self.admit(kvreq(group=None, share=1, consumers=2)), Serve)
        req = self.led.table.get(RID)
        assert self.led.served(req.shares[share_key(RID, 1)], self.mono) is None


# --------------------------------------------------------------------------- the moves
def _parked_held(w: Walk) -> None:
    out = w.hand_over()
    assert [(m.req_id, p) for m, _r, p in out.arrivals] == [(RID, OWNER)] and not out.notify


def _parked_expired(w: Walk) -> None:
    rec = None
    for _ in range(HAND_OVER_STEPS):  # the hand-over would have come by now
        out = w.led.step()
        rec = rec or (out.late and out.late[0][1].shares[RID])
    assert rec and [m.req_id for m, _r, _p in out.late[0][1].arrivals] == [RID]
    w._rec = rec


def _held_serving(w: Walk) -> None:
    assert w.admit(kvreq()) == Serve(RID)


def _held_released(w: Walk) -> None:
    assert w.release() == Outcome(free=(RID,), notify=(Notify(RID, True),))


def _held_expired(w: Walk) -> None:
    assert w.led.expire(w.now + HANDOVER_S - 1, w.mono).notify == ()  # the hand-over hold still runs
    out = w.led.expire(w.now + HANDOVER_S + 1, w.mono)
    assert out.notify == (Notify(RID, False),) and RID in out.free


def _serving_served(w: Walk) -> None:
    assert w.led.served(w.rec(), w.mono) is None


def _serving_cancelled(w: Walk) -> None:
    assert w.release(ok=False) == Outcome()  # Ack; the worker frees it


def _serving_held(w: Walk) -> None:
    f = w.led.failed(kvreq(), w.led.table.get(RID), w.rec())
    assert f.free == (RID,) and not f.cancelled and not f.quiet


def _sibling_lapses(w: Walk) -> None:
    """A sibling share's KVReady outlives its lease: every share of the request expires."""
    w.serve_sibling()
    assert w.led.expire(w.now, w.mono + LEASE_S - 1).notify == ()
    out = w.led.expire(w.now, w.mono + LEASE_S + 1)
    assert out.notify == (Notify(RID, False),) and set(out.free) == {RID, share_key(RID, 1)}


def _served_serving(w: Walk) -> None:
    assert w.admit(kvreq(group=1)) == Serve(RID)  # the next layer group


def _served_released(w: Walk) -> None:
    assert w.release() == Outcome(free=(RID,), notify=(Notify(RID, True),))


def _served_expired(w: Walk) -> None:
    assert w.led.expire(w.now, w.mono + LEASE_S - 1).notify == ()
    assert w.led.expire(w.now, w.mono + LEASE_S + 1).notify == (Notify(RID, False),)


def _cancelled_released(w: Walk) -> None:
    assert w.led.served(w.rec(), w.mono) == Cancelled()  # the worker sees the cancel
    f = w.led.failed(kvreq(), w.led.table.get(RID), w.rec())
    assert f.cancelled and not f.quiet and f.free == (RID,) and f.notify == Notify(RID, False)


MOVES = {
    (S.PARKED, S.HELD): _parked_held,
    (S.PARKED, S.EXPIRED): _parked_expired,
    (S.HELD, S.SERVING): _held_serving,
    (S.HELD, S.RELEASED): _held_released,
    (S.HELD, S.EXPIRED): _held_expired,
    (S.SERVING, S.SERVED): _serving_served,
    (S.SERVING, S.CANCELLED): _serving_cancelled,
    (S.SERVING, S.HELD): _serving_held,
    (S.SERVING, S.EXPIRED): _sibling_lapses,
    (S.SERVED, S.SERVING): _served_serving,
    (S.SERVED, S.RELEASED): _served_released,
    (S.SERVED, S.EXPIRED): _served_expired,
    (S.CANCELLED, S.RELEASED): _cancelled_released,
    (S.CANCELLED, S.EXPIRED): _sibling_lapses,
}
EDGES = sorted(((a, b) for a, nxt in LEGAL_MOVES.items() for b in nxt), key=lambda e: (e[0].value, e[1].value))


def reach(state: ShareState) -> Walk:
    """A walk whose share is in ``state``: parked by a first KVRequest, or handed over and
    then moved along the shortest path of :data:`MOVES`."""
    w = Walk()
    if state is S.PARKED:
        assert w.admit(kvreq()) == Wait()
        return w
    w.hand_over()
    prev, todo = {S.HELD: None}, collections.deque([S.HELD])
    while todo:
        a = todo.popleft()
        for frm, to in MOVES:
            if frm is a and to not in prev:
                prev[to] = a
                todo.append(to)
    path, s = [], state
    while prev[s] is not None:
        path.append((prev[s], s))
        s = prev[s]
    for edge in reversed(path):
        MOVES[edge](w)
        assert w.state() is edge[1]
    return w


def test_every_edge_of_the_table_has_a_move():
    assert set(MOVES) == set(EDGES)


@pytest.mark.parametrize("edge", EDGES, ids=lambda e: f"{e[0].value}->{e[1].value}")
def test_every_legal_move_through_the_ledger(edge):
    frm, to = edge
    w = reach(frm)
    assert w.state() is frm
    MOVES[edge](w)
    assert w.state() is to


# --------------------------------------------------------------------------- the decode's messages
MESSAGES = {
    "kvrequest": lambda w: w.admit(kvreq(group=None)),  # the whole request
    "group_again": lambda w: w.admit(kvreq(group=0)),
    "next_group": lambda w: w.admit(kvreq(group=1)),
    "release": lambda w: w.release(),
    "stranger_kvrequest": lambda w: w.admit(kvreq(group=0), peer=STRANGER),
    "stranger_release": lambda w: w.release(peer=STRANGER),
}
# Per state (the share asked for as layer groups, group 0 first): the state each message
# leads to (a legal move, or the same state), or the wire code it is refused with.
EXPECT = {
    S.PARKED: {
        "kvrequest": "bad_message",
        "group_again": "bad_message",
        "next_group": S.PARKED,  # parked with the first
        "release": S.PARKED,  # remembered until the hand-over
        "stranger_kvrequest": "bad_message",
        "stranger_release": S.PARKED,
    },
    S.HELD: {
        "kvrequest": S.SERVING,
        "group_again": S.SERVING,
        "next_group": S.SERVING,
        "release": S.RELEASED,
        "stranger_kvrequest": S.SERVING,  # unclaimed: any decode may claim it
        "stranger_release": S.RELEASED,  # unclaimed: the proxy may free it
    },
    S.SERVING: {
        "kvrequest": "bad_message",
        "group_again": "bad_message",
        "next_group": S.SERVING,
        "release": S.CANCELLED,
        "stranger_kvrequest": "unknown_request",
        "stranger_release": "unknown_request",
    },
    S.SERVED: {
        "kvrequest": "bad_message",
        "group_again": "bad_message",
        "next_group": S.SERVING,
        "release": S.RELEASED,
        "stranger_kvrequest": "unknown_request",
        "stranger_release": "unknown_request",
    },
    S.CANCELLED: {
        "kvrequest": "bad_message",
        "group_again": "bad_message",
        "next_group": "bad_message",
        "release": S.CANCELLED,  # acknowledged; the worker finishes the cancel
        "stranger_kvrequest": "unknown_request",
        "stranger_release": "unknown_request",
    },
    S.RELEASED: {
        "kvrequest": "unknown_request",
        "group_again": "unknown_request",
        "next_group": "unknown_request",
        "release": "unknown_request",
        "stranger_kvrequest": "unknown_request",
        "stranger_release": "unknown_request",
    },
    S.EXPIRED: {
        "kvrequest": "expired",
        "group_again": "expired",
        "next_group": "expired",
        "release": "unknown_request",
        "stranger_kvrequest": "expired",
        "stranger_release": "unknown_request",
    },
}


def test_every_state_has_a_row_for_every_message():
    assert set(EXPECT) == set(S)
    assert all(set(row) == set(MESSAGES) for row in EXPECT.values())


@pytest.mark.parametrize("state,message", [(s, m) for s in S for m in MESSAGES], ids=lambda v: getattr(v, "value", v))
def test_every_message_moves_legally_or_is_refused_with_its_code(state, message):
    w = reach(state)
    out = MESSAGES[message](w)
    refusal = out.refusal if isinstance(out, Outcome) else out if isinstance(out, Refusal) else None
    want = EXPECT[state][message]
    if isinstance(want, ShareState):
        assert refusal is None, refusal
        assert want is state or want in LEGAL_MOVES[state]
        assert w.state() is want
    else:
        assert refusal is not None and refusal.code == want and want in ERROR_CODES, out
        assert w.state() is state  # a refusal changes nothing


# --------------------------------------------------------------------------- the rest of the decisions
def test_refusals_that_move_nothing():
    w = Walk()
    assert w.admit(kvreq(rid="a\x00b")) == BAD_ID
    assert w.led.admit(OWNER, kvreq(), None, closing=True) == CLOSING  # nothing parked while closing
    assert w.led.interrupt(None) == DROPPED
    w.hand_over()
    bad = kvreq(group=2)  # layers 4..5 of 4
    out = w.admit(bad)
    assert out.code == "layout_mismatch" and "not inside the 4 layers" in out.detail
    assert w.led.stats.refused == 1 and w.state() is S.HELD


def test_a_queue_that_is_gone_undoes_the_accept():
    w = reach(S.SERVING)
    assert w.led.unqueue(kvreq()) == CLOSING and w.state() is S.HELD


def test_renew_moves_a_held_requests_expiry_and_names_strangers():
    w = reach(S.HELD)
    req = w.led.table.get(RID)
    r = w.led.renew(OWNER, [RID, "never", "gone"], w.now + 1)
    assert (r.renewed, r.gone, r.refusal) == (1, [], None) and req.expiry == w.now + 1 + LEASE_S
    w.led.table.forget("gone", "released")
    assert w.led.renew(OWNER, ["gone"], w.now).gone == ["gone"]
    _held_serving(w)  # claimed by OWNER: its lease runs from KVReady
    r = w.led.renew(STRANGER, [RID], w.now + 2)
    assert r.renewed == 0 and r.refusal.reason == "not_owner" and r.refusal.code == "unknown_request"
    assert w.led.renew(OWNER, [RID], w.now + 2).renewed == 0  # in flight


def test_an_early_release_finishes_the_hand_over():
    w = Walk()
    assert w.release() == Outcome()  # remembered
    assert w.hand_over() == Outcome(notify=(Notify(RID, True),))
    assert w.state() is S.RELEASED and w.led.counts()["released"] == 1


def test_a_failed_group_of_a_cancelled_share_leaves_the_cancel_to_the_last():
    w = reach(S.SERVING)
    assert w.admit(kvreq(group=1)) == Serve(RID)
    w.release()
    assert w.state() is S.CANCELLED
    f = w.led.failed(kvreq(group=0), w.led.table.get(RID), w.rec())
    assert f.quiet and f.free == () and w.state() is S.CANCELLED
    f = w.led.failed(kvreq(group=1), w.led.table.get(RID), w.rec())
    assert not f.quiet and f.free == (RID,) and w.state() is S.RELEASED
    assert w.led.counts()["cancelled"] == 1
