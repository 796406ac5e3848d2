"""Shared by the integrity tests: a fault-injecting transport (test code, named as such:
it wraps a real transport and corrupts on purpose) and every prefill/decode pair of the
paper, built from the same wiring the benchmarks and the connector use
(:mod:`vllm_hawk.bench.endpoints`), over real transports (Mooncake TCP, host-staged)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hawk.bench.endpoints import GNHostDecode, TTDecode, VllmDecode, source_for
from vllm_hawk.kvflow import PrefillEndpoint
from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.kvflow.gn_host import wire_layout_of
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import make_compat
from vllm_hawk.transport import make_transport

#: layers, KV heads, block size (tokens), head dim, prefill blocks
L, H, BS, D, NB = 2, 2, 32, 64, 24
#: a request of 3 full blocks and one partial (the last block padded)
NUM_TOKENS, SRC_BLOCKS, DST_BLOCKS = 100, [5, 9, 2, 14], [3, 0, 7, 1]


class FaultyTransport:
    """A FAKE at the network boundary: the decode's real transport, plus one fault.

    ``flip``: once, after a READ batch completed, one bit of one landed byte flips (a bit
    flipped in flight). ``reuse``: once, before a READ batch is submitted, the prefill's
    memory it will read is overwritten with other bytes (the prefill freed the range or
    block and another request's KV was written there before the READ). Everything else is
    the wrapped transport's."""

    def __init__(self, inner, fault: str, pick: float = 0.5) -> None:
        if fault not in ("flip", "reuse", "none"):
            raise ValueError(f"fault must be flip, reuse or none, got {fault!r}")
        self.inner, self.fault, self.pick = inner, fault, pick
        self.fired: list[tuple[int, int]] = []  # (address, nbytes) corrupted
        self._entries: dict[int, list] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _target(self, entries) -> tuple[int, int, int] | None:
        """The entry and byte to corrupt: the one at ``pick`` of the batch's bytes."""
        total = sum(e[2] for e in entries)
        at = int(total * self.pick)
        for loc, rem, n in entries:
            if at < n:
                return loc, rem, at
            at -= n
        return None

    def submit(self, kind, peer, entries):
        with self._lock:
            t = self._target(entries) if self.fault == "reuse" and kind == "read" and not self.fired else None
            if t is not None:
                _, rem, at = t
                n = min(4096, sum(e[2] for e in entries) - at)
                buf = (ctypes.c_uint8 * n).from_address(rem)
                np.frombuffer(buf, dtype=np.uint8)[:] ^= 0x5A  # another request's bytes
                self.fired.append((rem, n))
        h = self.inner.submit(kind, peer, entries)
        self._entries[id(h)] = list(entries) if kind == "read" else []
        return h

    def wait(self, handle, timeout_s):
        self.inner.wait(handle, timeout_s)
        entries = self._entries.pop(id(handle), [])
        with self._lock:
            t = self._target(entries) if self.fault == "flip" and entries and not self.fired else None
            if t is not None:
                loc, _, at = t
                byte = ctypes.c_uint8.from_address(loc + at)
                byte.value ^= 0x10  # one bit
                self.fired.append((loc + at, 1))


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
            dec = VllmDecode(PagedKVCache(L, 8, H, BS, D), td, pre.endpoint, compat, mode=mode, recv_nbytes=4 << 20, **kw)
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
