"""Block-run planning of HawkConnector (pure): streams, segments, pairing, coalescing."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
from kvflow_helpers import gather_copies

from vllm_hawk.kvflow.streams import (
    KVRegionMap,
    LayerRegion,
    pair_stream,
    region_map_from_caches,
    ring_segments,
    source_segments,
)
from vllm_hawk.layout.vllm_kv import KV_CACHE_LAYOUTS, block_byte_ranges, make_layer_caches


def _caches(layout="LBHNC", num_blocks=12, layers=3, fill=True):
    caches = make_layer_caches(layers, num_blocks, 2, 4, 8, torch.float32, layout)
    if fill:
        # distinct value everywhere: write through the strided views
        for i, c in enumerate(caches):
            c.copy_(torch.arange(c.numel(), dtype=torch.float32).view(c.shape) + 1e4 * (i + 1))
    rmap = region_map_from_caches(caches, [block_byte_ranges(c, 0) for c in caches])
    return caches, rmap


def _copy(entries):
    for dst, src, n in entries:
        ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("layout", sorted(KV_CACHE_LAYOUTS))
def test_direct_pull_copies_exactly_the_requested_blocks(layout):
    src, smap = _caches(layout)
    dst, dmap = _caches(layout, num_blocks=20, fill=False)
    rng = random.Random(layout)
    src_blocks = rng.sample(range(12), 7)
    first = 2
    dst_blocks = rng.sample(range(20), len(src_blocks) - first)
    base = min(c.untyped_storage().data_ptr() for c in src)
    segs = source_segments(smap, src_blocks, base)
    entries = pair_stream(segs, base, dmap, dst_blocks, first)
    _copy(entries)
    for s, d in zip(src, dst, strict=False):
        torch.testing.assert_close(d[dst_blocks], s[src_blocks[first:]], rtol=0, atol=0)
        untouched = sorted(set(range(20)) - set(dst_blocks))
        assert torch.count_nonzero(d[untouched]) == 0


def test_consecutive_blocks_coalesce_into_one_entry_per_layer():
    src, smap = _caches("LBHNC")
    dst, dmap = _caches("LBHNC", num_blocks=20, fill=False)
    base = src[0].untyped_storage().data_ptr()
    segs = source_segments(smap, [3, 4, 5, 6], base)
    assert len(segs) == 3  # one run per layer
    entries = pair_stream(segs, base, dmap, [10, 11, 12, 13], 0)
    assert len(entries) == 3
    assert sum(n for *_x, n in entries) == 4 * smap.block_nbytes
    # a break on the destination side splits the run
    assert len(pair_stream(segs, base, dmap, [10, 11, 15, 16], 0)) == 6


def test_staged_gather_then_pull_through_receive_buffer():
    src, smap = _caches("LBNHC")
    dst, dmap = _caches("LBNHC", num_blocks=16, fill=False)
    blocks = [7, 1, 2, 9]
    ring = torch.zeros(len(blocks) * smap.block_nbytes + 4096, dtype=torch.uint8)
    off = 4096
    _copy(gather_copies(smap, blocks, ring.data_ptr() + off))
    segs = ring_segments(smap, len(blocks), off)
    assert [s.bank for s in segs] == [0, 1, 2]
    entries = pair_stream(segs, ring.data_ptr(), dmap, [3, 4, 5], 1)
    _copy(entries)
    for s, d in zip(src, dst, strict=False):
        torch.testing.assert_close(d[[3, 4, 5]], s[[1, 2, 9]], rtol=0, atol=0)


@pytest.mark.parametrize("layout", sorted(KV_CACHE_LAYOUTS))
@pytest.mark.parametrize("heads", [None, (1, 1)])
def test_torch_gather_writes_the_stream_gather_copies_describes(layout, heads):
    """The staged gather with torch (kvflow.gather, what the prefill runs on any device)
    writes the bytes the stream's copy list describes (memmove here, on host memory), for
    every KV cache layout, whole and for a head range (one run per token or per head)."""
    from vllm_hawk.kvflow.gather import BlockGather

    src, smap = _caches(layout)
    if heads is not None:
        src = [c[:, heads[0] : heads[0] + heads[1]] for c in src]
        smap = region_map_from_caches(src, [block_byte_ranges(c, 0) for c in src])
    blocks = [7, 1, 2, 9, 10]
    want = torch.zeros(len(blocks) * smap.block_nbytes, dtype=torch.uint8)
    _copy(gather_copies(smap, blocks, want.data_ptr()))
    got = torch.full_like(want, 0xAB)
    BlockGather.of_caches(src)(blocks, got)
    assert torch.equal(got, want)
    got.fill_(0xAB)  # the region map's templates give the same runs
    BlockGather(src, [r.template for r in smap.layers])(blocks, got)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="uint8"):
        BlockGather.of_caches(src)(blocks, got[:-1])


def test_pairing_refuses_short_or_mismatched_streams():
    src, smap = _caches()
    _, dmap = _caches(num_blocks=8, fill=False)
    base = src[0].untyped_storage().data_ptr()
    segs = source_segments(smap, [1, 2], base)
    with pytest.raises(ValueError, match="needed"):
        pair_stream(segs, base, dmap, [1, 2, 3], 0)
    with pytest.raises(ValueError, match="layers"):
        pair_stream([s for s in segs if s.bank != 1], base, dmap, [1], 0)
    with pytest.raises(ValueError, match="outside"):
        pair_stream(segs, base, dmap, [8], 0)
    with pytest.raises(ValueError, match="outside"):
        source_segments(smap, [12], base)


def test_signature_names_layers_and_template():
    _, a = _caches("LBHNC")
    _, b = _caches("LHBNC")
    assert a.signature().startswith("L3:")
    assert a.signature() != b.signature()  # head-outer: one run per head


def test_region_map_rejects_layers_of_different_sizes():
    a = torch.zeros(4, 2, 4, 8)
    b = torch.zeros(5, 2, 4, 8)
    with pytest.raises(ValueError, match="block counts"):
        region_map_from_caches([a, b], [block_byte_ranges(a, 0), block_byte_ranges(b, 0)])
    assert KVRegionMap((LayerRegion(0, 64, ((0, 32), (40, 8))),), 1).block_nbytes == 40
