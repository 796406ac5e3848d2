"""Failure paths of Algorithm 1 inside one process (in-process transport): cancels,
leases, batches that fail or never drain, restarts, constructors that fail half way,
hostile layouts. Every case ends with nothing held on either side."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
import zmq
from kvflow_helpers import BS, COMPAT, D, H, L, assert_pool_holds, endpoints, wait_until

import vllm_hawk.kvflow.decode as decode_mod
import vllm_hawk.kvflow.sources as sources_mod
from vllm_hawk.bench.endpoints import TTDecode, VllmDecode, prefill_endpoint
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.kvflow import KVPageAddresses, PeerFailed, TransferUnsettled
from vllm_hawk.layout.interleave import OutOfDeviceMemory
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.bank_buffer import BankBufferError
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import KVRequest, RemoteError
from vllm_hawk.transport import TransferHandle, make_transport


def fake_submit(td, monkeypatch, *, fail: bool, settle_after: float | None):
    """Replace ``td.submit`` with one whose batches never move: failed at once (or never
    done), settled after ``settle_after`` seconds (None = never). Returns the handles."""
    handles = []

    def submit(kind, peer, entries):
        h = TransferHandle(kind=kind, peer=peer, num_entries=len(entries), total_nbytes=sum(e[2] for e in entries))
        if fail:
            h.finish_failed("injected failure")
        if settle_after == 0:
            h.settled.set()
        elif settle_after is not None:
            threading.Timer(settle_after, h.settled.set).start()
        handles.append(h)
        return h

    monkeypatch.setattr(td, "submit", submit)
    return handles


# --------------------------------------------------------------------------- cancel before KVReady
def test_release_before_kvready_cancels_and_frees_the_ring_at_once(monkeypatch):
    from vllm_hawk.kvflow.lifecycle import ShareState

    real, go = sources_mod.transform_source, threading.Event()

    def slow_transform(*a, **k):
        go.wait(30.0)  # until the decode's Release has cancelled the share
        return real(*a, **k)

    def cancelled() -> bool:
        with pre._lock:
            return pre._table.count({ShareState.CANCELLED}) == 1

    monkeypatch.setattr(sources_mod, "transform_source", slow_transform)
    with endpoints(lease_s=60.0) as (_cache, pre, dec, _dev, _td, finished):
        pre.add_request("slow", [1, 2], 2 * BS)
        with pytest.raises(PeerFailed, match="no reply"):
            dec.fetch("slow", 2 * BS, [3, 4], "staged", timeout_s=0.3)  # gives up mid-transform
        assert wait_until(cancelled, 10.0)
        go.set()
        # The Release(ok=False) reached the prefill before its KVReady: the range is freed
        # as soon as the transform ends, not after the 60 s lease; on_finished comes last.
        assert wait_until(lambda: finished == [("slow", False)], 10.0), finished
        assert wait_until(lambda: pre.snapshot()["pending"] == 0, 10.0), pre.snapshot()
        snap = pre.snapshot()
        assert snap["ring_used"] == 0 and snap["ring_live"] == 0 and snap["served_live"] == 0, snap
        assert snap["cancelled"] == 1 and snap["served"] == 0 and snap["requests"] == 0, snap
        assert dec.pool.is_idle()


# --------------------------------------------------------------------------- lease bounds the read
def test_read_deadline_is_capped_by_the_prefill_lease(monkeypatch):
    with endpoints(lease_s=1.0) as (_cache, pre, dec, _dev, td, _finished):
        pre.add_request("lease", [1], BS)
        fake_submit(td, monkeypatch, fail=False, settle_after=0)  # a READ that never finishes
        t0 = time.monotonic()
        with pytest.raises(PeerFailed, match="lease of 1000 ms"):
            dec.fetch("lease", BS, [2], "staged", timeout_s=30.0)
        assert time.monotonic() - t0 < 15.0  # the lease (1 s), not the 30 s timeout, bounded the read
        assert dec.pool.is_idle()
        assert wait_until(lambda: pre.snapshot()["ring_used"] == 0, 5.0)


def test_release_after_lease_expiry_says_the_kv_may_be_corrupt(monkeypatch):
    with endpoints(lease_s=1.0) as (_cache, pre, dec, dev, _td, finished):
        pre.add_request("late", [1], BS)
        real_copy = dev.copy_in_bank

        def slow_copy(*a):
            real_copy(*a)
            wait_until(lambda: pre.snapshot()["expired"] == 1, 10.0)  # the lease runs out meanwhile

        monkeypatch.setattr(dev, "copy_in_bank", slow_copy)
        with pytest.raises(PeerFailed, match=r"lease of 1000 ms ran out.*may be corrupt"):
            dec.fetch("late", BS, [2], "staged", timeout_s=30.0)
        # the engine hears (on_finished) that the request's blocks are free
        assert wait_until(lambda: finished == [("late", False)], 5.0), finished
        snap = pre.snapshot()
        assert snap["ring_used"] == 0 and snap["requests"] == 0 and snap["expired"] == 1, snap
        assert dec.pool.is_idle()


# --------------------------------------------------------------------------- lease expiry reaches the engine
def test_lease_expiry_tells_the_engine():
    with endpoints(lease_s=1.0) as (_cache, pre, dec, _dev, _td, finished):
        pre.add_request("held", [1], BS)
        dec.fetch("held", BS, [2], "staged", release=False)
        assert wait_until(lambda: finished == [("held", False)], 10.0), finished
        assert pre.snapshot()["ring_used"] == 0 and pre.snapshot()["requests"] == 0


# --------------------------------------------------------------------------- batches that fail or never drain
@pytest.mark.parametrize("mode", ["direct", "per_tile"])
def test_failed_direct_fetch_returns_only_after_its_reads_drained(monkeypatch, mode):
    with endpoints() as (_cache, pre, dec, _dev, td, _finished):
        pre.add_request("d", [1, 2], 2 * BS)
        handles = fake_submit(td, monkeypatch, fail=True, settle_after=0.3)
        with pytest.raises(PeerFailed, match="injected failure") as ei:
            dec.fetch("d", 2 * BS, [3, 4], mode, timeout_s=10.0)
        assert not isinstance(ei.value, TransferUnsettled)
        assert handles and all(h.settled.is_set() for h in handles)  # nothing can still write the pages
        assert wait_until(lambda: pre.snapshot()["ring_used"] == 0, 5.0)


@pytest.mark.parametrize("mode", ["direct", "per_tile"])
def test_failed_direct_fetch_that_never_drains_names_the_unsafe_blocks(monkeypatch, mode):
    monkeypatch.setattr(decode_mod, "SETTLE_WAIT_S", 0.2)
    with endpoints() as (_cache, pre, dec, _dev, td, _finished):
        pre.add_request("u", [1, 2], 2 * BS)
        fake_submit(td, monkeypatch, fail=True, settle_after=None)
        with pytest.raises(TransferUnsettled, match=r"destination blocks \[5, 3\]") as ei:
            dec.fetch("u", 2 * BS, [5, 3], mode, timeout_s=10.0)
        assert ei.value.unsafe_blocks == (5, 3)
        assert wait_until(lambda: pre.snapshot()["ring_used"] == 0, 5.0)


def test_staged_receive_buffers_of_a_batch_that_never_settles_stay_quarantined(monkeypatch):
    monkeypatch.setattr(decode_mod, "SETTLE_LIMIT_S", 0.3)
    with endpoints() as (_cache, pre, dec, _dev, td, _finished):
        pre.add_request("q", [1], BS)
        handles = fake_submit(td, monkeypatch, fail=True, settle_after=None)
        t0 = time.monotonic()
        with pytest.raises(PeerFailed, match="injected failure"):
            dec.fetch("q", BS, [2], "staged", timeout_s=10.0)
        # no wait for the batch in the foreground beyond SETTLE_WAIT_S (+ Release round trip)
        assert time.monotonic() - t0 < 10.0
        assert wait_until(lambda: dec.pending_frees() == 0, 10.0)  # the background wait is bounded
        assert dec.quarantined == ["q"] and dec.pool.live() == ["q"]  # never handed out again
        handles[0].settled.set()
        assert not any(t.name.startswith("hawk-free-") for t in threading.enumerate())


# --------------------------------------------------------------------------- constructors that fail half way
def test_decode_endpoint_frees_its_kv_pool_when_the_receive_pool_does_not_fit():
    dev = EmulatedDevice("p150a", 1 << 20)
    td = make_transport("inprocess")
    try:
        with pytest.raises(OutOfDeviceMemory):
            TTDecode(
                dev,
                TTKVCacheSpec(L, 8, H, BS, D, "bfloat16"),
                td,
                "tcp://127.0.0.1:1",
                COMPAT,
                recv_nbytes_per_bank=4 << 20,
            )
        assert dev.live_buffers() == [] and len(td._regions) == 0
    finally:
        td.close()


# --------------------------------------------------------------------------- prefill restart
def test_fetch_after_the_prefill_restarts_uses_the_new_ring():
    cache = PagedKVCache(L, 48, H, BS, D).fill_random(9)
    tp1, td = make_transport("inprocess"), make_transport("inprocess")
    pre1 = prefill_endpoint(cache, tp1, COMPAT, ring_nbytes=1 << 20)
    dev = EmulatedDevice("p150a", 8 << 20)
    dec = TTDecode(
        dev,
        TTKVCacheSpec(L, 16, H, BS, D, "bfloat16"),
        td,
        pre1.endpoint,
        COMPAT,
        recv_nbytes_per_bank=128 << 10,
        timeout_s=10,
    )
    tp2 = pre2 = None
    try:
        pre1.add_request("a", [1], BS)
        dec.fetch("a", BS, [2], "staged")
        old = (dec.peer, dec.export_base)
        pre1.close()
        tp1.close()
        tp2 = make_transport("inprocess")
        pre2 = prefill_endpoint(cache, tp2, COMPAT, ring_nbytes=2 << 20, bind=pre1.endpoint)  # restarted
        for mode in ("staged", "direct"):
            pre2.add_request(f"b-{mode}", [4, 5], 2 * BS)
            dec.fetch(f"b-{mode}", 2 * BS, [6, 7], mode)
            assert_pool_holds(dec, cache, [4, 5], 2 * BS, [6, 7])
        assert (dec.peer, dec.export_base) == (tp2.endpoint, pre2.export_base) != old
        assert pre2.snapshot()["ring_used"] == 0
    finally:
        dec.close()
        for x in (pre2, tp2, pre1, tp1, td):
            if x is not None:
                x.close()
    assert dev.live_buffers() == []


# --------------------------------------------------------------------------- prefill reserve wait and close
def test_prefill_reserve_wait_is_capped_by_claim_wait_not_the_far_deadline():
    with endpoints(claim_wait_s=0.3) as (_cache, pre, dec, _dev, _td, _finished):
        pre.add_request("a", list(range(10)), 10 * BS)  # 640 KiB of the 1 MiB ring
        pre.add_request("b", list(range(10, 20)), 10 * BS)
        dec.fetch("a", 10 * BS, list(range(10)), "direct", release=False)
        t0 = time.monotonic()
        with pytest.raises(PeerFailed, match="no_space"):  # asked again (backpressure) until its deadline
            dec.fetch("b", 10 * BS, list(range(10, 20)), "direct", timeout_s=1.5)
        assert time.monotonic() - t0 < 3.0 and dec.ep.backpressured >= 2
        dec.client.release("a")
        assert pre.snapshot()["ring_used"] == 0


def test_prefill_close_does_not_wait_out_a_blocked_reserve():
    with endpoints(claim_wait_s=60.0) as (_cache, pre, dec, _dev, _td, _finished):
        pre.add_request("a", list(range(10)), 10 * BS)
        pre.add_request("b", list(range(10, 20)), 10 * BS)
        dec.fetch("a", 10 * BS, list(range(10)), "direct", release=False)
        # No deadline: the worker waits up to claim_wait_s (60 s) for ring space.
        fut = dec.client.call_async(
            KVRequest(req_id="b", dst_layout=dec.desc, num_tokens=10 * BS, dst_block_ids=list(range(10, 20)))
        )
        assert wait_until(lambda: pre.snapshot()["pending"] == 1, 5.0)
        time.sleep(0.2)
        t0 = time.monotonic()
        pre.close()
        assert time.monotonic() - t0 < 20.0  # the ring abort woke the worker
        fut.cancel()


# --------------------------------------------------------------------------- bind failure
def test_prefill_endpoint_that_cannot_bind_leaves_nothing_behind():
    cache = PagedKVCache(L, 4, H, BS, D)
    t1, t2 = make_transport("inprocess"), make_transport("inprocess")
    pre = prefill_endpoint(cache, t1, COMPAT, ring_nbytes=1 << 20)
    try:
        threads = {t.name for t in threading.enumerate()}
        for kind in ("hawk", "staged", "vllm"):
            with pytest.raises(zmq.ZMQError):
                prefill_endpoint(cache, t2, COMPAT, kind, ring_nbytes=1 << 20, bind=pre.endpoint)
            assert t2._regions.regions() == []
            assert wait_until(lambda: {t.name for t in threading.enumerate()} <= threads, 5.0)
    finally:
        pre.close()
        t1.close()
        t2.close()


# --------------------------------------------------------------------------- hostile layouts
@pytest.mark.parametrize(
    "field,value,match",
    [
        ("block_size", 2**31, "block_size 2147483648 is over"),
        ("block_size", 80, "block_size 80 is not a multiple of 32"),
        ("num_banks", 1024, "1024 banks"),
        ("page_nbytes", 2**31, "page of 2147483648 bytes"),
    ],
)
def test_prefill_bounds_the_peer_layout_before_planning(field, value, match):
    with endpoints() as (_cache, pre, dec, _dev, _td, _finished):
        pre.add_request("h", [1], BS)
        desc = msgspec.structs.replace(dec.desc, **{field: value})
        with pytest.raises(RemoteError, match=f"layout_mismatch.*{match}"):
            dec.client.request_kv(KVRequest(req_id="h", dst_layout=desc, num_tokens=BS, dst_block_ids=[0]))
        assert pre.snapshot()["ring_used"] == 0


def test_vllm_mode_refuses_a_peer_cache_of_another_shape():
    cache = PagedKVCache(L, 8, H, BS, D)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = prefill_endpoint(cache, tp, COMPAT, "vllm")
    dec = VllmDecode(PagedKVCache(L, 8, H, BS, 2 * D), td, pre.endpoint, COMPAT)
    try:
        pre.add_request("v", [1], BS)
        with pytest.raises(PeerFailed, match="layout_mismatch.*head_dim"):
            dec.fetch("v", BS, [2])
    finally:
        dec.close()
        pre.close()
        tp.close()
        td.close()


# --------------------------------------------------------------------------- KV-pool registration
def test_kv_pool_is_registered_only_while_a_fetch_lands_in_it():
    """Least exposure: the decode registers receive buffers (staged) or the destination
    blocks' pages (direct) for one fetch only; between fetches nothing is registered."""
    with endpoints() as (cache, pre, dec, dev, td, _finished):
        seen = []
        real = td.register
        td.register = lambda a, n, *where: (seen.append((a, n)), real(a, n, *where))[1]
        assert len(td._regions) == 0
        pre.add_request("s", [1], BS)
        dec.fetch("s", BS, [2], "staged")
        assert len(td._regions) == 0 and len(seen) == dev.num_banks  # one slice per bank, then gone
        pre.add_request("d", [3], BS)
        seen.clear()
        dec.fetch("d", BS, [4], "direct")
        assert len(td._regions) == 0 and seen
        assert_pool_holds(dec, cache, [3], BS, [4])
        # only block 4's pages were exposed, not the pool
        pool_nbytes = sum(n for _a, n in dec.sinks["direct"].pages.regions())
        assert sum(n for _a, n in seen) < pool_nbytes / 4


