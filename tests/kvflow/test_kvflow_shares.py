"""Shares of a tensor-parallel pull (:mod:`vllm_hawk.kvflow.shares`), in one process
(in-process transport): exact bytes for every pairing of prefill and decode heads, a
prefill that frees a request only after all its shares are released, and refusals.

Prefill rank caches hold ``H_P`` KV heads each, decode caches ``H_D``; the model has
``H`` = 4 heads. The head slices are views (:func:`vllm_hawk.kvflow.streams.head_maps`)."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_hawk.bench.endpoints import TTDecode
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.kvflow import DecodeEndpoint, PeerFailed, PrefillEndpoint, RingGatherSource, VllmBlockSource, vllm_sink
from vllm_hawk.kvflow.shares import fetch_shares, idle_ranks, plan_shares
from vllm_hawk.kvflow.sources import TileTransformSource
from vllm_hawk.kvflow.streams import head_maps
from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import RemoteError, make_compat
from vllm_hawk.transport import make_transport

L, H, BS, D = 2, 4, 32, 64
COMPAT = make_compat("tiny", "bfloat16", BS, "vllm-flash-nhd", "vllm-paged", "vllm")


class _Prefill:
    """One prefill rank: its cache (``heads`` KV heads, seeded by rank) and endpoint."""

    def __init__(self, rank: int, heads: int, transport, kind: str, compat=COMPAT) -> None:
        self.cache = PagedKVCache(L, 16, heads, BS, D).fill_random(100 + rank)
        c = self.cache
        if kind == "hawk":
            src = TileTransformSource(c.kv_views(), c.desc, load_profile("p150a"))
        else:
            cls = RingGatherSource if kind == "staged" else VllmBlockSource
            src = cls(c.region_map, c.desc, c.storages, head_maps(c.layers), c.layers)
        self.finished: list = []
        self.done = threading.Event()

        def on_finished(rid, ok):
            self.finished.append((rid, ok))
            self.done.set()

        self.ep = PrefillEndpoint(
            src, transport, compat, ring_nbytes=4 << 20, claim_wait_s=0.5, on_finished=on_finished
        )


class _Decode:
    """One decode target: its cache (``heads`` KV heads), sink and a DecodeEndpoint per prefill rank."""

    def __init__(self, heads: int, transport, prefills, mode: str) -> None:
        self.cache = PagedKVCache(L, 16, heads, BS, D)
        c = self.cache
        self.sink = vllm_sink(c.region_map, c.desc, transport, mode, c.storages, 4 << 20)
        self.maps = head_maps(c.layers)
        self.eps = [DecodeEndpoint(transport, p.ep.endpoint, COMPAT, pull_timeout_s=10) for p in prefills]

    def sink_for(self, ps):
        if ps.dst_start == 0 and ps.count == self.cache.num_kv_heads:
            return self.sink
        m = self.maps(ps.dst_start, ps.count)
        from vllm_hawk.kvflow.sources import vllm_layout_desc

        return self.sink.for_heads(m, vllm_layout_desc(m, "vllm-flash-nhd", "bfloat16", BS, ps.count, D), ps.dst_start)

    def close(self):
        for e in self.eps:
            e.close()
        self.sink.close()


def _global_heads(caches: list[PagedKVCache], layer: int, kv: int, blocks) -> torch.Tensor:
    """K or V ``[n, H, BS, D]`` of ``blocks`` over ranks (rank order = head order)."""
    idx = torch.as_tensor(blocks)
    return torch.cat([c.kv_views()[layer][kv].index_select(0, idx) for c in caches], dim=1)


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 2), (2, 1), (1, 2), (4, 2), (1, 4)])
def test_shares_land_every_head_exactly_and_free_once(p_tp, d_tp, mode):
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    kind = "staged" if mode == "staged" else "vllm"
    pres = [_Prefill(r, H // p_tp, tp, kind) for r in range(p_tp)]
    decs = [_Decode(H // d_tp, td, pres, mode) for _ in range(d_tp)]
    try:
        src, dst, n_tok = [3, 7, 1], [[2, 9, 4], [5, 0, 11], [1, 2, 3], [6, 7, 8]], 3 * BS - 5
        for p in pres:
            p.ep.add_request("r", src, n_tok)
        results = []
        for t, dec in enumerate(decs):  # one decode target after the other: prefills must hold until the last
            plan = plan_shares(H, p_tp, d_tp, t, H // d_tp)
            shares = [(dec.eps[ps.prefill_rank], dec.sink_for(ps), ps) for ps in plan]
            results.append(fetch_shares("r", n_tok, shares, dst[t]))
            if t < d_tp - 1:
                later = [plan_shares(H, p_tp, d_tp, d, H // d_tp) for d in range(t + 1, d_tp)]
                served = {ps.prefill_rank for plan_d in later for ps in plan_d}
                for r in served:
                    assert pres[r].finished == [], f"prefill rank {r} freed before its last share"
        for p in pres:
            assert p.done.wait(5), "a prefill rank never freed the request"
            assert p.finished == [("r", True)]
            assert p.ep.snapshot()["requests"] == 0
        for layer in range(L):
            for kv in range(2):
                want = _global_heads([p.cache for p in pres], layer, kv, src)
                got = torch.cat([_global_heads([dec.cache], layer, kv, dst[t]) for t, dec in enumerate(decs)], 1)
                assert torch.equal(got, want), (layer, kv)
        assert sum(r.nbytes for r in results) == L * 2 * 3 * H * BS * D * 2  # every head once
    finally:
        for d in decs:
            d.close()
        for p in pres:
            p.ep.close()
        tp.close()
        td.close()


def test_transform_share_lands_the_tilized_heads_of_one_chip():
    """GN-HAWK: a prefill rank with 4 heads serves chip 1 of 2 its heads 2..3 as G'."""
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    compat = make_compat("tiny", "bfloat16", BS, "vllm-any", "tt-paged", "p150a")
    pre = _Prefill(0, H, tp, "hawk", compat)
    dev = EmulatedDevice("p150a", 8 << 20)
    dec = TTDecode(
        dev, TTKVCacheSpec(L, 16, 2, BS, D, "bfloat16"), td, pre.ep.endpoint, compat, recv_nbytes_per_bank=256 << 10
    )
    try:
        pre.ep.add_request("r", [4, 5], 2 * BS)
        (ps,) = plan_shares(H, 1, 2, 1, 2)
        assert (ps.share.head_start, ps.share.num_heads, ps.share.consumers, ps.share.index) == (2, 2, 2, 1)
        dec.ep.fetch("r", 2 * BS, dec.sink("staged"), [7, 3], share=ps.share)
        assert pre.finished == []  # share 0 (chip 0) not released yet
        for layer in range(L):
            for kv in range(2):
                x = pre.cache.kv_views()[layer][kv][[4, 5]][:, 2:4]
                assert torch.equal(dec.read_blocks(layer, kv, [7, 3]), tilize_pack(x, "bfloat16"))
        dec.ep.release("r", share=plan_shares(H, 1, 2, 0, 2)[0].share)
        assert pre.done.wait(5) and pre.finished == [("r", True)]
    finally:
        dec.close()
        pre.ep.close()
        tp.close()
        td.close()
    assert dev.live_buffers() == []


