"""A prefill and a decode with different block sizes (in process: real endpoints, the
emulated Tenstorrent pool, the in-process transport).

GN-HAWK: the prefill's transform regroups tokens into the decode's blocks, whatever the
two sizes: a GPU's 16-token blocks (the transform gathers them into the decode's blocks
first), 32 or 64 into a decode of 32 or 64, and a prefill block larger than the decode's,
also for a pull that starts past the decode's local prefix (a token offset inside a
source block). The pool must hold exactly ``tilize_pack`` of the prefill's tokens.

GG pairs (two vLLM caches): refused with both sizes and the setting to change, at the
handshake (the compatibility fields) and by the prefill's source (a KVRequest naming
another block size).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvflow_helpers import D, H, L, assert_pool_holds, reference

from vllm_hawk.kvflow import PeerFailed
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import IncompatiblePeer, make_compat
from vllm_hawk.testing.endpoints import TTDecode, VllmDecode, prefill_endpoint
from vllm_hawk.testing.paged_cache import PagedKVCache
from vllm_hawk.transport import make_transport

GN = make_compat("tiny", "bfloat16", 0, "vllm-any", "tt-paged", "p150a")  # GN-HAWK: block size 0


def _gn_pair(src_bs: int, dst_bs: int, dtype: str):
    cache = PagedKVCache(L, 40, H, src_bs, D).fill_random(src_bs + dst_bs)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = prefill_endpoint(cache, tp, GN, ring_nbytes=4 << 20)
    dev = EmulatedDevice("p150a", 8 << 20)
    dec = TTDecode(dev, TTKVCacheSpec(L, 24, H, dst_bs, D, dtype), td, pre.endpoint, GN, recv_nbytes_per_bank=256 << 10)

    def close():
        dec.close()
        pre.close()
        tp.close()
        td.close()
        assert dev.live_buffers() == []

    return cache, pre, dec, close


@pytest.mark.parametrize("src_bs,dst_bs", [(16, 32), (16, 64), (32, 64), (64, 32), (32, 32)])
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_gn_hawk_regroups_any_block_sizes(src_bs, dst_bs, mode):
    dtype = "bfloat8_b" if mode == "direct" else "bfloat16"
    cache, pre, dec, close = _gn_pair(src_bs, dst_bs, dtype)
    try:
        rng = np.random.default_rng(src_bs * 100 + dst_bs)
        for i, n in enumerate((1, dst_bs + 5, 3 * 64 + 17)):
            src = rng.permutation(40)[: -(-n // src_bs)]
            dst = rng.permutation(24)[: -(-n // dst_bs)]
            pre.add_request(f"r{i}", src, n)
            dec.fetch(f"r{i}", n, dst, mode)
            assert_pool_holds(dec, cache, src, n, dst)
            assert pre.snapshot()["ring_used"] == 0 and pre.snapshot()["requests"] == 0
    finally:
        close()


@pytest.mark.parametrize("src_bs,dst_bs", [(64, 32), (16, 32), (32, 64)])
def test_gn_hawk_pull_after_a_local_prefix(src_bs, dst_bs):
    """The decode holds its first block already and pulls the rest: the prefill starts
    inside a source block when its blocks are the larger ones (token offset 32)."""
    cache, pre, dec, close = _gn_pair(src_bs, dst_bs, "bfloat16")
    try:
        n = 4 * 32 + 9
        src = [7, 3, 11, 2, 9, 5, 30, 21, 14][: -(-n // src_bs)]
        dst = [4, 9, 1, 6, 12][: -(-n // dst_bs)]
        pre.add_request("p", src, n)
        dec.fetch("p", n, dst[1:], first_block=1)
        tpb = H * (dst_bs // 32) * (D // 32)  # tiles per (layer, K|V) destination block
        for layer in range(L):
            for kv in range(2):
                want = reference(cache, layer, kv, src, n, "bfloat16", dst_bs)[tpb:]
                assert torch.equal(dec.read_blocks(layer, kv, dst[1:]), want), (layer, kv)
    finally:
        close()


def test_gg_pairs_with_different_block_sizes_are_refused_naming_both_and_the_setting():
    cache = PagedKVCache(L, 8, H, 32, D).fill_random(1)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pc = make_compat("tiny", "bfloat16", 32, "FLASH_ATTN", "vllm-paged", "vllm")
    pre = prefill_endpoint(cache, tp, pc, "vllm")
    try:
        dc = make_compat("tiny", "bfloat16", 64, "FLASH_ATTN", "vllm-paged", "vllm")
        with pytest.raises(IncompatiblePeer, match="block_size differs: start both engines with the same --block-size"):
            VllmDecode(PagedKVCache(L, 8, H, 64, D), td, pre.endpoint, dc)
        dec = VllmDecode(PagedKVCache(L, 8, H, 64, D), td, pre.endpoint, pc)  # a decode that lies in its fields
        try:
            pre.add_request("g", [1, 2], 64)
            with pytest.raises(
                PeerFailed, match="layout_mismatch.*block_size 64 differs from this prefill's 32.*--block-size 32"
            ):
                dec.fetch("g", 64, [3])
            assert pre.snapshot()["requests"] == 0  # the decode's Release freed it
        finally:
            dec.close()
    finally:
        pre.close()
        tp.close()
        td.close()


@pytest.mark.parametrize("src_bs,offset", [(16, 0), (64, 32)])
def test_layer_groups_of_a_regrouped_request_add_up_to_the_whole(src_bs, offset):
    """Layer groups (the prefill transforms group i+1 while the decode reads group i) write
    disjoint bytes that add up to the whole G', for 16-token sources (gathered into the
    decode's blocks per group) and for a span starting inside a source block."""
    from vllm_hawk.layout.device_profiles import load_profile
    from vllm_hawk.layout.formats import tile_format
    from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout
    from vllm_hawk.layout.vllm_kv import TransformSource
    from vllm_hawk.transform import make_plan, transform_source

    layers = 3
    cache = PagedKVCache(layers, 12, H, src_bs, D).fill_random(9)
    src = TransformSource.of_views(cache.kv_views())
    prof, tb = load_profile("p150a"), tile_format("bfloat8_b").tile_nbytes
    spec = TTKVCacheSpec(layers, 6, H, 64, D, "bfloat8_b")
    plan = make_plan(
        TTKVCacheLayout(spec, prof.num_banks, prof.aligned_page(tb), ((0, 0),) * layers), [4, 1, 5], "staged"
    )
    ids = [3, 7, 0, 9, 2, 11, 5, 8, 1, 10, 4, 6][: -(-(3 * 64 + offset) // src_bs)]
    whole = torch.zeros(plan.total_nbytes, dtype=torch.uint8)
    transform_source(src, ids, src_bs, plan, whole, src_token_offset=offset)
    groups = torch.full_like(whole, 0xAB)
    for lo, hi in ((0, 1), (1, 3)):
        transform_source(src, ids, src_bs, plan, groups, (lo, hi), src_token_offset=offset)
    assert torch.equal(groups, whole)
