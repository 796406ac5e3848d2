"""GN-HAWK pieces of HawkConnector without vLLM: the prefill's ``serve_tt`` (transform into
the ring, one segment per bank) and the decode's ``TTDestination`` (bank-buffer API,
staged and direct), with a memmove standing in for the transport's READ batch.

The decode's device KV blocks must hold exactly ``tilize_pack`` of the prefill's K/V, on
8 (p150a) and 12 (n150) banks, bf16 and bfloat8_b, staged and direct; a partial pull (the
decode had a local prefix hit) takes the request's LAST blocks; afterwards the ring and
the receive buffers are idle.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from vllm_hawk.connector.tt import TTDestination, check_tt_request, serve_tt
from vllm_hawk.kvflow.paged_cache import PagedKVCache
from vllm_hawk.kvflow.ring import RingBuffer
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import KVRequest, LayoutDesc
from vllm_hawk.tt_plugin.kv_cache import TTPagedKVCache

L, H, BS, D = 2, 2, 32, 64
SRC_BLOCKS = 16
DST_BLOCKS = 24


class _Transport:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.batches = 0

    def register(self, addr: int, nbytes: int) -> None:
        self.registered[addr] = nbytes

    def unregister(self, addr: int) -> None:
        del self.registered[addr]

    def read(self, entries) -> None:
        self.batches += 1
        for local, remote, n in entries:
            ctypes.memmove(local, remote, n)


def _mine() -> LayoutDesc:
    return LayoutDesc(name="vllm-paged/x", dtype="bfloat16", block_size=BS, num_layers=L,
                      num_kv_heads=H, head_dim=D, num_banks=1, tile_nbytes=1, page_nbytes=1)


@pytest.mark.parametrize("device", ["p150a", "n150"])
@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat8_b"])
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_prefill_transform_lands_in_device_banks(device, dtype, mode):
    src_cache = PagedKVCache(L, SRC_BLOCKS, H, BS, D).fill_random(3)
    views = src_cache.kv_views()
    dev = EmulatedDevice(device, bank_size_bytes=8 << 20)
    cache = TTPagedKVCache(dev, TTKVCacheSpec(L, DST_BLOCKS, H, BS, D, dtype))
    tr = _Transport()
    dest = TTDestination(cache, mode, tr, recv_nbytes=2 << 20)
    ring = RingBuffer(1 << 20)
    try:
        assert dest.layout.num_banks == dev.num_banks and dest.layout.dtype == dtype
        src_ids = [5, 2, 9, 11]  # the prefill's blocks of a 4-block request
        num_tokens = 3 * BS + 7
        for dst, want_src in (([20, 3, 7, 12], src_ids), ([6, 1], src_ids[2:])):  # full, prefix hit
            rid = f"r{len(dst)}"
            msg = KVRequest(req_id=rid, dst_layout=dest.layout, num_tokens=num_tokens, dst_block_ids=dst)
            assert check_tt_request(msg, _mine(), device, held_tokens=num_tokens) == ""
            ready, _ = serve_tt(msg, src_ids, views, BS, ring, 1.0, 1000)
            assert len(ready.segments) <= dev.num_banks
            plan = dest.plan(dst)
            dest.check_ready(ready, plan, ring.capacity)
            fig: dict = {}
            dest.land(rid, ready, plan, ring.base_addr, tr.read, 5.0, fig)
            ring.release(rid)
            assert fig["nbytes"] == ready.total_nbytes == sum(fig["bytes_per_bank"])
            ids = torch.tensor(want_src)
            for layer, (k, v) in enumerate(views):
                for kv, x in ((0, k), (1, v)):
                    want = tilize_pack(x.index_select(0, ids).to(torch.float32), dtype)
                    got = cache.read_block_bytes(layer, kv, dst)
                    assert torch.equal(want.reshape(got.shape), got), (layer, kv)
        assert tr.batches == 2  # ONE batch of READs per request
        assert ring.alloc.is_empty()
        snap = dest.snapshot()
        assert snap["inflight"] == 0
        if mode == "staged":
            assert snap["recv_live"] == 0 and snap["recv_idle"]
    finally:
        dest.close()
        assert tr.registered == {}
        cache.close()
        assert dev.live_buffers() == []


def test_prefill_refuses_bad_destinations():
    dev = EmulatedDevice("p150a", bank_size_bytes=8 << 20)
    cache = TTPagedKVCache(dev, TTKVCacheSpec(L, DST_BLOCKS, H, BS, D, "bfloat16"))
    try:
        good = TTDestination(cache, "staged", _Transport(), 1 << 20)
        desc = good.layout
        good.close()

        def why(**kw):
            d = {f: getattr(desc, f) for f in desc.__struct_fields__}
            req = dict(num_tokens=40, dst_block_ids=[1, 2])
            req.update({k: kw.pop(k) for k in list(kw) if k in req})
            d.update(kw)
            return check_tt_request(KVRequest(req_id="x", dst_layout=LayoutDesc(**d), **req),
                                    _mine(), "p150a", held_tokens=64)

        assert why() == ""
        assert "banks" in why(num_banks=12)
        assert "head_dim" in why(head_dim=32)
        assert "dtype" in why(dtype="float16")
        assert "page" in why(page_nbytes=4096)
        assert "num_tokens" in why(num_tokens=65)
        assert "distinct" in why(dst_block_ids=[1, 1])
        assert "distinct" in why(dst_block_ids=[1, 2, 3])
    finally:
        cache.close()


def test_local_cluster_starts_a_tenstorrent_decode(tmp_path, monkeypatch):
    """``LocalCluster(decode_tt=...)``: the decode runs the plugin's launcher and sees the
    platform entry point through PYTHONPATH (vLLM's spawned workers too); the prefill does
    not; both sides get the device profile."""
    import json
    from importlib import metadata
    from pathlib import Path

    from vllm_hawk.proxy.local import LocalCluster

    monkeypatch.setenv("HAWK_TT_PLATFORM", "emulated")  # must not leak into the prefill
    c = LocalCluster("m", tmp_path, decode_tt={"device": "n150", "kv_dtype": "bfloat8_b"})
    tt = {"device_profile": "n150"}
    d = c._vllm("decode", "kv_consumer", tt, None)
    p = c._vllm("prefill", "kv_producer", tt, None)
    assert d.argv[1:9] == ["-m", "vllm_hawk.tt_plugin", "--tt-platform", "emulated", "--tt-device",
                           "n150", "--tt-kv-dtype", "bfloat8_b"]
    assert p.argv[1:3] == ["-m", "vllm_hawk.vllm_launcher"]
    assert "HAWK_TT_PLATFORM" not in p.env and "HAWK_TT_PLATFORM" not in d.env
    ep_dir = d.env["PYTHONPATH"].split(":")[1]
    assert ep_dir not in p.env["PYTHONPATH"]
    # read the files themselves: an in-memory finder installed by another test in this
    # process (tt_plugin.ensure_entry_point) would also answer metadata.distributions()
    infos = list(Path(ep_dir).glob("*.dist-info"))
    eps = [ep for info in infos for ep in metadata.PathDistribution(info).entry_points
           if ep.group == "vllm.platform_plugins"]
    assert [ep.value for ep in eps] == ["vllm_hawk.tt_plugin:register"]
    assert json.loads(d.argv[-1])["kv_connector_extra_config"] == tt