def test_bad_shares_are_refused_and_strangers_cannot_claim():
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = _Prefill(0, 2, tp, "vllm")
    decs = [_Decode(1, td, [pre], "direct") for _ in range(3)]
    try:
        pre.ep.add_request("r", [1], BS)
        from vllm_hawk.kvflow import Share

        with pytest.raises(PeerFailed, match="holds 2"):  # heads 1..2 of a rank holding 2
            decs[0].eps[0].fetch("r", BS, decs[0].sink, [0], share=Share(1, 2, 2, 0, "x"))
        pre.ep.add_request("q", [2], BS)
        for i in range(2):
            decs[i].eps[0].fetch("q", BS, decs[i].sink, [0], share=Share(i, 1, 2, i, f"t{i}"))
        assert pre.finished[-1:] == [("q", True)]
        pre.ep.add_request("s", [3], BS)
        decs[0].eps[0].fetch("s", BS, decs[0].sink, [0], share=Share(0, 1, 2, 0, "t0"), release=False)
        decs[1].eps[0].fetch("s", BS, decs[1].sink, [0], share=Share(1, 1, 2, 1, "t1"), release=False)
        with pytest.raises(PeerFailed, match="another decode"):  # a third peer: both shares are claimed
            decs[2].eps[0].fetch("s", BS, decs[2].sink, [0], share=Share(1, 1, 2, 1, "t1"))
        assert pre.ep.refused_input() >= 1
        with pytest.raises(RemoteError, match="only the decode"):  # nor may it release them
            decs[2].eps[0].release("s", share=Share(index=1))
        for i in range(2):
            decs[i].eps[0].release("s", share=Share(index=i))
        assert pre.finished[-1:] == [("s", True)]
        # a consumer with nothing to pull releases its own share; the request ends with it
        pre.ep.add_request("u", [4], BS)
        decs[0].eps[0].fetch("u", BS, decs[0].sink, [0], share=Share(0, 1, 2, 0, "t0"))
        assert pre.finished[-1:] != [("u", True)]
        with pytest.raises(RemoteError, match="only the decode"):  # share 0 is claimed by decs[0]
            decs[2].eps[0].release("u", share=Share(index=0))
        decs[1].eps[0].release("u", share=Share(index=1))
        assert pre.finished[-1:] == [("u", True)]
    finally:
        for d in decs:
            d.close()
        pre.ep.close()
        tp.close()
        td.close()


