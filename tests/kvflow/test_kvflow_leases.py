"""Lease renewal and early release: the decode's heartbeat (LeaseKeeper ->
Renew) keeps a queued request's KV past ``lease_s``, bounded by ``max_hold_s``; one Renew
per prefill and interval; the prefill holds a request through its hand-over by itself
(``handover_s``) until a decode's first heartbeat; only the owner may renew or release a
claimed request; a control peer (the proxy) may release an unclaimed one but never
request KV nor renew. Every case ends with nothing held."""

from __future__ import annotations

import threading
import time

import pytest
from kvflow_helpers import BS, COMPAT, endpoints, wait_until

from vllm_hawk.kvflow import LeaseKeeper
from vllm_hawk.protocol import MAX_RENEW_IDS, KVRequest, ProtocolClient, RemoteError


def test_heartbeat_keeps_a_queued_request_past_its_lease():
    with endpoints(lease_s=1.0) as (_cache, pre, dec, _dev, _td, finished):
        pre.add_request("q", [1], BS)
        pre.add_request("nobody", [2], BS)  # not wanted: expires when its lease runs out
        keeper = LeaseKeeper(lambda _key: dec.ep, 0.2)
        try:
            assert keeper.want("prefill", "q")
            time.sleep(2.5)  # 2.5 leases
            snap = pre.snapshot()
            assert snap["requests"] == 1 and snap["expired"] == 1 and snap["renewed"] >= 2, snap
            assert finished == [("nobody", False)]
            dec.fetch("q", BS, [3], "staged", timeout_s=60.0)  # the first transform may compile kernels
            keeper.drop("q")
            assert keeper.wanted() == 0
        finally:
            keeper.close()
        assert finished == [("nobody", False), ("q", True)]
        assert pre.snapshot()["ring_used"] == 0 and pre.snapshot()["requests"] == 0


def test_renewal_is_bounded_by_max_hold_and_gone_ids_are_forgotten():
    with endpoints(lease_s=0.6, max_hold_s=1.2) as (_cache, pre, dec, _dev, _td, finished):
        pre.add_request("held", [1], BS)
        t0 = time.monotonic()
        keeper = LeaseKeeper(lambda _key: dec.ep, 0.1)
        try:
            keeper.want("prefill", "held")
            assert wait_until(lambda: finished == [("held", False)], 5.0), finished
            assert 1.1 < time.monotonic() - t0 < 2.5  # max_hold_s, not lease_s, nor never
            assert wait_until(lambda: keeper.wanted() == 0, 2.0)  # answered "gone"
            assert keeper.stats.gone == 1
        finally:
            keeper.close()
        assert pre.snapshot()["requests"] == 0


def test_one_renew_per_prefill_per_interval_in_bounded_chunks():
    n = MAX_RENEW_IDS + 100
    with endpoints(lease_s=60.0) as (_cache, pre, dec, _dev, _td, _finished):
        for i in range(3):
            pre.add_request(f"r{i}", [i], BS)
        keeper = LeaseKeeper(lambda _key: dec.ep, 3600.0)  # beats only when told
        try:
            for i in range(n):
                keeper.want("prefill", f"r{i}")
            before = pre.server.stats.by_type["Renew"]
            keeper.beat()
            assert pre.server.stats.by_type["Renew"] - before == 2  # ceil(n / MAX_RENEW_IDS) messages
            assert keeper.stats.heartbeats == 2 and keeper.stats.renewed == 3
            assert keeper.wanted() == n  # unknown ids may still be handed over: kept
        finally:
            keeper.close()
        for i in range(3):
            dec.client.release(f"r{i}")
        assert pre.snapshot()["requests"] == 0


def test_keeper_bounds_its_table():
    keeper = LeaseKeeper(lambda _key: None, 3600.0, max_wanted=2)
    try:
        assert keeper.want("a", "1") and keeper.want("b", "2")
        assert not keeper.want("a", "3") and keeper.stats.refused == 1
        keeper.drop("1")
        assert keeper.want("a", "3") and keeper.wanted() == 2
    finally:
        keeper.close()
    with pytest.raises(ValueError, match="interval_s"):
        LeaseKeeper(lambda _key: None, 0.0)


