"""Shared by the in-process kvflow tests: the KV shape and compatibility record of the
small test model, the reference bytes a TT decode's pool must hold, and a prefill/decode
pair on the in-process transport that frees everything when the test ends."""

from __future__ import annotations

import contextlib
import time

import torch

from vllm_hawk.bench.endpoints import TTDecode, prefill_endpoint
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.kvflow.streams import KVRegionMap, stream_runs
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import make_compat
from vllm_hawk.transport import make_transport

#: layers, KV heads, block size (tokens), head dim of the test caches
L, H, BS, D = 2, 2, 64, 64
#: a vLLM flash-layout prefill feeding a TT paged decode on a p150a
COMPAT = make_compat("tiny", "bfloat16", BS, "vllm-flash-nhd", "tt-paged", "p150a")


def reference(cache: PagedKVCache, layer: int, kv: int, src_blocks, num_tokens: int, dtype: str, bs: int = BS):
    """Tilized/packed bytes the pool must hold for the request's destination blocks
    (``cache`` has ``H`` heads of dimension ``D``)."""
    x = cache.kv_views()[layer][kv]
    tok = torch.cat([x[b] for b in src_blocks], dim=1)
    n_dst = -(-num_tokens // bs)
    out = torch.zeros(H, n_dst * bs, D, dtype=tok.dtype)
    m = min(tok.shape[1], n_dst * bs)
    out[:, :m] = tok[:, :m]
    return tilize_pack(out.reshape(H, n_dst, bs, D).transpose(0, 1), dtype)


def assert_pool_holds(dec: TTDecode, cache, src_blocks, num_tokens, dst_blocks):
    """Every layer's K and V in ``dst_blocks`` of the decode's pool equal :func:`reference`."""
    for layer in range(L):
        for kv in range(2):
            want = reference(
                cache, layer, kv, src_blocks, num_tokens, dec.layout.spec.dtype, dec.layout.spec.block_size
            )
            assert torch.equal(dec.read_blocks(layer, kv, dst_blocks), want), (layer, kv)


def wait_until(pred, timeout_s: float = 10.0) -> bool:
    """Poll ``pred`` every 20 ms; True once it holds, False after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


@contextlib.contextmanager
def endpoints(pool_blocks: int = 32, recv: int = 128 << 10, dec_kw: dict | None = None, **pre_kw):
    """A prefill (in-process transport) and one bf16 decode; everything freed after.

    Yields ``(cache, prefill, decode, device, decode transport, finished)``, where
    ``finished`` collects the prefill's ``on_finished(request_id, ok)`` calls."""
    cache = PagedKVCache(L, 48, H, BS, D).fill_random(7)
    tp, td = make_transport("inprocess"), make_transport("inprocess")
    finished: list[tuple[str, bool]] = []
    pre_kw.setdefault("ring_nbytes", 1 << 20)
    pre = prefill_endpoint(cache, tp, COMPAT, on_finished=lambda r, ok: finished.append((r, ok)), **pre_kw)
    dev = EmulatedDevice("p150a", 8 << 20)
    dec = None
    try:
        dec = TTDecode(
            dev,
            TTKVCacheSpec(L, pool_blocks, H, BS, D, "bfloat16"),
            td,
            pre.endpoint,
            COMPAT,
            recv_nbytes_per_bank=recv,
            timeout_s=10,
            **(dec_kw or {}),
        )
        yield cache, pre, dec, dev, td, finished
    finally:
        if dec is not None:
            dec.close()
        pre.close()
        tp.close()
        td.close()
    assert dev.live_buffers() == []


def gather_copies(kv: KVRegionMap, block_ids, dst_addr: int) -> list[tuple[int, int, int]]:
    """The staged gather by addresses, the reference :class:`~vllm_hawk.kvflow.gather.BlockGather`
    must equal: copies ``(dst, src, nbytes)`` that lay the layer streams of ``block_ids`` out
    contiguously from ``dst_addr``, layer after layer."""
    kv.check_blocks(block_ids)
    out, pos = [], dst_addr
    for region in kv.layers:
        for addr, n in stream_runs(region, block_ids):
            out.append((pos, addr, n))
            pos += n
    return out
