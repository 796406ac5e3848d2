"""GN-Host (kvflow.gn_host.GNHostSink) over the host-staged transport: the prefill serves
plain vLLM blocks (ring gather, or in place), the decode lands them in its receive ring
and fixes the layout into an emulated Tenstorrent KV pool. Exact bytes for the vLLM
layouts the prefill may have (FlashAttention NHD, CPU_ATTN vec / amx), nothing held
afterwards, and refusals that name what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hawk.bench.endpoints import GNHostDecode
from vllm_hawk.kvflow import GNHostSink, PeerFailed, PrefillEndpoint, RingGatherSource, VllmBlockSource
from vllm_hawk.kvflow.gn_host import WireLayout, host_wire_layout, wire_layout_of
from vllm_hawk.kvflow.sources import vllm_layout_desc
from vllm_hawk.kvflow.streams import region_map_from_caches
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.layout.vllm_kv import CpuAttnKVLayout, FlashAttnKVLayout, make_layer_caches
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import make_compat
from vllm_hawk.transport import make_transport

L, H, BS, D, NB = 2, 2, 32, 64, 24
COMPAT = make_compat("tiny", "bfloat16", BS, "gn-host-test", "tt-paged/p150a/layout_fix=decode", "p150a")


class VllmCache:
    """A prefill's vLLM cache in ``adapter``'s layout (``order``: LBNHC | LBHNC), random K/V."""

    def __init__(self, adapter, order: str, seed: int) -> None:
        self.adapter = adapter
        self.layers = make_layer_caches(L, NB, H, BS, 2 * D, torch.bfloat16, layout=order)
        g = torch.Generator().manual_seed(seed)
        ids = torch.arange(NB)
        self.kv = []
        for c in self.layers:
            k, v = (torch.randn(NB, H, BS, D, generator=g).to(torch.bfloat16) for _ in range(2))
            adapter.write_blocks(c, ids, k, v)
            self.kv.append((k, v))
        self.region_map = region_map_from_caches(self.layers, [adapter.block_byte_ranges(c, 0) for c in self.layers])
        st = self.layers[0].untyped_storage()
        self.storages = [(st.data_ptr(), st.nbytes())]
        self.desc = vllm_layout_desc(self.region_map, f"vllm-paged/{adapter.name}", "bfloat16", BS, H, D)

    def source(self, kind: str):
        cls = RingGatherSource if kind == "staged" else VllmBlockSource
        return cls(self.region_map, self.desc, self.storages, caches=self.layers)


def _adapters():
    kw = dict(num_kv_heads=H, block_size=BS, head_dim=D, dtype=torch.bfloat16)
    return {
        "flash-nhd": (FlashAttnKVLayout(**kw), "LBNHC"),
        "cpu-vec": (CpuAttnKVLayout(isa="vec", **kw), "LBHNC"),
        "cpu-amx": (CpuAttnKVLayout(isa="amx", **kw), "LBHNC"),
    }


def _assert_pool_holds(dec, cache, src, dst, dtype):
    for layer in range(L):
        for kv in range(2):
            want = tilize_pack(cache.kv[layer][kv][torch.as_tensor(src)].to(torch.float32), dtype)
            got = dec.read_blocks(layer, kv, dst)
            assert torch.equal(got, want.reshape(got.shape)), (layer, kv)


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat8_b"])
@pytest.mark.parametrize("layout", list(_adapters()))
@pytest.mark.parametrize("kind", ["staged", "direct"])
def test_gn_host_fix_puts_exact_bytes_in_the_pool(layout, dtype, kind):
    adapter, order = _adapters()[layout]
    cache = VllmCache(adapter, order, seed=7)
    wire = wire_layout_of(adapter, cache.layers[0])
    assert wire.order == ("NHC" if order == "LBNHC" else "HNC")
    tp, td = make_transport("host_staged"), make_transport("host_staged")
    pre = PrefillEndpoint(cache.source(kind), tp, COMPAT, ring_nbytes=1 << 20, claim_wait_s=0.2)
    dev = EmulatedDevice("p150a", 8 << 20)
    dec = None
    try:
        dec = GNHostDecode(
            dev, TTKVCacheSpec(L, 16, H, BS, D, dtype), td, pre.endpoint, COMPAT, wire, recv_nbytes=1 << 20
        )
        rng = np.random.default_rng(len(layout) + len(dtype) + len(kind))
        for i in range(3):
            n = int(rng.integers(1, 5 * BS))
            nb = -(-n // BS)
            src, dst = rng.permutation(NB)[:nb], rng.permutation(16)[:nb]
            pre.add_request(f"r{i}", src, n)
            res = dec.fetch(f"r{i}", n, dst)
            _assert_pool_holds(dec, cache, src, dst, dtype)
            assert res.nbytes == nb * L * wire.block_nbytes  # vLLM bytes on the wire, not tiles
            assert res.extra["page_writes"] > 0 and res.extra["fix_transform_s"] >= 0
            assert dec.sink.idle() and pre.snapshot()["requests"] == 0
            assert pre.snapshot().get("ring_used", 0) == 0
    finally:
        if dec is not None:
            dec.close()
        pre.close()
        tp.close()
        td.close()
    assert dev.live_buffers() == []


def test_a_wrong_block_layout_is_refused_and_frees_both_sides():
    """A decode expecting blocks of another size gets a refusal naming it; nothing stays held."""
    adapter, order = _adapters()["flash-nhd"]
    cache = VllmCache(adapter, order, seed=1)
    other = WireLayout(FlashAttnKVLayout(num_kv_heads=H, block_size=BS, head_dim=D, dtype=torch.float32), "NHC")
    tp, td = make_transport("host_staged"), make_transport("host_staged")
    pre = PrefillEndpoint(cache.source("staged"), tp, COMPAT, ring_nbytes=1 << 20, claim_wait_s=0.2)
    dev = EmulatedDevice("p150a", 8 << 20)
    dec = GNHostDecode(
        dev, TTKVCacheSpec(L, 16, H, BS, D, "bfloat16"), td, pre.endpoint, COMPAT, other, recv_nbytes=1 << 20
    )
    try:
        pre.add_request("w", [3, 4], 2 * BS)
        with pytest.raises(PeerFailed, match="dtype"):
            dec.fetch("w", 2 * BS, [0, 1])
        assert dec.sink.idle() and pre.snapshot()["ring_used"] == 0
    finally:
        dec.close()
        pre.close()
        tp.close()
        td.close()
    assert dev.live_buffers() == []


def test_a_bad_block_id_is_named_and_the_sink_asks_for_vllm_blocks():
    adapter, order = _adapters()["cpu-vec"]
    cache = VllmCache(adapter, order, seed=2)
    wire = wire_layout_of(adapter, cache.layers[0])
    td = make_transport("host_staged")
    dev = EmulatedDevice("p150a", 8 << 20)
    layout, bufs = dev.allocate_kv_cache(TTKVCacheSpec(L, 16, H, BS, D, "bfloat16"))
    sink = GNHostSink(dev, layout, bufs, td, wire, recv_nbytes=1 << 16)
    try:
        with pytest.raises(ValueError, match="block"):
            sink.plan(np.array([99]))
        assert sink.layout.num_banks == 1 and sink.layout.tile_nbytes == wire.block_nbytes
        sink.warm()  # the decode compiles the fix's kernels at start-up (scratch only)
        assert sink.idle()
    finally:
        sink.close()
        td.close()
        for b in bufs:
            dev.free_buffer(b)
    assert dev.live_buffers() == []


def test_wire_layouts():
    ad = _adapters()
    assert host_wire_layout(H, BS, D, torch.bfloat16).name.startswith("CPU_ATTN/")
    assert wire_layout_of(ad["flash-nhd"][0], make_layer_caches(1, 4, H, BS, 2 * D)[0]).name == "FLASH_ATTN/NHC"
    with pytest.raises(NotImplementedError, match="contiguous"):  # head-outer: a block is H runs
        wire_layout_of(ad["flash-nhd"][0], make_layer_caches(1, 4, H, BS, 2 * D, layout="LHBNC")[0])
    with pytest.raises(ValueError, match="block order"):
        WireLayout(ad["flash-nhd"][0], "NCH")