def test_replicated_heads_name_one_serving_rank_and_release_the_rest():
    # 2 KV heads, prefill TP 4: ranks 0,1 hold head 0, ranks 2,3 head 1; ranks 1 and 3 serve nobody
    assert idle_ranks(2, 4, 1) == [1, 3]
    assert [ps.prefill_rank for ps in plan_shares(2, 4, 1, 0, 2)] == [0, 2]
    assert idle_ranks(4, 2, 1) == []


def test_a_share_needing_too_many_segments_is_refused_at_once():
    """Heads of an NHD cache served in place are one run per token: past the protocol's
    4096 segments per KVReady the prefill refuses (naming the count) instead of sending a
    KVReady the decode would drop, and the request is freed by the decode's Release."""
    from vllm_hawk.kvflow import Share

    tp, td = make_transport("inprocess"), make_transport("inprocess")
    cache = PagedKVCache(L, 70, 2, BS, D).fill_random(1)
    done = threading.Event()
    pre = PrefillEndpoint(
        VllmBlockSource(cache.region_map, cache.desc, cache.storages, head_maps(cache.layers), cache.layers),
        tp,
        COMPAT,
        ring_nbytes=1 << 20,
        on_finished=lambda rid, ok: done.set(),
    )
    dcache = PagedKVCache(L, 70, 1, BS, D)
    sink = vllm_sink(dcache.region_map, dcache.desc, td, "direct", dcache.storages, 1 << 20)
    ep = DecodeEndpoint(td, pre.endpoint, COMPAT, pull_timeout_s=10)
    try:
        n = 65  # 2 layers x 65 blocks x 32 tokens = 4160 runs
        pre.add_request("r", list(range(n)), n * BS)
        with pytest.raises(PeerFailed, match="4160 segments"):
            ep.fetch("r", n * BS, sink, list(range(n)), share=Share(1, 1, 1, 0, "t"))
        assert done.wait(5) and pre.snapshot()["requests"] == 0
    finally:
        ep.close()
        sink.close()
        pre.close()
        tp.close()
        td.close()
