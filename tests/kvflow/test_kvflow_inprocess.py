"""Algorithm 1 end to end inside one process (in-process transport): exact bytes in the
KV pool for every mode and dtype, the baselines' paths, and refusals that leave nothing
held on either side."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from kvflow_helpers import BS, COMPAT, D, H, L, assert_pool_holds, reference

from vllm_hawk.bench.endpoints import GNHostDecode, TTDecode, VllmDecode, prefill_endpoint, source_for
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.kvflow import PeerFailed, PrefillEndpoint
from vllm_hawk.kvflow.gn_host import wire_layout_of
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import KVReady, Segment
from vllm_hawk.transport import TransferFailed, make_transport


@pytest.fixture()
def pair():
    cache = PagedKVCache(L, 48, H, BS, D).fill_random(3)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = prefill_endpoint(cache, tp, COMPAT, ring_nbytes=1 << 20, claim_wait_s=0.2)
    dev = EmulatedDevice("p150a", 8 << 20)
    decs = {}
    try:
        for dtype in ("bfloat16", "bfloat8_b"):
            decs[dtype] = TTDecode(
                dev,
                TTKVCacheSpec(L, 32, H, BS, D, dtype),
                td,
                pre.endpoint,
                COMPAT,
                recv_nbytes_per_bank=128 << 10,
                timeout_s=10,
            )
        yield cache, pre, decs, dev, tp, td
    finally:
        for d in decs.values():
            d.close()
        pre.close()
        tp.close()
        td.close()
    assert dev.live_buffers() == []


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat8_b"])
@pytest.mark.parametrize("mode", ["staged", "direct", "per_tile"])
def test_fetch_puts_exact_bytes_in_the_pool(pair, mode, dtype):
    cache, pre, decs, dev, *_ = pair
    dec = decs[dtype]
    rng = np.random.default_rng(hash((mode, dtype)) % 2**32)
    for i in range(3):
        n = int(rng.integers(1, 5 * BS))
        nb = -(-n // BS)
        src = rng.permutation(48)[:nb]
        dst = rng.permutation(32)[:nb]
        pre.add_request(f"r{i}", src, n)
        res = dec.fetch(f"r{i}", n, dst, mode)
        assert_pool_holds(dec, cache, src, n, dst)
        assert res.nbytes == nb * 16 * dec.layout.spec.tile_nbytes * L  # 8 K + 8 V tiles per block
        if mode == "staged":
            assert res.entries == 8  # one READ per bank
        assert dec.pool.is_idle()
        assert pre.snapshot()["ring_used"] == 0 and pre.snapshot()["requests"] == 0


def test_gg_and_gn_host_baselines_move_the_same_kv():
    cache = PagedKVCache(L, 48, H, BS, D).fill_random(5)
    for kind in ("inprocess", "host_staged"):
        tp, td = make_transport(kind), make_transport(kind)
        pre = prefill_endpoint(cache, tp, COMPAT, "vllm")
        dst_cache = PagedKVCache(L, 40, H, BS, D)
        dec = VllmDecode(dst_cache, td, pre.endpoint, COMPAT)
        dev = EmulatedDevice("p150a", 8 << 20)
        gn = GNHostDecode(
            dev,
            TTKVCacheSpec(L, 32, H, BS, D, "bfloat8_b"),
            td,
            pre.endpoint,
            COMPAT,
            wire_layout_of(cache.adapter, cache.layers[0]),
            recv_nbytes=1 << 20,
        )
        try:
            src, dst, tt_dst, n = [4, 5, 6, 20, 9], [1, 2, 30, 31, 7], [3, 4, 5, 9, 10], 300
            pre.add_request("g", src, n)
            res = dec.fetch("g", n, dst)
            pre.add_request("n", src, n)
            gres = gn.fetch("n", n, tt_dst)  # the runtime GN-Host sink: same bytes moved, layout fixed here
            assert res.entries == 4 * L  # runs consecutive on both sides: 4,5->1,2  6->30  20->31  9->7
            assert gres.nbytes == res.nbytes
            for layer in range(L):
                assert torch.equal(dst_cache.layers[layer][dst], cache.layers[layer][src])
                for kv in range(2):
                    got = gn.read_blocks(layer, kv, tt_dst)
                    assert torch.equal(got, reference(cache, layer, kv, src, n, "bfloat8_b"))
            assert pre.snapshot()["requests"] == 0
        finally:
            gn.close()
            dec.close()
            pre.close()
            tp.close()
            td.close()
        assert dev.live_buffers() == []


class ForgingPrefill(PrefillEndpoint):
    """Replies with KVReady messages that do not match what the decode asked for."""

    forge = "shift"

    def _serve(self, msg, reply):
        def forged(out):
            if isinstance(out, KVReady):
                segs = list(out.segments)
                if self.forge == "shift":  # a segment pointing at another bank's bytes
                    segs[0], segs[1] = (
                        Segment(segs[0].bank, segs[1].offset_bytes, segs[0].nbytes),
                        Segment(segs[1].bank, segs[0].offset_bytes, segs[1].nbytes),
                    )
                elif self.forge == "outside":  # past the end of the ring
                    off = self.ring.capacity
                    segs = [Segment(s.bank, off + i * s.nbytes, s.nbytes) for i, s in enumerate(segs)]
                    out = KVReady(req_id=out.req_id, ring_offset=off, total_nbytes=out.total_nbytes, segments=segs)
                    reply(out)
                    return
                out = KVReady(
                    req_id=out.req_id, ring_offset=out.ring_offset, total_nbytes=out.total_nbytes, segments=segs
                )
            reply(out)

        super()._serve(msg, forged)


@pytest.mark.parametrize("forge", ["shift", "outside"])
def test_forged_kvready_is_refused_and_nothing_is_held(forge):
    cache = PagedKVCache(L, 16, H, BS, D).fill_random(1)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    pre = ForgingPrefill(source_for(cache, "hawk"), tp, COMPAT, ring_nbytes=1 << 20)
    pre.forge = forge
    dev = EmulatedDevice("p150a", 8 << 20)
    dec = TTDecode(
        dev,
        TTKVCacheSpec(L, 16, H, BS, D, "bfloat16"),
        td,
        pre.endpoint,
        COMPAT,
        recv_nbytes_per_bank=64 << 10,
        timeout_s=5,
    )
    try:
        before = torch.cat([dec.read_blocks(0, 0, [1, 2])])
        pre.add_request("f", [1, 2], 128)
        with pytest.raises(PeerFailed, match="outside|do not match"):
            dec.fetch("f", 128, [1, 2], "staged")
        assert torch.equal(dec.read_blocks(0, 0, [1, 2]), before)  # nothing written
        assert dec.pool.is_idle()
        assert pre.snapshot()["ring_used"] == 0  # the decode released it (ok=False)
    finally:
        dec.close()
        pre.close()
        tp.close()
        td.close()


def test_refusals_unknown_request_ring_too_small_and_reads_outside_the_ring(pair):
    cache, pre, decs, dev, tp, td = pair
    dec = decs["bfloat16"]
    with pytest.raises(PeerFailed, match="unknown_request"):
        dec.fetch("never-prefilled", 64, [0], "staged", timeout_s=5)  # refused 1 s before the deadline
    pre.add_request("big", list(range(20)), 20 * BS)  # 20 blocks of bf16 = 1.25 MiB > 1 MiB ring
    t0 = time.monotonic()
    with pytest.raises(PeerFailed) as e:
        dec.fetch("big", 20 * BS, list(range(20)), "direct", timeout_s=10)
    # refused for good (not no_space, which the decode asks again until its deadline),
    # naming the request's bytes, the ring's and the field to raise
    text = str(e.value)
    assert time.monotonic() - t0 < 5 and "layout_mismatch" in text
    need = int(re.search(r"(\d+) bytes of ring", text).group(1))
    assert need > pre.ring.capacity and f"whole {pre.ring.capacity}-byte ring" in text
    assert "kv_connector_extra_config.ring_nbytes" in text
    assert pre.stats.refusals.snapshot().get("ring_too_small") == 1
    assert pre.snapshot()["ring_used"] == 0 and dec.pool.is_idle()
    # The prefill registers only live ring ranges: a READ of its KV cache, of its idle ring,
    # or past the ring is refused by the transport; the decode's idle receive pool is not
    # registered either.
    assert td._regions.regions() == [] and tp._regions.regions() == []
    scratch = torch.empty(4096, dtype=torch.uint8)
    td.register(scratch.data_ptr(), 4096)
    try:
        for remote in (cache.base_addr, dec.export_base, dec.export_base + dec.export_nbytes - 100):
            h = td.submit("read", dec.peer, [(scratch.data_ptr(), remote, 4096)])
            with pytest.raises(TransferFailed):
                td.wait(h, 5)
    finally:
        td.unregister(scratch.data_ptr())
