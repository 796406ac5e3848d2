"""GN-Host through the connector's strategies (``layout_fix: decode``), without vLLM:
``make_source`` serves plain vLLM blocks, ``make_sinks`` builds the GN-Host sink over the
plugin's Tenstorrent KV cache, the host-staged transport moves the bytes and the
decode's banks hold ``tilize_pack`` of the prefill's K/V. A GN-Host decode and a
GN-HAWK prefill (or the reverse) are refused at the handshake, naming both values."""

from __future__ import annotations

import pytest
import torch

from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.connector.config import HawkConfig
from vllm_hawk.connector.describe import LocalKV, tt_compat
from vllm_hawk.connector.strategies import make_sinks, make_source
from vllm_hawk.kvflow import DecodeEndpoint, GNHostSink, PrefillEndpoint, RingGatherSource, VllmBlockSource
from vllm_hawk.kvflow.gn_host import wire_layout_of
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import IncompatiblePeer
from vllm_hawk.tenstorrent.emulated.kv_cache import TTPagedKVCache
from vllm_hawk.transport import make_transport

L, H, BS, D = 2, 2, 32, 64


def _prefill_kv(cache: PagedKVCache, compat) -> LocalKV:
    return LocalKV(
        compat,
        cache.desc,
        cache.region_map,
        cache.storages,
        cache.kv_views(),
        wire=wire_layout_of(cache.adapter, cache.layers[0]),
        caches=cache.layers,
    )


@pytest.mark.parametrize("mode,source", [("staged", RingGatherSource), ("direct", VllmBlockSource)])
def test_gn_host_over_host_staged_lands_exact_bytes(mode, source):
    src_cache = PagedKVCache(L, 16, H, BS, D).fill_random(4)
    pkv = _prefill_kv(src_cache, None)
    compat = tt_compat("m", "bfloat16", BS, "p150a", "decode", pkv.wire.name)
    pkv.compat = compat
    cfg = HawkConfig(
        transport="host-staged", mode=mode, device_profile="p150a", layout_fix="decode", ring_nbytes=1 << 20
    )
    dev = EmulatedDevice("p150a", bank_size_bytes=8 << 20)
    cache = TTPagedKVCache(dev, TTKVCacheSpec(L, 24, H, BS, D, "bfloat8_b"))
    tp, td = make_transport("host_staged"), make_transport("host_staged")
    src = make_source(cfg, pkv)
    assert type(src) is source
    pre = PrefillEndpoint(src, tp, compat, ring_nbytes=cfg.ring_nbytes)
    sink = make_sinks(cfg, LocalKV(compat, pkv.wire.layout_desc(L), tt_cache=cache, wire=pkv.wire), td)[0]
    dec = DecodeEndpoint(td, pre.endpoint, compat, pull_timeout_s=10)
    try:
        assert isinstance(sink, GNHostSink)
        src_ids, dst = [5, 2, 9], [20, 3, 7]
        pre.add_request("r", src_ids, 2 * BS + 5)
        res = dec.fetch("r", 2 * BS + 5, sink, dst)
        assert res.mode == "gn-host" and res.nbytes == 3 * L * src_cache.block_nbytes
        ids = torch.tensor(src_ids)
        for layer, (k, v) in enumerate(src_cache.kv_views()):
            for kv, x in ((0, k), (1, v)):
                want = tilize_pack(x.index_select(0, ids).to(torch.float32), "bfloat8_b")
                got = cache.read_block_bytes(layer, kv, dst)
                assert torch.equal(want.reshape(got.shape), got), (layer, kv)
        assert sink.idle() and pre.snapshot()["requests"] == 0
    finally:
        dec.close()
        sink.close()
        pre.close()
        tp.close()
        td.close()
        cache.close()
    assert dev.live_buffers() == []


@pytest.mark.parametrize("prefill_fix,decode_fix", [("prefill", "decode"), ("decode", "prefill")])
def test_gn_host_and_gn_hawk_sides_are_refused_naming_both(prefill_fix, decode_fix):
    wire = "FLASH_ATTN/NHC"
    cp = tt_compat("m", "bfloat16", BS, "p150a", prefill_fix, wire if prefill_fix == "decode" else "vllm-any")
    cd = tt_compat("m", "bfloat16", BS, "p150a", decode_fix, wire if decode_fix == "decode" else "vllm-any")
    src = PagedKVCache(L, 4, H, BS, D)
    t, td = make_transport("inprocess"), make_transport("inprocess")
    secret = b"0123456789abcdef-gn-host"  # authenticated peers are told the values, not just the fields
    pre = PrefillEndpoint(
        RingGatherSource(src.region_map, src.desc, src.storages, caches=src.layers),
        t,
        cp,
        ring_nbytes=1 << 20,
        secret=secret,
        auth="hmac",
    )
    try:
        with pytest.raises(IncompatiblePeer) as e:
            DecodeEndpoint(td, pre.endpoint, cd, pull_timeout_s=5, secret=secret, auth="hmac")
        msg = str(e.value)
        assert "layout_fix=decode" in msg and "layout_fix=prefill" in msg, msg
    finally:
        pre.close()
        t.close()
        td.close()


def test_local_cluster_starts_every_configuration_alike(tmp_path):
    from vllm_hawk.bench.local_cluster import CONFIGURATIONS, LocalCluster

    assert sorted(CONFIGURATIONS) == ["GG-Direct", "GG-Host", "GN-HAWK", "GN-Host"]
    c = LocalCluster.configured("GN-Host", "m", tmp_path, kv_dtype="bfloat8_b", extra_config={"ring_nbytes": 1 << 20})
    assert c.decode_tt == {"device": "p150a", "kv_dtype": "bfloat8_b"}
    assert c.extra_config == {"pair": "gn-host", "ring_nbytes": 1 << 20}
    assert LocalCluster.configured("GG-Host", "m", tmp_path).decode_tt is None
    with pytest.raises(ValueError, match="GN-Host"):
        LocalCluster.configured("gn-staged", "m", tmp_path)