def test_kv_page_addresses_come_from_the_bank_buffer_api():
    dev = EmulatedDevice("p150a", 4 << 20)
    layout, bufs = dev.allocate_kv_cache(TTKVCacheSpec(L, 8, H, BS, D, "bfloat16"))
    dev.map_buffer_dma(bufs[1])  # mapped by someone else: left mapped
    pages = KVPageAddresses(dev, bufs)
    buf = bufs[2]
    off = np.array([buf.address, buf.address + 4096])
    got = pages.addresses(np.array([3, 5]), off, np.array([2048, 2048]))
    assert got.tolist() == [dev.get_buffer_address_bank(buf, 3), dev.get_buffer_address_bank(buf, 5) + 4096]
    with pytest.raises(ValueError, match="outside"):
        pages.addresses(np.array([0]), np.array([bufs[-1].address + bufs[-1].size_per_bank - 8]), np.array([16]))
    pages.close()
    with pytest.raises(BankBufferError):  # unmapped again
        dev.get_buffer_address_bank(bufs[0], 0)
    assert dev.get_buffer_address_bank(bufs[1], 0)  # still mapped
    dev.unmap_buffer_dma(bufs[1])
    for b in bufs:
        dev.free_buffer(b)
    assert dev.live_buffers() == []


# --------------------------------------------------------------------------- a late hand-over
def test_a_hand_over_later_than_3_s_is_still_served():
    """The engine hands a finished request over one engine step after it finished; on a
    host short of CPU that step can come seconds after the decode's KVRequest. The
    KVRequest waits for it until its own deadline, so the pull succeeds."""
    with endpoints() as (cache, pre, dec, _dev, _td, finished):
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("res", dec.fetch("slow-hand-over", BS, [5], timeout_s=20)))
        t.start()
        assert wait_until(lambda: pre.snapshot()["early"] == 1, 5.0), pre.snapshot()
        time.sleep(4.0)  # longer than EARLY_REQUEST_WAIT_S
        pre.add_request("slow-hand-over", [3], BS)
        t.join(20)
        assert "res" in out, "the fetch failed"
        assert_pool_holds(dec, cache, [3], BS, [5])
        assert wait_until(lambda: finished == [("slow-hand-over", True)], 5.0), finished
        assert pre.snapshot()["early"] == 0


def test_an_id_never_handed_over_is_refused_once_the_engine_stepped_past_it():
    """A KVRequest for an id the prefill will never hand over is answered unknown_request
    as soon as the engine has begun the steps that would have carried its hand-over,
    well before the decode's deadline."""
    from vllm_hawk.kvflow.early import HAND_OVER_STEPS

    with endpoints() as (_cache, pre, dec, _dev, _td, _finished):
        out = {}

        def fetch():
            try:
                dec.fetch("made-up", BS, [5], timeout_s=30)
            except PeerFailed as e:
                out["error"] = str(e)

        t = threading.Thread(target=fetch)
        t.start()
        assert wait_until(lambda: pre.snapshot()["early"] == 1, 5.0), pre.snapshot()
        t0 = time.monotonic()
        for _ in range(HAND_OVER_STEPS):
            pre.engine_step()
        t.join(10)
        assert "unknown_request" in out.get("error", ""), out
        assert time.monotonic() - t0 < 5.0 and pre.snapshot()["early"] == 0
