"""The prefill side on a device, with real KVRequests: what ``scripts/gpu_check.py`` runs.

For each source a GPU prefill serves from — :class:`~vllm_hawk.kvflow.TileTransformSource`
(GN-HAWK, into bf16 and bfloat8_b tiles) and :class:`~vllm_hawk.kvflow.RingGatherSource`
(staged) — a :class:`~vllm_hawk.kvflow.PrefillEndpoint` over a FlashAttention (NHD) cache
on ``device`` serves ``repeats`` requests through its side channel (a real
:class:`~vllm_hawk.protocol.ProtocolClient` sends the KVRequest and the Release), and the
same endpoint over the same cache in host memory serves the same requests. Per source:

* ``bytes_equal_host``: the device ring's bytes (G' or the gathered streams) equal the
  host path's, byte for byte (first request);
* ``ring``, ``registered``: where the ring is and under which location it was registered
  (``cuda:0`` on a GPU; the transport is a
  :class:`~vllm_hawk.bench.recording_transport.RecordingTransport`: no NIC here);
* ``produce_gbps`` (source bytes / the endpoint's produce time, which includes the stream
  synchronisation before KVReady), ``copy_gbps`` (a device copy of the same number of
  bytes) and ``ratio`` (copy time / produce time, median within repeats);
* ``kvready_ms``: KVRequest sent to KVReady received, median (side channel included).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from vllm_hawk.bench.recording_transport import RecordingTransport
from vllm_hawk.kvflow import PrefillEndpoint, RingGatherSource, TileTransformSource
from vllm_hawk.kvflow.device import memory_location, synchronize
from vllm_hawk.kvflow.sources import tt_paged_desc, vllm_layout_desc
from vllm_hawk.kvflow.streams import head_maps, region_map_from_caches
from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.vllm_kv import FlashAttnKVLayout, TransformSource, block_byte_ranges, make_layer_caches
from vllm_hawk.protocol import KVRequest, LayoutDesc, ProtocolClient, make_compat

__all__ = ["SOURCES", "prefill_rows"]

SOURCES = (("tile-transform", "bfloat16"), ("tile-transform", "bfloat8_b"), ("ring-gather", "bfloat16"))
COMPAT = make_compat("gpu-check", "bfloat16", 0, "any", "any", "check")


def seeded_caches(layers: int, blocks: int, heads: int, bs: int, dim: int, device) -> list[torch.Tensor]:
    """FlashAttention (NHD) caches with N(0, 1) values made on the host (the same for every
    device), copied to ``device``."""
    caches = make_layer_caches(layers, blocks, heads, bs, 2 * dim, device=device)
    g = torch.Generator().manual_seed(0)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(torch.bfloat16).to(device))
    synchronize(device)
    return caches


def _source(kind: str, caches, heads: int, bs: int, dim: int, profile: str):
    region_map = region_map_from_caches(caches, [block_byte_ranges(c, 0) for c in caches])
    desc = vllm_layout_desc(region_map, "vllm-flash-nhd", "bfloat16", bs, heads, dim)
    if kind == "tile-transform":
        views = TransformSource([FlashAttnKVLayout(heads, bs, dim)] * len(caches), caches)
        return TileTransformSource(views, desc, load_profile(profile))
    return RingGatherSource(region_map, desc, [], head_maps(caches), caches)


def _dst_layout(src, kind: str, dtype: str, profile: str) -> LayoutDesc:
    return tt_paged_desc(src.layout, dtype, load_profile(profile)) if kind == "tile-transform" else src.layout


class _Served:
    """One endpoint over ``caches`` serving requests through its side channel."""

    def __init__(self, src, ring_nbytes: int) -> None:
        loc = memory_location(src.device)
        self.transport = RecordingTransport({"cpu", loc})
        self.ep = PrefillEndpoint(src, self.transport, COMPAT, ring_nbytes=ring_nbytes, auth="none")
        self.client = ProtocolClient(self.ep.endpoint, COMPAT, auth="none", timeout_s=600)
        self.client.handshake()

    def serve(self, rid: str, msg: KVRequest, src_blocks, tokens: int, keep: bool):
        """(KVRequest -> KVReady seconds, produce seconds, the ring bytes or None)."""
        self.ep.add_request(rid, src_blocks, tokens)
        t0 = time.perf_counter()
        ready = self.client.request_kv(msg)
        dt = time.perf_counter() - t0
        got = self.ep.ring.view(ready.ring_offset, ready.total_nbytes).cpu() if keep else None
        self.client.release(rid)
        return dt, self.ep.produce_seconds(rid), got

    def close(self) -> None:
        self.client.close()
        self.ep.close()


def _one_source(kind, dtype, dev_caches, host_caches, geo, profile, repeats, copy_s) -> dict:
    layers, heads, bs, dim, src_blocks, dst_blocks, tokens = geo
    dev_src = _source(kind, dev_caches, heads, bs, dim, profile)
    host_src = _source(kind, host_caches, heads, bs, dim, profile)
    dst = _dst_layout(dev_src, kind, dtype, profile)
    ids = [int(b) for b in (dst_blocks if kind == "tile-transform" else np.arange(len(src_blocks)))]
    nbytes = len(src_blocks) * layers * heads * bs * 2 * dim * 2
    ring = 2 * nbytes + (8 << 20)
    dev_side, host_side = _Served(dev_src, ring), _Served(host_src, ring)
    try:
        _, _, want = host_side.serve("ref", _request("ref", dst, tokens, ids), src_blocks, tokens, True)
        times, produce, same = [], [], False
        for r in range(max(1, repeats)):
            msg = _request(f"r{r}", dst, tokens, ids)
            dt, ps, got = dev_side.serve(msg.req_id, msg, src_blocks, tokens, r == 0)
            times.append(dt)
            produce.append(ps)
            if got is not None:
                same = bool(torch.equal(got, want))
        reg = sorted({loc for _a, _n, loc in dev_side.transport.registered})
        ring_dev = str(dev_side.ep.ring.device)
    finally:
        dev_side.close()
        host_side.close()
    ratio = statistics.median(c / p for c, p in zip(copy_s, produce, strict=False))
    return {
        "source": kind,
        "dtype": dtype if kind == "tile-transform" else "vllm blocks",
        "source_mb": nbytes / 1e6,
        "bytes_equal_host": same,
        "ring": ring_dev,
        "registered": reg,
        "produce_gbps": nbytes / statistics.median(produce) / 1e9,
        "copy_gbps": nbytes / statistics.median(copy_s) / 1e9,
        "ratio": ratio,
        "kvready_ms": 1e3 * statistics.median(times),
    }


def _request(rid: str, dst: LayoutDesc, tokens: int, ids: list[int]) -> KVRequest:
    return KVRequest(req_id=rid, dst_layout=dst, num_tokens=tokens, dst_block_ids=ids)


def _copy_seconds(nbytes: int, device, repeats: int) -> list[float]:
    """Seconds of a device copy of ``nbytes`` bytes, per repeat (synchronised around)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    out = []
    for _ in range(max(1, repeats) + 1):  # the first is a warm-up
        synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return out[1:]