def test_unreachable_prefill_is_retried_not_fatal():
    calls = []

    def connect(key):
        calls.append(key)
        raise ConnectionError("down")

    keeper = LeaseKeeper(connect, 0.05)
    try:
        keeper.want("gone", "x")
        assert wait_until(lambda: keeper.stats.failed >= 3, 5.0)
        assert keeper.wanted() == 1
    finally:
        keeper.close()


def test_only_the_owner_renews_or_releases_a_claimed_request():
    with endpoints(lease_s=60.0) as (_cache, pre, dec, _dev, _td, finished):
        pre.add_request("mine", [1], BS)
        dec.fetch("mine", BS, [2], "staged", release=False)  # claimed by dec
        with ProtocolClient(pre.endpoint, COMPAT, timeout_s=5.0) as stranger:
            stranger.handshake()
            assert stranger.renew(["mine"]).renewed == 0
            assert pre.stats.refusals.snapshot().get("not_owner") == 1
            with pytest.raises(RemoteError, match="unknown_request"):
                stranger.release("mine")
        dec.client.release("mine")
        assert finished == [("mine", True)]


def test_control_peer_releases_an_unclaimed_request_but_cannot_request_kv():
    with endpoints(lease_s=60.0) as (_cache, pre, dec, _dev, _td, finished):
        pre.add_request("refused", [1], BS)
        pre.add_request("claimed", [2], BS)
        dec.fetch("claimed", BS, [3], "staged", release=False)
        with ProtocolClient(pre.endpoint, None, timeout_s=5.0) as proxy:
            proxy.handshake()
            with pytest.raises(RemoteError, match="control session"):
                proxy.call(KVRequest(req_id="refused", dst_layout=dec.desc, num_tokens=BS, dst_block_ids=[4]))
            with pytest.raises(RemoteError, match="only Release"):  # it has no lease to keep
                proxy.renew(["refused"])
            t0 = time.monotonic()
            proxy.release("refused", ok=False)
            assert finished == [("refused", False)] and time.monotonic() - t0 < 1.0
            with pytest.raises(RemoteError, match="unknown_request"):
                proxy.release("claimed")
        dec.client.release("claimed")
        assert pre.snapshot()["requests"] == 0 and pre.snapshot()["ring_used"] == 0


def test_full_ring_is_backpressure_not_failure():
    """A KVRequest refused for a full ring (no_space) is asked again until space frees."""
    with endpoints(claim_wait_s=0.2) as (_cache, pre, dec, _dev, _td, finished):
        pre.add_request("a", list(range(10)), 10 * BS)  # 640 KiB of the 1 MiB ring
        pre.add_request("b", list(range(10, 20)), 10 * BS)
        dec.fetch("a", 10 * BS, list(range(10)), "direct", release=False)
        done = {}
        t = threading.Thread(
            target=lambda: done.update(r=dec.fetch("b", 10 * BS, list(range(10, 20)), "direct", timeout_s=30.0))
        )
        t.start()
        assert wait_until(lambda: dec.ep.backpressured >= 2, 10.0)
        dec.client.release("a")
        t.join(30.0)
        assert "r" in done and sorted(finished) == [("a", True), ("b", True)]
        assert pre.snapshot()["ring_used"] == 0


