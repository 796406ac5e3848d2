"""The connector's strategies on the shipped Algorithm 1 path, without vLLM.

``make_source`` / ``make_sinks`` (what ``HawkConnectorWorker`` builds from its config)
driven through :class:`~vllm_hawk.kvflow.PrefillEndpoint` and
:class:`~vllm_hawk.kvflow.DecodeEndpoint` over the in-process transport:

* GN-HAWK: the decode's Tenstorrent KV blocks (the plugin's ``TTPagedKVCache``) hold
  exactly ``tilize_pack`` of the prefill's K/V, on 8 (p150a) and 12 (n150) banks, bf16
  and bfloat8_b, staged and direct; a partial pull (``first_block``: the decode had a
  local prefix hit) takes the request's LAST blocks; ONE READ batch per request;
* the staged race of the old connector: a Release that arrives while the request is
  still queued behind another one cancels it and leaks no ring space;
* the prefill refuses destinations it cannot serve, naming the field.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest
import torch

from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.connector.config import HawkConfig
from vllm_hawk.connector.describe import LocalKV, tt_compat
from vllm_hawk.connector.strategies import make_sinks, make_source
from vllm_hawk.kvflow import (
    DecodeEndpoint,
    PeerFailed,
    PrefillEndpoint,
    RingGatherSource,
    TileTransformSource,
    TTSink,
    VllmBlockSource,
    VllmPagedSink,
    VllmStagedSink,
)
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import KVRequest, LayoutDesc, RemoteError, make_compat
from vllm_hawk.tenstorrent.emulated.kv_cache import TTPagedKVCache
from vllm_hawk.transport import make_transport

L, H, BS, D = 2, 2, 32, 64
SRC_BLOCKS = 16
DST_BLOCKS = 24


def _vllm_kv(cache: PagedKVCache, compat) -> LocalKV:
    return LocalKV(compat, cache.desc, cache.region_map, cache.storages, cache.kv_views(), caches=cache.layers)


class _Counting:
    """The in-process transport, counting READ batches (a real transport, not a fake)."""

    def __init__(self) -> None:
        self.t = make_transport("inprocess")
        self.batches = 0

    def __getattr__(self, name):
        return getattr(self.t, name)

    def submit(self, kind, peer, entries):
        self.batches += 1
        return self.t.submit(kind, peer, entries)


def test_strategies_follow_the_config():
    cache = PagedKVCache(L, 4, H, BS, D)
    compat = make_compat("m", "bfloat16", BS, "x", "y", "vllm")
    kv = _vllm_kv(cache, compat)
    assert isinstance(make_source(HawkConfig(mode="direct"), kv), VllmBlockSource)
    assert isinstance(make_source(HawkConfig(mode="staged"), kv), RingGatherSource)
    assert isinstance(make_source(HawkConfig(device_profile="p150a"), kv), TileTransformSource)
    t = make_transport("inprocess")
    try:
        for mode, cls in (("direct", VllmPagedSink), ("staged", VllmStagedSink)):
            sink = make_sinks(HawkConfig(mode=mode, ring_nbytes=1 << 20), kv, t)[0]
            assert type(sink) is cls
            sink.close()
        with pytest.raises(NotImplementedError, match="HAWK_TT_PLATFORM"):
            make_sinks(HawkConfig(device_profile="p150a"), kv, t)[0]
        assert len(t._regions) == 0
    finally:
        t.close()


@pytest.mark.parametrize("device", ["p150a", "n150"])
@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat8_b"])
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_gn_hawk_lands_exact_bytes_in_the_device_banks(device, dtype, mode):
    src_cache = PagedKVCache(L, SRC_BLOCKS, H, BS, D).fill_random(3)
    views = src_cache.kv_views()
    compat = tt_compat("m", "bfloat16", BS, device)
    cfg = HawkConfig(device_profile=device, mode=mode, ring_nbytes=2 << 20)
    dev = EmulatedDevice(device, bank_size_bytes=8 << 20)
    cache = TTPagedKVCache(dev, TTKVCacheSpec(L, DST_BLOCKS, H, BS, D, dtype))
    tp, td = make_transport("inprocess"), _Counting()
    pre = PrefillEndpoint(make_source(cfg, _vllm_kv(src_cache, compat)), tp, compat, ring_nbytes=1 << 20)
    sink = make_sinks(cfg, LocalKV(compat, None, tt_cache=cache), td)[0]
    dec = DecodeEndpoint(td, pre.endpoint, compat, pull_timeout_s=10)
    try:
        assert sink.layout.num_banks == dev.num_banks and sink.layout.dtype == dtype
        src_ids = [5, 2, 9, 11]  # the prefill's blocks of a 4-block request
        num_tokens = 3 * BS + 7
        for i, (dst, first) in enumerate((([20, 3, 7, 12], 0), ([6, 1], 2))):  # full pull, prefix hit
            rid = f"r{i}"
            pre.add_request(rid, src_ids, num_tokens)
            res = dec.fetch(rid, num_tokens, sink, dst, first_block=first)
            assert res.segments <= dev.num_banks and res.nbytes == sum(res.extra["bytes_per_bank"])
            ids = torch.tensor(src_ids[first:])
            for layer, (k, v) in enumerate(views):
                for kv, x in ((0, k), (1, v)):
                    want = tilize_pack(x.index_select(0, ids).to(torch.float32), dtype)
                    got = cache.read_block_bytes(layer, kv, dst)
                    assert torch.equal(want.reshape(got.shape), got), (layer, kv)
        assert td.batches == 2  # ONE batch of READs per request
        snap = pre.snapshot()
        assert snap["ring_used"] == 0 and snap["requests"] == 0
        assert sink.idle()
    finally:
        dec.close()
        sink.close()
        pre.close()
        assert len(td._regions) == 0
        tp.close()
        td.close()
        cache.close()
        assert dev.live_buffers() == []


def test_staged_release_while_queued_cancels_and_leaks_no_ring_space():
    """The old connector's leak: the decode gives up on ``b`` while it is still queued
    behind ``a`` on the prefill's one worker and sends Release; ``b`` must not reserve
    ring space afterwards, and the ring must stay fully usable."""
    cache = PagedKVCache(L, 40, H, BS, D).fill_random(1)
    compat = make_compat("m", "bfloat16", BS, "x", "y", "vllm")
    cfg = HawkConfig(mode="staged", ring_nbytes=1 << 20)
    kv = _vllm_kv(cache, compat)
    gate = threading.Event()
    finished: list = []

    def observer(rid, msg, src):  # hold request "a" inside the worker
        if rid == "a":
            gate.wait(10)

    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = PrefillEndpoint(
        make_source(cfg, kv),
        tp,
        compat,
        ring_nbytes=cfg.ring_nbytes,
        workers=1,
        observer=observer,
        on_finished=lambda r, ok: finished.append((r, ok)),
    )
    dst_cache = PagedKVCache(L, 40, H, BS, D)
    sink = make_sinks(cfg, _vllm_kv(dst_cache, compat), td)[0]
    dec = DecodeEndpoint(td, pre.endpoint, compat, pull_timeout_s=10)
    try:
        pre.add_request("a", [1, 2], 2 * BS)
        pre.add_request("b", [3, 4], 2 * BS)
        with cf.ThreadPoolExecutor(1) as ex:
            fa = ex.submit(dec.fetch, "a", 2 * BS, sink, [5, 6])
            while pre.snapshot()["pending"] < 1:
                time.sleep(0.01)
            with pytest.raises(PeerFailed, match="no reply"):  # b waits behind a, the decode gives up
                dec.fetch("b", 2 * BS, sink, [7, 8], timeout_s=0.5)
            gate.set()
            fa.result(10)
        deadline = time.monotonic() + 10
        while pre.snapshot()["pending"] and time.monotonic() < deadline:
            time.sleep(0.02)
        snap = pre.snapshot()
        assert snap["ring_used"] == 0 and snap["ring_live"] == 0 and snap["requests"] == 0, snap
        assert snap["cancelled"] == 1 and ("b", False) in finished and ("a", True) in finished
        # the whole ring is still there: a request of most of its size is served
        n = (1 << 20) // cache.region_map.block_nbytes - 2  # 30 of the 32 blocks that fit
        pre.add_request("big", list(range(n)), n * BS)
        dec.fetch("big", n * BS, sink, list(range(n)))
        for layer in range(L):
            assert torch.equal(dst_cache.layers[layer][:n], cache.layers[layer][:n])
        assert sink.recv.alloc.is_empty() and pre.snapshot()["ring_used"] == 0
    finally:
        dec.close()
        sink.close()
        pre.close()
        tp.close()
        td.close()


def test_prefill_refuses_destinations_it_cannot_serve():
    src = PagedKVCache(L, 4, H, BS, D)
    compat = tt_compat("m", "bfloat16", BS, "p150a")
    t = make_transport("inprocess")
    pre = PrefillEndpoint(
        make_source(HawkConfig(device_profile="p150a"), _vllm_kv(src, compat)), t, compat, ring_nbytes=1 << 20
    )
    dev = EmulatedDevice("p150a", bank_size_bytes=8 << 20)
    cache = TTPagedKVCache(dev, TTKVCacheSpec(L, DST_BLOCKS, H, BS, D, "bfloat16"))
    desc = TTSink(dev, cache.layout, cache.buffers, t, "staged", recv_nbytes_per_bank=64 << 10)
    good, _ = desc.layout, desc.close()
    dec = DecodeEndpoint(make_transport("inprocess"), pre.endpoint, compat, pull_timeout_s=5)
    try:
        pre.add_request("x", [1, 2], 40)

        def why(**kw) -> str:
            d = {f: getattr(good, f) for f in good.__struct_fields__}
            req = dict(num_tokens=40, dst_block_ids=[1, 2], first_block=0)
            req.update({k: kw.pop(k) for k in list(kw) if k in req})
            d.update(kw)
            try:
                dec.client.request_kv(KVRequest(req_id="x", dst_layout=LayoutDesc(**d), **req))
            except RemoteError as e:
                assert e.code == "layout_mismatch"
                return e.detail
            raise AssertionError("served")

        assert "banks" in why(num_banks=12)
        assert "head_dim" in why(head_dim=32)
        assert "dtype" in why(dtype="float16")
        assert "page" in why(page_nbytes=4096)
        assert "block_size 48 is not a multiple of 32" in why(block_size=48, dst_block_ids=[1])
        assert "num_tokens" in why(num_tokens=65)
        assert "distinct" in why(dst_block_ids=[1, 1])
        assert "do not end" in why(dst_block_ids=[1, 2, 3])
        assert "do not end" in why(first_block=1)
        assert pre.snapshot()["ring_used"] == 0 and pre.snapshot()["pending"] == 0
    finally:
        dec.close()
        pre.close()
        t.close()
        cache.close()


def test_local_cluster_starts_a_tenstorrent_decode(tmp_path, monkeypatch):
    """``LocalCluster(decode_tt=...)``: the decode runs ``hawk vllm`` with ``--tt-*`` flags and sees the
    platform entry point through PYTHONPATH (vLLM's spawned workers too); the prefill does
    not; both sides get the device profile, which alone names the device."""
    import json
    from importlib import metadata
    from pathlib import Path

    from vllm_hawk.bench.local_cluster import LocalCluster

    monkeypatch.setenv("HAWK_TT_PLATFORM", "emulated")  # must not leak into the prefill
    c = LocalCluster("m", tmp_path, decode_tt={"device": "n150", "kv_dtype": "bfloat8_b"})
    tt = {"device_profile": "n150"}
    d = c._vllm("decode", "kv_consumer", tt, None)
    p = c._vllm("prefill", "kv_producer", tt, None)
    assert d.argv[1:7] == [
        "-m",
        "vllm_hawk.vllm_launcher",
        "--tt-platform",
        "emulated",
        "--tt-kv-dtype",
        "bfloat8_b",
    ]
    assert "--tt-device" not in d.argv  # the device is named once: the connector's device_profile
    assert p.argv[1:3] == ["-m", "vllm_hawk.vllm_launcher"]
    assert "HAWK_TT_PLATFORM" not in p.env and "HAWK_TT_PLATFORM" not in d.env
    ep_dir = d.env["PYTHONPATH"].split(":")[1]
    assert ep_dir not in p.env["PYTHONPATH"]
    # read the files themselves: an in-memory finder installed by another test in this
    # process (tenstorrent.emulated.ensure_entry_point) would also answer metadata.distributions()
    infos = list(Path(ep_dir).glob("*.dist-info"))
    eps = [
        ep
        for info in infos
        for ep in metadata.PathDistribution(info).entry_points
        if ep.group == "vllm.platform_plugins"
    ]
    assert [ep.value for ep in eps] == ["vllm_hawk.tenstorrent.emulated:register"]
    assert json.loads(d.argv[-1])["kv_connector_extra_config"] == tt