def prefill_rows(device, shape, tp: int, profile: str, block_size: int, size_mb: float, repeats: int) -> list[dict]:
    """One row per source of :data:`SOURCES` (see the module doc); ``shape``: a
    :class:`~vllm_hawk.layout.model_shapes.ModelShape`, ``tp`` ranks (this one's heads)."""
    heads, dim, layers = shape.kv_heads_per_rank(tp), shape.head_dim, shape.num_layers
    per_block = shape.kv_bytes_per_token(tp, 2) * block_size
    n_blocks = max(1, round(size_mb * 1e6 / per_block))
    cache_blocks = 2 * n_blocks + 2
    rng = np.random.default_rng(1)
    src_blocks = rng.permutation(cache_blocks)[:n_blocks]
    dst_blocks = rng.permutation(cache_blocks)[:n_blocks]
    tokens = n_blocks * block_size - block_size // 2  # the last block half full
    host = seeded_caches(layers, cache_blocks, heads, block_size, dim, "cpu")
    dev = (
        host
        if torch.device(device).type == "cpu"
        else seeded_caches(layers, cache_blocks, heads, block_size, dim, device)
    )
    copy_s = _copy_seconds(n_blocks * per_block, device, repeats)
    geo = (layers, heads, block_size, dim, src_blocks, dst_blocks, tokens)
    return [_one_source(k, dt, dev, host, geo, profile, repeats, copy_s) for k, dt in SOURCES]
