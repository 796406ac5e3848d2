"""The decode's side-channel pool (:class:`vllm_hawk.connector.peers.PeerPool`), with a
fake handshake: one endpoint per side channel, shared by concurrent pulls; a bounded
pool that counts its refusals; the lease keeper's handshake off its heartbeat thread."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from vllm_hawk.connector.peers import PeerPool
from vllm_hawk.kvflow import PeerFailed


class _Endpoint:
    def __init__(self, side_channel: str) -> None:
        self.side_channel, self.closed, self.released = side_channel, False, []

    def release(self, req_id, *, ok, timeout_s, share):
        self.released.append((req_id, share))

    def close(self) -> None:
        self.closed = True


class _Handshakes:
    """``connect`` for the pool: counts handshakes, may wait on ``gate`` or fail."""

    def __init__(self) -> None:
        self.count, self.gate, self.fail = 0, None, None

    def __call__(self, side_channel: str) -> _Endpoint:
        self.count += 1
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail is not None:
            raise self.fail
        return _Endpoint(side_channel)


def test_one_handshake_per_side_channel_shared_by_concurrent_pulls():
    hs = _Handshakes()
    hs.gate = threading.Event()
    pool = PeerPool(hs)
    got = []
    threads = [threading.Thread(target=lambda: got.append(pool.get("tcp://p:1", "e"))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    hs.gate.set()
    for t in threads:
        t.join(5)
    assert hs.count == 1 and len(got) == 4 and len({id(x) for x in got}) == 1
    assert pool.get("tcp://p:2", "e") is not got[0] and hs.count == 2
    assert {p.side_channel for p in pool.endpoints()} == {"tcp://p:1", "tcp://p:2"}


def test_a_full_pool_refuses_and_counts_each_refusal():
    refused = []
    pool = PeerPool(_Handshakes(), on_refused=lambda: refused.append(1), max_peers=2)
    pool.get("tcp://p:1", "e1")
    pool.get("tcp://p:2", "e2")
    with pytest.raises(
        PeerFailed,
        match="pull from prefill e3 at tcp://p:3 refused: this decode already talks "
        r"to 2 prefills \(kv_transfer_params name too many side channels\)",
    ):
        pool.get("tcp://p:3", "e3")
    assert refused == [1]
    pool.get("tcp://p:1", "e1")  # an open side channel is no new peer
    assert refused == [1]


def test_a_failed_handshake_names_the_prefill_and_is_retried_at_the_next_get():
    hs = _Handshakes()
    hs.fail = OSError("connection refused")
    pool = PeerPool(hs)
    with pytest.raises(PeerFailed, match="handshake with prefill e at tcp://p:1 failed: connection refused"):
        pool.get("tcp://p:1", "e")
    hs.fail = None
    assert pool.get("tcp://p:1", "e").side_channel == "tcp://p:1" and hs.count == 2


def test_the_keeper_handshakes_on_its_own_thread_and_raises_until_done():
    hs = _Handshakes()
    hs.gate = threading.Event()
    pool = PeerPool(hs)
    pool.note_engine("tcp://p:1", "prefill-7")
    for _ in range(3):  # one handshake, however often the keeper asks meanwhile
        with pytest.raises(PeerFailed, match=r"no side channel to prefill prefill-7 at tcp://p:1 yet \(connecting\)"):
            pool.for_keeper("tcp://p:1")
    hs.gate.set()
    deadline = time.monotonic() + 5
    while not pool.endpoints() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.for_keeper("tcp://p:1").side_channel == "tcp://p:1" and hs.count == 1


def test_release_is_delivered_or_logged_and_close_closes_every_endpoint(caplog):
    hs = _Handshakes()
    pool = PeerPool(hs)
    pool.release("tcp://p:1", "e", "req-1", rank=0, share="whole", timeout_s=1.0)
    (ep,) = pool.endpoints()
    assert ep.released == [("req-1", "whole")]
    hs.fail = OSError("down")
    # vLLM's logging config (once any test imported vllm) stops "vllm.*" records from
    # propagating to the root logger, where caplog listens: listen on the logger itself.
    log = logging.getLogger("vllm.hawk.worker")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.hawk.worker"):
            pool.release("tcp://p:2", "e", "req-1", rank=1, share="whole", timeout_s=1.0)  # logged, not raised
    finally:
        log.removeHandler(caplog.handler)
    assert "release of req-1 on prefill rank 1 not delivered" in caplog.text
    pool.close()
    assert ep.closed and pool.endpoints() == []
