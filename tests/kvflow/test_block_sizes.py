"""A prefill and a decode with different block sizes (in process: real endpoints, the
emulated Tenstorrent pool, the in-process transport).

GN-HAWK: the prefill's transform regroups tokens into the decode's blocks, whatever the
two sizes: a GPU's 16-token blocks (the transform gathers them into the decode's blocks
first), 32 or 64 into a decode of 32 or 64, and a prefill block larger than the decode's,
also for a pull that starts past the decode's local prefix (a token offset inside a
source block). The pool must hold exactly ``tilize_pack`` of the prefill's tokens.

GG pairs (two vLLM caches): a decode whose blocks are a multiple of the prefill's lands
the prefill's blocks as sub-blocks of its own and regroups them (FlashAttention NHD and
HND, CPU_ATTN vec and amx; direct and staged; after a local prefix; a head share). Every
other pair is refused with both sizes and the setting to change, at the handshake and,
for a decode that lies in its fields, by both sides' checks.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch
from kvflow_helpers import D, H, L, assert_pool_holds, reference

from vllm_hawk.bench.endpoints import TTDecode, VllmDecode, prefill_endpoint
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.kvflow import PeerFailed
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import IncompatiblePeer, make_compat
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


# --------------------------------------------------------------------------- GG pairs

#: vLLM 0.32 cache layouts a GG pair may have (both sides alike): FlashAttention NHD (the
#: landed sub-blocks already are the decode's block) and HND, the CPU engine's vec and amx
GG_LAYOUTS = {
    "flash-nhd": dict(backend="FLASH_ATTN"),
    "flash-hnd": dict(backend="FLASH_ATTN", kv_layout="LBHNC"),
    "cpu-vec": dict(backend="CPU_ATTN", isa="vec"),
    "cpu-amx": dict(backend="CPU_ATTN", isa="amx"),
}
SECRET = b"0123456789abcdef-block-sizes"


def _gg_compat(bs: int):
    return make_compat("tiny", "bfloat16", bs, "CPU_ATTN/vec/BHNC", "vllm-paged/CPU_ATTN/vec/BHNC", "vllm")


@contextlib.contextmanager
def _gg_pair(layout: str, src_bs: int, dst_bs: int, mode: str = "direct", src_heads: int = H, dst_heads: int = H):
    """A GG prefill (blocks of ``src_bs`` tokens, served in place or gathered into its ring
    for ``mode`` staged) and a vLLM decode (``dst_bs``) of ``layout``, authenticated."""
    src = PagedKVCache(L, 40, src_heads, src_bs, D, **GG_LAYOUTS[layout]).fill_random(src_bs)
    dst = PagedKVCache(L, 24, dst_heads, dst_bs, D, **GG_LAYOUTS[layout]).fill_random(dst_bs + 1)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    kind = "vllm" if mode == "direct" else "staged"
    pre = prefill_endpoint(src, tp, _gg_compat(src_bs), kind, ring_nbytes=4 << 20, secret=SECRET, auth="hmac")
    dec = None
    try:
        dec = VllmDecode(
            dst, td, pre.endpoint, _gg_compat(dst_bs), mode=mode, recv_nbytes=4 << 20, secret=SECRET, auth="hmac"
        )
        yield src, dst, pre, dec
        assert pre.snapshot().get("ring_used", 0) == 0 and pre.snapshot()["requests"] == 0
    finally:
        if dec is not None:
            dec.close()
        pre.close()
        tp.close()
        td.close()


def _assert_landed(src, dst, src_ids, dst_ids, heads=slice(None)) -> None:
    """The decode's blocks ``dst_ids`` hold the prefill's tokens of ``src_ids`` in order
    (``heads`` of the decode's), and zeros past the last source block."""
    n = len(src_ids) * src.block_size
    for layer in range(L):
        for kv in range(2):
            got = dst.tokens(layer, kv, dst_ids)[heads]
            assert torch.equal(got[:, :n], src.tokens(layer, kv, src_ids)), (layer, kv)
            assert not got[:, n:].any(), (layer, kv)


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("src_bs,dst_bs", [(16, 32), (16, 64), (32, 64), (32, 32)])
@pytest.mark.parametrize("layout", list(GG_LAYOUTS))
def test_gg_decode_regroups_smaller_prefill_blocks(layout, src_bs, dst_bs, mode):
    """The prefill serves its own blocks; the decode lands them as sub-blocks of its own and
    regroups them: its blocks then hold the prefill's tokens, each READ as large as with
    equal sizes (consecutive blocks: one READ per layer)."""
    if layout == "cpu-amx" and src_bs % 32:
        pytest.skip("vLLM's amx layout takes multiples of 32 tokens per block only")
    with _gg_pair(layout, src_bs, dst_bs, mode) as (src, dst, pre, dec):
        rng = np.random.default_rng(src_bs * 100 + dst_bs)
        for i, n in enumerate((1, dst_bs + 5, 3 * 64 + 17)):
            src_ids = rng.permutation(40)[: -(-n // src_bs)]
            dst_ids = rng.permutation(24)[: -(-n // dst_bs)]
            pre.add_request(f"r{i}", src_ids, n)
            res = dec.fetch(f"r{i}", n, dst_ids)
            _assert_landed(src, dst, src_ids, dst_ids)
            assert res.extra.get("src_block_size") == (src_bs if src_bs != dst_bs else None)
        n = 2 * dst_bs  # consecutive blocks on both sides: one READ per layer at most
        pre.add_request("runs", np.arange(3, 3 + n // src_bs), n)
        res = dec.fetch("runs", n, [5, 6])
        _assert_landed(src, dst, np.arange(3, 3 + n // src_bs), [5, 6])
        assert res.entries <= L


@pytest.mark.parametrize(
    "layout,src_bs,unit",
    [("flash-nhd", 16, None), ("flash-hnd", 16, 16 * 2 * D), ("cpu-vec", 32, 32), ("cpu-amx", 32, 16 * 32)],
)
def test_the_regroup_moves_runs_of_elements(layout, src_bs, unit):
    """The regroup of a layout (found once, through its adapter) moves whole runs: nothing
    for FlashAttention NHD, a source block's head at a time for HND, a token row of K
    (vec: K is [D, N]) or a 16-dim group of V token pairs (amx) at the least."""
    from vllm_hawk.kvflow.regroup import Regroup

    cache = PagedKVCache(L, 4, H, 64, D, **GG_LAYOUTS[layout])
    m = Regroup([cache.adapter] * L, cache.layers).block_map(0, 64 // src_bs)
    assert (m.runs is None and unit is None) or m.unit == unit
    assert sorted(m.token.tolist()) == sorted(list(range(64)) * (H * 2 * D))  # every element is one token's


@pytest.mark.parametrize("layout", ["cpu-vec", "flash-hnd"])
@pytest.mark.parametrize("src_bs", [16, 32])
def test_gg_regroup_after_a_local_prefix(layout, src_bs):
    """The decode holds its first 64-token block already and pulls the rest: the prefill
    sends its blocks from token 64 on, the last decode block gets part of its sub-blocks."""
    with _gg_pair(layout, src_bs, 64) as (src, dst, pre, dec):
        n, ratio = 4 * 32 + 9, 64 // src_bs
        src_ids = [7, 3, 11, 2, 9, 5, 30, 21, 14][: -(-n // src_bs)]
        dst_ids = [4, 9, 1]
        pre.add_request("p", src_ids, n)
        res = dec.fetch("p", n, dst_ids[1:], first_block=1)
        _assert_landed(src, dst, src_ids[ratio:], dst_ids[1:])
        assert res.nbytes == len(src_ids[ratio:]) * src.block_nbytes * L


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("layout", ["cpu-vec", "flash-nhd"])
def test_gg_regroup_into_a_head_share(layout, mode):
    """Tensor parallelism: a decode rank holding 4 KV heads takes heads 2..3 from a prefill
    rank holding 2 (a sink view of those heads) and regroups only them."""
    from vllm_hawk.kvflow import vllm_layout_desc
    from vllm_hawk.kvflow.streams import head_maps

    with _gg_pair(layout, 32, 64, mode, src_heads=2, dst_heads=4) as (src, dst, pre, dec):
        m = head_maps(dst.layers)(2, 2)
        sink = dec.sink.for_heads(m, vllm_layout_desc(m, dst.name, "bfloat16", 64, 2, D), 2)
        n, src_ids, dst_ids = 2 * 64 + 5, [8, 1, 6, 2, 9], [3, 0, 7]
        others = [dst.tokens(layer, kv, dst_ids)[:2] for layer in range(L) for kv in range(2)]
        pre.add_request("s", src_ids, n)
        dec.ep.fetch("s", n, sink, dst_ids)
        _assert_landed(src, dst, src_ids, dst_ids, heads=slice(2, 4))
        assert all(
            torch.equal(dst.tokens(layer, kv, dst_ids)[:2], others[2 * layer + kv])
            for layer in range(L)
            for kv in range(2)
        )


@pytest.mark.parametrize(
    "src_bs,dst_bs,fix",
    [
        (64, 32, "start the prefill with --block-size 32 (or a divisor of it), or the decode with --block-size 64"),
        (32, 48, "start the prefill with --block-size 48 (or a divisor of it), or the decode with --block-size 32"),
    ],
    ids=["64to32", "32to48"],
)
def test_gg_pairs_that_cannot_regroup_are_refused_at_the_handshake(src_bs, dst_bs, fix):
    """A prefill block larger than the decode's, or sizes that do not divide: refused at the
    first handshake, naming both sizes and the setting (values to an authenticated peer
    only; an unauthenticated one is told the rule and the setting)."""
    cache = PagedKVCache(L, 8, H, src_bs, D).fill_random(1)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = prefill_endpoint(cache, tp, _gg_compat(src_bs), "vllm", secret=SECRET, auth="hmac")
    open_pre = prefill_endpoint(cache, tp, _gg_compat(src_bs), "vllm")
    try:
        want = re.escape(f"block_size differs (ours {src_bs}, peer {dst_bs}): ") + f".*{re.escape(fix)}"
        with pytest.raises(IncompatiblePeer, match=want):
            VllmDecode(
                PagedKVCache(L, 8, H, dst_bs, D), td, pre.endpoint, _gg_compat(dst_bs), secret=SECRET, auth="hmac"
            )
        with pytest.raises(IncompatiblePeer, match="block_size differs: a vLLM decode regroups .* --block-size"):
            VllmDecode(PagedKVCache(L, 8, H, dst_bs, D), td, open_pre.endpoint, _gg_compat(dst_bs))
        assert pre.server.stats.handshakes_refused == 1
    finally:
        pre.close()
        open_pre.close()
        tp.close()
        td.close()


def test_a_decode_that_lies_about_its_block_size_is_refused_by_both_sides():
    """A decode whose fields claim the prefill's block size: its own plan refuses blocks
    smaller than the prefill's (the HelloAck names the prefill's), and the prefill refuses
    a KVRequest for blocks that are not a multiple of its own, naming both sizes."""
    from vllm_hawk.protocol import KVRequest, RemoteError

    with _gg_pair("flash-nhd", 32, 32) as (_src, _dst, pre, _dec):
        td = make_transport("inprocess")
        small = PagedKVCache(L, 8, H, 16, D)
        dec = VllmDecode(small, td, pre.endpoint, _gg_compat(32), secret=SECRET, auth="hmac")
        try:
            pre.add_request("g", [1, 2], 64)
            with pytest.raises(PeerFailed, match="the prefill's blocks hold 32 tokens, this decode's 16"):
                dec.fetch("g", 64, [1, 2, 3, 4])
            pre.add_request("h", [1, 2], 64)
            msg = KVRequest(req_id="h", dst_layout=small.desc, num_tokens=64, dst_block_ids=[1, 2, 3, 4])
            with pytest.raises(
                RemoteError, match="block_size 16 is not a multiple of this prefill's 32.*--block-size 32"
            ):
                dec.client.request_kv(msg, timeout_s=5)
            dec.ep.release("h", ok=False)
        finally:
            dec.close()
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
