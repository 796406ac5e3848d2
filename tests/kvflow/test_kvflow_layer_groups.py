"""Layer-group pipelining in the one engine: a fetch asked for as several layer groups
lands exactly the bytes of a whole fetch (staged and direct), the prefill produces each
group once into one ring range, and failures leave nothing held on either side."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from vllm_hawk.bench.endpoints import TTDecode, prefill_endpoint
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.kvflow import PeerFailed
from vllm_hawk.kvflow import decode as decode_mod
from vllm_hawk.kvflow import sources as sources_mod
from vllm_hawk.kvflow.decode import AUTO_LAYER_GROUPS, split_layers
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import KVRequest, make_compat
from vllm_hawk.transport import make_transport

L, H, BS, D = 5, 2, 64, 64
COMPAT = make_compat("tiny", "bfloat16", BS, "vllm-flash-nhd", "tt-paged", "p150a")


def wait_until(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture()
def pair():
    cache = PagedKVCache(L, 24, H, BS, D).fill_random(5)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    finished = []
    pre = prefill_endpoint(
        cache, tp, COMPAT, ring_nbytes=2 << 20, claim_wait_s=0.2, on_finished=lambda r, ok: finished.append((r, ok))
    )
    dev = EmulatedDevice("p150a", 8 << 20)
    decs = {}
    try:
        for dtype in ("bfloat16", "bfloat8_b"):
            decs[dtype] = TTDecode(
                dev,
                TTKVCacheSpec(L, 16, H, BS, D, dtype),
                td,
                pre.endpoint,
                COMPAT,
                recv_nbytes_per_bank=192 << 10,
                timeout_s=10,
            )
        yield cache, pre, decs, finished
    finally:
        for d in decs.values():
            d.close()
        pre.close()
        tp.close()
        td.close()
    assert dev.live_buffers() == []


def assert_pool_holds(dec, cache, src, n, dst):
    for layer in range(L):
        for kv in range(2):
            x = cache.kv_views()[layer][kv]
            tok = torch.cat([x[b] for b in src], dim=1)
            nb = -(-n // BS)
            out = torch.zeros(H, nb * BS, D, dtype=tok.dtype)
            out[:, : min(tok.shape[1], nb * BS)] = tok[:, : nb * BS]
            want = tilize_pack(out.reshape(H, nb, BS, D).transpose(0, 1), dec.layout.spec.dtype)
            assert torch.equal(dec.read_blocks(layer, kv, dst), want), (layer, kv)


def test_split_layers():
    assert split_layers(80, 4) == [(0, 20), (20, 40), (40, 60), (60, 80)]
    assert split_layers(5, 2) == [(0, 2), (2, 5)] or split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert split_layers(7, 1) == [(0, 7)]


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_auto_splits_only_large_direct_pulls(pair, mode, monkeypatch):
    """The connector's default: 2 groups for a direct pull of at least
    AUTO_GROUPS_MIN_NBYTES of tiles (measured, see kvflow.decode), a staged or smaller
    pull whole; the bytes land the same either way."""
    cache, pre, decs, _finished = pair
    dec = decs["bfloat16"]
    src, dst = np.array([3, 7]), np.array([5, 1])
    n = 2 * BS - 9
    whole = 2 * 16 * dec.layout.spec.tile_nbytes * L  # 2 blocks, K and V, every layer
    for i, limit in enumerate((whole + 1, whole)):  # just below the limit, then at it
        monkeypatch.setattr(decode_mod, "AUTO_GROUPS_MIN_NBYTES", limit)
        rid = f"auto-{mode}-{i}"
        pre.add_request(rid, src, n)
        res = dec.fetch(rid, n, dst, mode, layer_groups=AUTO_LAYER_GROUPS)
        split = mode == "direct" and limit <= whole
        assert res.mode == (f"{mode}-layer-groups" if split else mode), (limit, res.mode)
        assert res.extra.get("layer_groups", 1) == (2 if split else 1)
        assert res.nbytes == whole
        assert_pool_holds(dec, cache, src, n, dst)
    assert pre.snapshot()["requests"] == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat8_b"])
@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("groups", [2, 3, 5])
def test_layer_groups_land_exact_bytes(pair, mode, dtype, groups):
    cache, pre, decs, finished = pair
    dec = decs[dtype]
    rng = np.random.default_rng(groups * 7 + len(mode))
    for i in range(2):
        n = int(rng.integers(1, 4 * BS))
        nb = -(-n // BS)
        src, dst = rng.permutation(24)[:nb], rng.permutation(16)[:nb]
        rid = f"{mode}-{dtype}-{groups}-{i}"
        pre.add_request(rid, src, n)
        res = dec.fetch(rid, n, dst, mode, layer_groups=groups)
        assert res.mode == f"{mode}-layer-groups" and res.extra["layer_groups"] == groups
        assert res.nbytes == nb * 16 * dec.layout.spec.tile_nbytes * L
        assert_pool_holds(dec, cache, src, n, dst)
        snap = pre.snapshot()
        assert snap["ring_used"] == 0 and snap["requests"] == 0 and snap["pending"] == 0, snap
        assert dec.pool.is_idle()
    assert finished and all(ok for _r, ok in finished)


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_layer_groups_register_only_the_fetch_and_only_while_it_runs(pair, mode):
    """Per-request registration covers the layer-group path: staged READs land in the
    pool's slice, direct ones in the request's KV pages, registered from D2 to the end
    of the last group's batch (the transport refuses a READ into unregistered memory);
    afterwards nothing is registered on either side, also after a failed fetch."""
    _cache, pre, decs, _finished = pair
    dec = decs["bfloat16"]
    td, tp = dec.transport, pre.transport
    assert td._regions.regions() == [] and tp._regions.regions() == []
    seen = []
    real_submit = td.submit

    def submit(kind, peer, entries):
        seen.append((len(td._regions.regions()), len(tp._regions.regions())))
        return real_submit(kind, peer, entries)

    td.submit = submit
    try:
        pre.add_request("reg", [1, 2, 3], 3 * BS)
        dec.fetch("reg", 3 * BS, [4, 5, 6], mode, layer_groups=3)
        assert len(seen) == 3 and all(d > 0 and p > 0 for d, p in seen), seen
        assert td._regions.regions() == [] and tp._regions.regions() == []
        pre.add_request("bad", [1], BS)  # a group the prefill refuses: the fetch fails, nothing stays
        with pytest.raises(PeerFailed):
            _fetch_with_bad_group(dec, "bad", mode)
        assert wait_until(lambda: pre.snapshot()["pending"] == 0, 5.0), pre.snapshot()
        assert wait_until(lambda: tp._regions.regions() == [], 5.0), tp._regions.regions()
        assert td._regions.regions() == [] and dec.pool.is_idle()
    finally:
        td.submit = real_submit


def _fetch_with_bad_group(dec, rid, mode):
    """A layer-group fetch whose second group the prefill refuses (its KVRequest names
    layers outside the model)."""
    from vllm_hawk.kvflow import decode as decode_mod

    real = decode_mod.split_layers
    decode_mod.split_layers = lambda n, g: [(0, 2), (2, n + 3)]
    try:
        return dec.fetch(rid, BS, [7], mode, layer_groups=2, timeout_s=2)
    finally:
        decode_mod.split_layers = real


def test_early_layer_groups_all_wait_for_the_hand_over(pair):
    """Every group's KVRequest may beat the engine's hand-over: all are parked and all
    served once it comes (not only the last one)."""
    cache, pre, decs, finished = pair
    dec = decs["bfloat16"]
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault("res", dec.fetch("early", 2 * BS, [8, 9], "staged", layer_groups=3, timeout_s=10))
    )
    t.start()
    assert wait_until(lambda: pre.snapshot()["early"] == 1, 5.0), pre.snapshot()
    time.sleep(0.2)  # the other groups' KVRequests arrive too
    pre.add_request("early", [10, 11], 2 * BS)
    t.join(15)
    assert "res" in out and out["res"].extra["layer_groups"] == 3
    assert_pool_holds(dec, cache, [10, 11], 2 * BS, [8, 9])
    snap = pre.snapshot()
    assert snap["early"] == 0 and snap["early_block_ids"] == 0 and snap["ring_used"] == 0, snap
    assert wait_until(lambda: finished == [("early", True)], 5.0), finished


def test_second_request_for_a_served_group_is_refused(pair):
    _cache, pre, decs, _f = pair
    dec = decs["bfloat16"]
    pre.add_request("g", [1], BS)
    sink = dec.sink("staged")
    msg = KVRequest(req_id="g", dst_layout=sink.layout, num_tokens=BS, dst_block_ids=[2], first_layer=0, num_layers=2)
    ready = dec.client.request_kv(msg, timeout_s=5)
    assert ready.total_nbytes == 2 * 2 * 8 * 2048  # layers 0-1, K and V, 8 bf16 tiles each
    from vllm_hawk.protocol import RemoteError

    with pytest.raises(RemoteError, match="already in flight"):
        dec.client.request_kv(msg, timeout_s=5)
    bad = KVRequest(req_id="g", dst_layout=sink.layout, num_tokens=BS, dst_block_ids=[2], first_layer=4, num_layers=3)
    with pytest.raises(RemoteError, match="not inside"):
        dec.client.request_kv(bad, timeout_s=5)
    dec.ep.release("g")
    assert wait_until(lambda: pre.snapshot()["ring_used"] == 0, 5)


def test_release_while_groups_are_served_frees_the_range_once(pair, monkeypatch):
    """The decode gives up while later groups are still being transformed: its Release
    cancels them, the last one frees the ring range, the engine hears ok=False."""
    _cache, pre, decs, finished = pair
    real = sources_mod.transform_source
    calls = []

    def slow(*a, **k):
        calls.append(k.get("memo") is not None)
        if len(calls) > 1:
            time.sleep(0.5)
        return real(*a, **k)

    monkeypatch.setattr(sources_mod, "transform_source", slow)
    pre.add_request("slow", [1, 2], 2 * BS)
    with pytest.raises(PeerFailed):
        decs["bfloat16"].fetch("slow", 2 * BS, [3, 4], "staged", timeout_s=0.3, layer_groups=3)
    # on_finished runs after the cancel is booked: wait for the engine to hear it
    assert wait_until(lambda: finished == [("slow", False)], 10.0), finished
    assert wait_until(lambda: pre.snapshot()["pending"] == 0, 10.0), pre.snapshot()
    snap = pre.snapshot()
    assert snap["ring_used"] == 0 and snap["ring_live"] == 0 and snap["requests"] == 0, snap
    assert decs["bfloat16"].pool.is_idle()


def test_sources_without_layer_groups_refuse_them():
    cache = PagedKVCache(2, 8, H, BS, D).fill_random(1)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = prefill_endpoint(cache, tp, COMPAT, kind="staged")
    try:
        dev = EmulatedDevice("p150a", 4 << 20)
        dec = TTDecode(
            dev, TTKVCacheSpec(2, 8, H, BS, D, "bfloat16"), td, pre.endpoint, COMPAT, recv_nbytes_per_bank=64 << 10
        )
        try:
            pre.add_request("x", [1], BS)
            msg = KVRequest(req_id="x", dst_layout=dec.desc, num_tokens=BS, dst_block_ids=[1], num_layers=1)
            from vllm_hawk.protocol import RemoteError

            with pytest.raises(RemoteError, match="layer groups"):
                dec.client.request_kv(msg, timeout_s=5)
        finally:
            dec.close()
            dev.close()
    finally:
        pre.close()
        tp.close()
        td.close()
    assert threading.active_count() < 50
