"""The prefill's share life cycle (:mod:`vllm_hawk.kvflow.lifecycle`) and its early
arrivals (:mod:`vllm_hawk.kvflow.early`): the transition table, the records, the bounds."""

from __future__ import annotations

import itertools
import time

import msgspec
import numpy as np
import pytest

from vllm_hawk.kvflow import early as early_mod
from vllm_hawk.kvflow.early import EarlyArrivals
from vllm_hawk.kvflow.lifecycle import (
    LEGAL_MOVES,
    MAX_GONE,
    IllegalTransition,
    RequestRecord,
    RequestTable,
    ShareRecord,
    ShareState,
    share_key,
)
from vllm_hawk.protocol import KVRequest, LayoutDesc

S = ShareState
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


def _walk(*states: ShareState, start: ShareState = S.HELD) -> ShareRecord:
    rec = ShareRecord("r", start)
    for to in states:
        rec.move(to)
        assert rec.state is to
    return rec


@pytest.mark.parametrize(
    "path",
    [
        (S.HELD, S.SERVING, S.SERVED, S.RELEASED),  # parked: the hand-over came, served, released
        (S.HELD, S.SERVING, S.CANCELLED, S.RELEASED),  # Release before KVReady; the worker freed it
        (S.HELD, S.EXPIRED),  # a parked share whose request's lease ran out unasked
        (S.EXPIRED,),  # the hand-over never came
        (S.HELD, S.SERVING, S.SERVED, S.SERVING, S.SERVED, S.EXPIRED),  # layer groups, then lease
        (S.HELD, S.SERVING, S.HELD, S.SERVING, S.SERVED, S.RELEASED),  # a failed serve, then a retry
        (S.HELD, S.SERVING, S.EXPIRED),
        (S.HELD, S.SERVING, S.CANCELLED, S.EXPIRED),
        (S.HELD, S.RELEASED),  # released unasked (the decode had the prefix)
    ],
)
def test_every_legal_path_from_parked(path):
    assert _walk(*path, start=S.PARKED).state is path[-1]


def test_held_paths():
    assert _walk(S.SERVING, S.SERVED, S.RELEASED).state is S.RELEASED
    assert _walk(S.EXPIRED).state is S.EXPIRED
    assert _walk(S.SERVING, S.SERVED, S.EXPIRED).state is S.EXPIRED


def test_illegal_move_names_both_states_and_changes_nothing():
    rec = _walk(S.SERVING, S.SERVED)
    with pytest.raises(IllegalTransition, match=r"share 'r': served -> parked is not a legal move"):
        rec.move(S.PARKED)
    assert rec.state is S.SERVED


@pytest.mark.parametrize("frm,to", [(a, b) for a, b in itertools.product(S, S) if b not in LEGAL_MOVES[a]])
def test_every_move_outside_the_table_is_refused(frm, to):
    rec = ShareRecord("k", frm)
    with pytest.raises(IllegalTransition) as e:
        rec.move(to)
    assert f"{frm.value} -> {to.value}" in str(e.value)
    assert rec.state is frm


def test_table_shape():
    assert set(LEGAL_MOVES) == set(S)
    assert LEGAL_MOVES[S.RELEASED] == LEGAL_MOVES[S.EXPIRED] == frozenset()  # terminal
    assert all(S.PARKED not in nxt for nxt in LEGAL_MOVES.values())  # only a new record is parked
    for frm in set(S) - {S.RELEASED, S.EXPIRED}:  # every live state can end
        assert S.EXPIRED in LEGAL_MOVES[frm]


def test_records_and_table():
    req = RequestRecord(np.arange(2), 40, expiry=0.0)
    assert req.share("r").state is S.HELD and not req.in_flight()
    req.share("r").move(S.SERVING)
    assert req.in_flight() and req.state("r") is S.SERVING and req.state("x") is None
    rec = req.share(share_key("r", 1))
    assert rec.key == "r\x00s1" and share_key("r") == "r"
    rec.move(S.RELEASED)
    assert req.released() == 1
    req.shares["r"].move(S.SERVED)
    req.shares["r"].served_at = 1.0
    assert req.shares["r"].kvready_out

    table = RequestTable()
    table.requests["r"] = req
    assert table.kvready_out() == 1 and table.count({S.SERVED, S.RELEASED}) == 2
    for i in range(MAX_GONE + 1):
        table.forget(f"g{i}", "expired")
    assert len(table.gone) == MAX_GONE and "g0" not in table.gone
    table.forget("r", "released")
    assert table.get("r") is None and table.gone["r"] == "released"


def _kvreq(
    rid: str, *, share: int = 0, consumers: int = 1, first_layer: int = 0, num_layers: int = 0, ids=(1,)
) -> KVRequest:
    return KVRequest(
        req_id=rid,
        dst_layout=LAYOUT,
        num_tokens=32 * len(ids),
        dst_block_ids=list(ids),
        share=share,
        consumers=consumers,
        first_layer=first_layer,
        num_layers=num_layers,
    )


