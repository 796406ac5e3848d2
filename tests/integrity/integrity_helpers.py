"""Shared by the integrity tests: every prefill/decode pair of the paper, built from the
same wiring the benchmarks and the connector use (:mod:`vllm_hawk.bench.endpoints`), over
real transports (Mooncake TCP, host-staged), with the decode's transport wrapped in the
fault-injecting :class:`~faulty_transport.FaultyTransport` (a FAKE, named as such)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from faulty_transport import FaultyTransport

from vllm_hawk.bench.endpoints import GNHostDecode, TTDecode, VllmDecode, source_for
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.kvflow import PrefillEndpoint
from vllm_hawk.kvflow.gn_host import wire_layout_of
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import make_compat
from vllm_hawk.transport import make_transport

#: layers, KV heads, block size (tokens), head dim, prefill blocks
L, H, BS, D, NB = 2, 2, 32, 64, 24
#: a request of 3 full blocks and one partial (the last block padded)
NUM_TOKENS, SRC_BLOCKS, DST_BLOCKS = 100, [5, 9, 2, 14], [3, 0, 7, 1]


@dataclass
class Pair:
    """One prefill/decode pair: ``fetch(req_id)`` moves the standard request into the
    decode's destination blocks; ``landed()`` reads what the destination holds now."""

    name: str
    pre: object
    dec: object
    transport: FaultyTransport
    cache: PagedKVCache
    fetch_kw: dict
    finished: list  # the prefill's on_finished(request_id, ok) calls

    def fetch(self, req_id: str):
        return self.dec.fetch(req_id, NUM_TOKENS, DST_BLOCKS, **self.fetch_kw)

    def receive_idle(self) -> bool:
        """The decode holds no receive memory (bank-buffer slices, a receive ring)."""
        if isinstance(self.dec, TTDecode):
            return all(s.idle() for s in self.dec.sinks.values())
        recv = getattr(self.dec.sink, "recv", None)  # GN-Host and staged vLLM sinks: a receive ring
        return recv is None or recv.alloc.is_empty()

    def landed(self) -> bytes:
        """The destination blocks' bytes (every layer, K and V)."""
        if hasattr(self.dec, "read_blocks"):
            return b"".join(
                self.dec.read_blocks(layer, kv, DST_BLOCKS).numpy().tobytes() for layer in range(L) for kv in range(2)
            )
        c = self.dec.cache
        return b"".join(
            c.flat[c.block_offset(layer, b) :][: c.block_nbytes].numpy().tobytes()
            for layer in range(L)
            for b in DST_BLOCKS
        )


#: the pairs: (transport, prefill source kind, decode kind, fetch arguments)
PAIRS = {
    "gg-direct": ("mooncake", "vllm", "vllm-direct", {}),
    "gg-host": ("host_staged", "staged", "vllm-staged", {}),
    "gn-host": ("host_staged", "staged", "gn-host", {}),
    "gn-hawk-staged": ("mooncake", "hawk", "tt", {"mode": "staged"}),
    "gn-hawk-direct": ("mooncake", "hawk", "tt", {"mode": "direct"}),
    "gn-hawk-groups": ("mooncake", "hawk", "tt", {"mode": "direct", "layer_groups": 2}),
}


def compat_of(pair: str):
    if pair.startswith("gg"):
        return make_compat("tiny", "bfloat16", BS, "vllm-flash-nhd", "vllm-paged", "vllm")
    if pair == "gn-host":
        return make_compat("tiny", "bfloat16", BS, "gn-host-test", "tt-paged/p150a/layout_fix=decode", "p150a")
    return make_compat("tiny", "bfloat16", BS, "vllm-flash-nhd", "tt-paged", "p150a")


@contextlib.contextmanager
def pair(
    name: str,
    fault: str = "none",
    *,
    cache_dtype=torch.bfloat16,
    tile_dtype: str = "bfloat16",
    source=None,
    integrity: bool = True,
):
    """The pair ``name`` (:data:`PAIRS`) with the decode's transport wrapped in a
    :class:`FaultyTransport` for ``fault``; the prefill's cache holds ``cache_dtype``
    elements, the Tenstorrent decode ``tile_dtype`` tiles; ``source(src)``: the prefill's
    source made from the connector's ``src`` (default: ``src`` itself); ``integrity``: the
    decode's setting. Everything is freed after, and checked: no device buffer stays held."""
    kind, src_kind, dec_kind, fetch_kw = PAIRS[name]
    compat = compat_of(name)
    cache = PagedKVCache(L, NB, H, BS, D, cache_dtype).fill_random(7)
    tp, inner = make_transport(kind), make_transport(kind)
    td = FaultyTransport(inner, fault)
    finished: list[tuple[str, bool]] = []
    src = source_for(cache, src_kind, compat.device_profile if src_kind == "hawk" else None)
    pre = PrefillEndpoint(
        src if source is None else source(src),
        tp,
        compat,
        ring_nbytes=4 << 20,
        claim_wait_s=0.5,
        on_finished=lambda r, ok: finished.append((r, ok)),
    )
    dev = EmulatedDevice("p150a", 8 << 20)
    dec = None
    kw = {"integrity": integrity}
    try:
        if dec_kind.startswith("vllm"):
            mode = dec_kind.split("-")[1]
            dec = VllmDecode(
                PagedKVCache(L, 8, H, BS, D), td, pre.endpoint, compat, mode=mode, recv_nbytes=4 << 20, **kw
            )
        elif dec_kind == "gn-host":
            ref = PagedKVCache(L, 1, H, BS, D)  # the decode expects bf16 blocks in the flash layout
            wire = wire_layout_of(ref.adapter, ref.layers[0])
            spec = TTKVCacheSpec(L, 8, H, BS, D, tile_dtype)
            dec = GNHostDecode(dev, spec, td, pre.endpoint, compat, wire, recv_nbytes=4 << 20, **kw)
        else:
            spec = TTKVCacheSpec(L, 8, H, BS, D, tile_dtype)
            dec = TTDecode(dev, spec, td, pre.endpoint, compat, recv_nbytes_per_bank=256 << 10, **kw)
        yield Pair(name, pre, dec, td, cache, fetch_kw, finished)
    finally:
        if dec is not None:
            dec.close()
        pre.close()
        tp.close()
        inner.close()
    assert dev.live_buffers() == []