def test_proxy_releaser_frees_an_unclaimed_request():
    import asyncio

    from vllm_hawk.proxy.release import PrefillReleaser, side_channels_of

    assert side_channels_of({"remote_host": "::1", "remote_port": 5, "remote_request_id": "x"}) == (
        ["tcp://[::1]:5"],
        "x",
    )
    assert side_channels_of(
        {"remote_host": "h", "remote_port": 5, "remote_request_id": "x", "remote_tp_size": 3, "remote_port_stride": 2}
    ) == (["tcp://h:5", "tcp://h:7", "tcp://h:9"], "x")
    assert side_channels_of({"remote_host": "h", "remote_port": True, "remote_request_id": "x"}) is None
    assert side_channels_of({"remote_host": "h", "remote_port": 5}) is None
    assert (
        side_channels_of({"remote_host": "h", "remote_port": 65535, "remote_request_id": "x", "remote_tp_size": 2})
        is None
    )  # rank 1 leaves the port range
    assert (
        side_channels_of({"remote_host": "h", "remote_port": 5, "remote_request_id": "x", "remote_tp_size": 65}) is None
    )
    with endpoints(lease_s=60.0) as (_cache, pre, _dec, _dev, _td, finished):
        pre.add_request("refused", [1], BS)
        port = int(pre.endpoint.rsplit(":", 1)[1])
        rel = PrefillReleaser(None, "none")
        try:
            params = {"remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "refused"}
            assert asyncio.run(rel.release(params))
            assert not asyncio.run(rel.release(params))  # already released: refused, counted
            assert (rel.released, rel.already, rel.failed) == (1, 1, 0)
        finally:
            rel.close()
        assert finished == [("refused", False)] and pre.snapshot()["requests"] == 0


def test_handover_hold_keeps_an_unrenewed_request_until_a_decode_claims_it():
    """With no renewal at all (a front such as vLLM's router renews nothing), a request is
    held ``handover_s`` after its hand-over, past several leases; one no decode takes up
    (the decode refused it) is freed at the hold's end, not at ``lease_s``."""
    with endpoints(lease_s=0.4, handover_s=2.0) as (_cache, pre, dec, _dev, _td, finished):
        t0 = time.monotonic()
        pre.add_request("handed", [1], BS)
        pre.add_request("refused", [2], BS)
        time.sleep(1.2)  # 3 leases into the hand-over
        assert pre.snapshot()["requests"] == 2 and finished == [], (pre.snapshot(), finished)
        dec.fetch("handed", BS, [3], "staged", timeout_s=60.0)  # the decode's engine took it up
        assert wait_until(lambda: ("refused", False) in finished, 10.0), finished
        assert time.monotonic() - t0 >= 2.0  # the hold's end, never earlier
        assert sorted(finished) == [("handed", True), ("refused", False)]
        assert pre.snapshot()["requests"] == 0 and pre.snapshot()["ring_used"] == 0


def test_first_heartbeat_ends_the_handover_hold():
    """Once a decode's heartbeat speaks for a request, ``lease_s`` governs it: a decode that
    stops renewing (it died) frees it a lease after its last heartbeat, long before the
    hand-over hold would have."""
    with endpoints(lease_s=0.5, handover_s=60.0) as (_cache, pre, dec, _dev, _td, finished):
        pre.add_request("q", [1], BS)
        keeper = LeaseKeeper(lambda _key: dec.ep, 0.1)
        try:
            keeper.want("prefill", "q")
            assert wait_until(lambda: pre.snapshot()["renewed"] >= 2, 5.0), pre.snapshot()
            keeper.drop("q")  # the decode's heartbeats stop
            assert wait_until(lambda: finished == [("q", False)], 10.0), finished  # not 60 s
        finally:
            keeper.close()
        assert pre.snapshot()["requests"] == 0 and pre.snapshot()["expired"] == 1


def test_proxy_does_not_handshake_at_every_beat_with_a_side_channel_it_cannot_reach():
    """A failed handshake (here: nobody listens) is not tried again for RETRY_AFTER_S: the
    next attempt fails at once, naming the endpoint."""
    import socket

    from vllm_hawk.proxy.release import PrefillReleaser

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    rel = PrefillReleaser(None, "none", timeout_s=0.3)
    try:
        for attempt in range(2):
            t0 = time.monotonic()
            with pytest.raises(Exception) as e:
                rel._client(endpoint)
            took = time.monotonic() - t0
            if attempt == 0:
                assert took >= 0.25, took  # a real handshake that timed out
            else:
                assert took < 0.05 and endpoint in str(e.value) and "shared secret" in str(e.value), (took, e.value)
    finally:
        rel.close()