def test_early_arrivals_park_join_take():
    ea = EarlyArrivals()
    assert ea.park("d1", _kvreq("a", num_layers=2), "r0") is None
    assert ea.join("d1", _kvreq("a", first_layer=2, num_layers=2), "r1") is None  # a further group
    dup = ea.join("d1", _kvreq("a", num_layers=2), "r2")
    assert dup == ("", "bad_message", "request already in flight")
    assert ea.join("d2", _kvreq("a", first_layer=2, num_layers=2), "r3").code == "bad_message"  # another peer
    assert ea.join("d2", _kvreq("a", share=1), "r4").reason == "not_owner"  # one consumer only
    assert len(ea) == 1 and ea.block_ids == 2 and ea.waiting("a")
    parked = ea.take("a")
    assert [r for _m, r, _p in parked.arrivals] == ["r0", "r1"]
    assert [s.state for s in parked.shares.values()] == [S.PARKED]
    assert ea.block_ids == 0 and not ea.waiting("a") and ea.take("a") is None


def test_early_arrivals_bounds(monkeypatch):
    monkeypatch.setattr(early_mod, "MAX_EARLY", 2)
    monkeypatch.setattr(early_mod, "MAX_EARLY_BLOCK_IDS", 3)
    ea = EarlyArrivals()
    assert ea.park("d", _kvreq("a", ids=(1, 2)), None) is None
    full = ea.join("d", _kvreq("a", share=1, consumers=2, ids=(3, 4)), None)
    assert full.reason == "early_full" and "already hold 2 block ids" in full.detail
    assert ea.park("d", _kvreq("b"), None) is None
    full = ea.park("d", _kvreq("c"), None)
    assert full.reason == "early_full" and "2 early requests (3 block ids)" in full.detail
    assert not ea.remember_release("x") and not ea.remember_release("y")
    assert ea.remember_release("z") and ea.releases() == 2  # the oldest is forgotten
    assert not ea.take_release("x") and ea.take_release("z")


def test_early_wait_is_the_kvrequests_own_deadline_within_bounds():
    """A KVRequest that beats the hand-over waits until its deadline (the decode's pull
    deadline), at least EARLY_REQUEST_WAIT_S and at most EARLY_REQUEST_MAX_WAIT_S."""
    now = 1_000_000.0

    def wait(left_s):
        msg = msgspec.structs.replace(_kvreq("a"), deadline_ms=int((now + left_s) * 1000))
        return early_mod.early_wait_s(msg, now)

    assert wait(20.0) == pytest.approx(20.0 - early_mod.EARLY_REPLY_MARGIN_S)
    assert wait(0.5) == early_mod.EARLY_REQUEST_WAIT_S  # a near (or skewed) deadline
    assert wait(-100.0) == early_mod.EARLY_REQUEST_WAIT_S
    assert wait(3600.0) == early_mod.EARLY_REQUEST_MAX_WAIT_S
    assert early_mod.early_wait_s(_kvreq("a"), now) == early_mod.EARLY_REQUEST_MAX_WAIT_S  # no deadline


def test_early_arrivals_expire_each_at_its_own_deadline():
    """Parked ids expire by their own deadlines, not in arrival order."""
    ea = EarlyArrivals()
    t = time.time()
    ea.park("d", msgspec.structs.replace(_kvreq("late"), deadline_ms=int((t + 50) * 1000)), None)
    ea.park("d", msgspec.structs.replace(_kvreq("soon"), deadline_ms=int((t + 10) * 1000)), None)
    mono = time.monotonic()
    assert ea.expire(mono + 30) and ea.waiting("late") and not ea.waiting("soon")
    assert [rid for rid, _p in ea.expire(mono + 70)] == ["late"] and len(ea) == 0


def test_early_arrivals_expire():
    ea = EarlyArrivals()
    ea.park("d", _kvreq("a"), None)
    ea.remember_release("x")
    assert ea.expire(0.0) == [] and len(ea) == 1
    late = ea.expire(float("inf"))
    assert [rid for rid, _p in late] == ["a"] and late[0][1].shares["a"].state is S.EXPIRED
    assert len(ea) == 0 and ea.block_ids == 0 and ea.releases() == 0


def test_an_id_never_handed_over_is_unknown_after_the_hand_over_steps():
    """Ids are answered unknown once HAND_OVER_STEPS engine steps began since they were
    asked for, each counted from its own arrival."""
    ea = EarlyArrivals()
    ea.park("d", _kvreq("a"), None, step=5)
    ea.park("d", _kvreq("b"), None, step=6)
    assert ea.overdue(5 + early_mod.HAND_OVER_STEPS - 1) == []
    assert [rid for rid, _p in ea.overdue(5 + early_mod.HAND_OVER_STEPS)] == ["a"]
    late = ea.overdue(6 + early_mod.HAND_OVER_STEPS)
    assert [rid for rid, _p in late] == ["b"] and late[0][1].shares["b"].state is S.EXPIRED
    assert len(ea) == 0 and ea.block_ids == 0
