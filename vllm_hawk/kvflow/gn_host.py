"""GN-Host (the paper's baseline): vLLM-layout blocks in, the layout fixed on the decode.

The prefill serves its blocks as they are, as GG-Host does: the layer streams of
:mod:`~vllm_hawk.kvflow.streams` (per layer, the request's blocks' bytes one after the
other), gathered into its ring (:class:`~vllm_hawk.kvflow.RingGatherSource`, ``mode:
staged``) or in place (:class:`~vllm_hawk.kvflow.VllmBlockSource`, ``direct``).
:class:`GNHostSink` READs them into a host receive ring, then (D6-D7)
runs the layout fix on the decode side: the HAWK transform (:mod:`vllm_hawk.transform`:
tilize/pack into G' for the Tenstorrent layout) from the ring, then one ``memmove`` per
coalesced page run of G' into the KV pool, at host addresses from the bank-buffer API
(:class:`~vllm_hawk.kvflow.sinks.KVPageAddresses`).

The decode must know how the prefill's vLLM lays out a block: a :class:`WireLayout`
(attention backend adapter of :mod:`vllm_hawk.layout.vllm_kv` plus the order of one
block's bytes). Both sides name it in the handshake (``src_layout``), so a prefill
whose blocks are laid out otherwise is refused at start-up.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hawk.kvflow.base import Capabilities, KVSink, Landing
from vllm_hawk.kvflow.ring import RingBuffer
from vllm_hawk.kvflow.sinks import KVPageAddresses
from vllm_hawk.kvflow.streams import KVRegionMap, LayerRegion, pair_stream
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout
from vllm_hawk.layout.vllm_kv import SourceKVLayout, TransformSource, source_layout_for
from vllm_hawk.protocol import KVReady, LayoutDesc
from vllm_hawk.transform import make_plan, transform_source

BLOCK_ORDERS = ("HNC", "NHC")  # byte order inside one block of one layer: [H, N, C] or [N, H, C]


@dataclass(frozen=True)
class WireLayout:
    """One layer's block as the prefill sends it: ``block_nbytes`` contiguous bytes in
    ``order`` (``HNC``: vLLM's LBHNC caches, e.g. CPU_ATTN; ``NHC``: LBNHC, FlashAttention's
    default), read into logical K/V by ``adapter`` (``C`` = 2 * head_dim)."""

    adapter: SourceKVLayout
    order: str

    def __post_init__(self) -> None:
        if self.order not in BLOCK_ORDERS:
            raise ValueError(f"block order must be one of {BLOCK_ORDERS}, got {self.order!r}")

    @property
    def name(self) -> str:
        isa = self.adapter.isa
        return f"{self.adapter.name}{'/' + isa if isa else ''}/{self.order}"

    @property
    def dtype(self) -> str:
        return str(self.adapter.dtype).removeprefix("torch.")

    @property
    def block_nbytes(self) -> int:
        a = self.adapter
        return a.num_kv_heads * a.block_size * 2 * a.head_dim * a.dtype.itemsize

    def caches(self, memory: torch.Tensor, n: int, num_layers: int) -> list[torch.Tensor]:
        """Per layer an ``[n, H, N, C]`` cache view over ``memory`` (uint8, the layer
        streams of ``n`` blocks one after the other), as the adapter reads caches."""
        a = self.adapter
        h, bs, c, bn = a.num_kv_heads, a.block_size, 2 * a.head_dim, self.block_nbytes
        out = []
        for layer in range(num_layers):
            x = memory[layer * n * bn : (layer + 1) * n * bn].view(a.dtype)
            out.append(x.view(n, h, bs, c) if self.order == "HNC" else x.view(n, bs, h, c).transpose(1, 2))
        return out

    def layout_desc(self, num_layers: int) -> LayoutDesc:
        """What the decode asks the prefill for (a vLLM layout: one 'bank', block-sized 'tiles')."""
        a, bn = self.adapter, self.block_nbytes
        return LayoutDesc(
            name=f"vllm-paged/{self.name}"[:256],
            dtype=self.dtype,
            block_size=a.block_size,
            num_layers=num_layers,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            num_banks=1,
            tile_nbytes=bn,
            page_nbytes=bn,
        )


def wire_layout_of(adapter: SourceKVLayout, layer_cache: torch.Tensor) -> WireLayout:
    """The prefill side: the wire layout of a live vLLM layer cache ``[B, H, N, C]``
    (raises ``NotImplementedError`` unless each block is one contiguous HNC/NHC run)."""
    s = layer_cache.stride()
    h, bs, c = layer_cache.shape[1:]
    for order, want in (("HNC", (bs * c, c, 1)), ("NHC", (c, h * c, 1))):
        if (s[1], s[2], s[3]) == want and s[0] >= h * bs * c:
            return WireLayout(adapter, order)
    raise NotImplementedError(
        f"GN-Host needs each KV block to be one contiguous [H, N, C] or [N, H, C] run; "
        f"this cache's strides are {tuple(s)} for shape {tuple(layer_cache.shape)}"
    )


def host_wire_layout(num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> WireLayout:
    """The decode side: the wire layout of a vLLM prefill on the CPU of a host like this
    one (``CPU_ATTN``, LBHNC, the kernel ISA vLLM picks here). A prefill with another
    layout is refused in the handshake (``src_layout``)."""
    return WireLayout(
        source_layout_for("CPU_ATTN", num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim, dtype=dtype),
        "HNC",
    )


class GNHostSink(KVSink):
    """GN-Host decode: READs of the prefill's layer streams into a receive ring of
    ``recv_nbytes`` bytes (registered with ``transport``), then the layout fix into the
    Tenstorrent KV pool (``layout``, ``kv_buffers`` K0, V0, K1, ... on ``device``, mapped
    here through the bank-buffer API). A failing ``__init__`` leaves nothing held."""

    mode = "gn-host"
    caps = Capabilities(snapshot=True)

    def __init__(
        self,
        device,
        layout: TTKVCacheLayout,
        kv_buffers,
        transport,
        wire: WireLayout,
        recv_nbytes: int,
        registration: str = "per_request",
    ) -> None:
        s = layout.spec
        a = wire.adapter
        if (a.num_kv_heads, a.block_size, a.head_dim) != (s.num_kv_heads, s.block_size, s.head_dim):
            raise ValueError(
                f"GN-Host: the wire layout's (heads, block_size, head_dim) "
                f"{(a.num_kv_heads, a.block_size, a.head_dim)} differ from the KV pool's "
                f"{(s.num_kv_heads, s.block_size, s.head_dim)}"
            )
        self.device, self.tt_layout, self.wire = device, layout, wire
        self.layout = wire.layout_desc(s.num_layers)
        self.recv = self.pages = None
        try:
            self.recv = RingBuffer(recv_nbytes, transport, registration=registration)
            self.pages = KVPageAddresses(device, kv_buffers)
        except BaseException:
            self.close()
            raise

    def plan(self, dst_blocks: np.ndarray):
        return make_plan(self.tt_layout, dst_blocks, "direct")  # raises ValueError on bad ids

    def check_ready(self, ready: KVReady, plan, export_nbytes: int) -> str:
        """'' when KVReady's segments are the layer streams of the plan's blocks (in the
        prefill's ring or its cache), inside the prefill's exported region."""
        if any(s.offset_bytes + s.nbytes > export_nbytes for s in ready.segments):
            return "a segment lies outside the prefill's exported region"
        want = len(plan.dst_blocks) * self.wire.block_nbytes * self.layout.num_layers
        if ready.total_nbytes != want or sum(s.nbytes for s in ready.segments) != want:
            return f"KVReady covers {ready.total_nbytes} bytes, {len(plan.dst_blocks)} blocks need {want}"
        return ""

    def land(self, req_id, ready, plan, remote_base, claim_wait_s) -> Landing:
        n, bn = len(plan.dst_blocks), self.wire.block_nbytes
        total = n * bn * self.layout.num_layers
        off = self.recv.reserve(req_id, total, claim_wait_s)
        try:
            base = self.recv.base_addr + off
            streams = KVRegionMap(
                tuple(LayerRegion(base + layer * n * bn, bn, ((0, bn),)) for layer in range(self.layout.num_layers)), n
            )
            entries = pair_stream(ready.segments, remote_base, streams, list(range(n)), 0)
        except BaseException:
            self.recv.release(req_id)
            raise

        def complete() -> dict:  # D6-D7: the layout fix, then the ring range is free
            try:
                return self.fix(self.recv.view(off, total), n, plan)
            finally:
                self.recv.release(req_id)

        figures = {"banks": self.tt_layout.num_banks, "tile_dtype": self.tt_layout.spec.dtype}
        return Landing(entries, complete, lambda: self.recv.release(req_id), figures=figures)

    def fix(self, memory: torch.Tensor, n: int, plan) -> dict:
        """The layout fix: ``memory`` (uint8, the layer streams of ``n`` blocks) tilized/packed
        into G', then G' copied into the KV pool's pages of ``plan.dst_blocks``."""
        t0 = time.monotonic()
        src = TransformSource(
            [self.wire.adapter] * self.layout.num_layers, self.wire.caches(memory, n, self.layout.num_layers)
        )
        g = torch.empty(plan.total_nbytes, dtype=torch.uint8)
        transform_source(src, np.arange(n), self.layout.block_size, plan, g)
        t1 = time.monotonic()
        ops = plan.rdma
        local = self.pages.addresses(ops.bank, ops.dst_offset, ops.nbytes).tolist()
        gp = g.data_ptr()
        for s, d, nb in zip(ops.src_offset.tolist(), local, ops.nbytes.tolist(), strict=False):
            ctypes.memmove(d, gp + s, nb)
        self.device.dram_write_barrier()  # the page writes are in DRAM before the receive is reported
        return {"fix_transform_s": t1 - t0, "copy_s": time.monotonic() - t0, "page_writes": len(ops)}

    def warm(self) -> None:
        """Compile the fix's transform kernels before the first request (numba: seconds on
        first use): one block of zeros, transformed into a scratch G' (the pool is untouched)."""
        plan = make_plan(self.tt_layout, np.array([0]), "direct")
        mem = torch.zeros(self.wire.block_nbytes * self.layout.num_layers, dtype=torch.uint8)
        src = TransformSource(
            [self.wire.adapter] * self.layout.num_layers, self.wire.caches(mem, 1, self.layout.num_layers)
        )
        transform_source(
            src, np.arange(1), self.layout.block_size, plan, torch.empty(plan.total_nbytes, dtype=torch.uint8)
        )

    def idle(self) -> bool:
        return self.recv is None or self.recv.alloc.is_empty()

    def holds(self) -> dict:
        return {
            "recv_live": len(self.recv.alloc.live()) if self.recv else 0,
            "device_buffers": len(self.device.live_buffers()),
        }

    def close(self) -> None:
        if self.pages is not None:
            self.pages.close()
            self.pages = None
        if self.recv is not None:
            self.recv.close()
            self.recv = None
