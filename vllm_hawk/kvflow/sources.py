"""Prefill-side sources of Algorithm 1: how a request's KV bytes are produced (P4-P6).

:class:`~vllm_hawk.kvflow.prefill.PrefillEndpoint` owns leases, the ring, cancels and
replies; a source only knows its bytes. Three sources:

* :class:`VllmBlockSource` (GG-Direct): the vLLM cache is exported as it is; KVReady
  lists the source blocks' per-layer byte runs in place (``bank`` = layer). No ring.
* :class:`RingGatherSource` (staged, GG-Host): the blocks' layer streams are gathered
  into a ring range, one segment per layer (:mod:`~vllm_hawk.kvflow.gather`).
* :class:`TileTransformSource` (GN-HAWK): the blocks are transformed into G'
  ``[N_ch, -1, tile_chunk]`` for the decode's Tenstorrent layout, straight into a ring
  range, one segment per destination bank.

Tensor parallelism: a KVRequest may ask for a range of this rank's KV heads
(``head_start`` / ``num_heads``, :mod:`vllm_hawk.layout.tp`); every source then serves
just those heads (a head-sliced region map or head-sliced transform views, built once per
range) and checks the destination layout against them.

A source's ``check`` bounds everything sized from the peer's layout before any plan;
``prepare`` returns a :class:`Prepared` (ring bytes needed, 0 = served in place) whose
``fill(addr, view)`` writes the bytes into ``view`` (a ring range; ``addr`` its address,
for information) and ``segments(offset)`` lists them (offsets from the export base).

Memory: a source's ``device`` is its KV cache's (``cpu``, ``cuda:0``); every byte it
produces is written with torch operations on that device into a ``view`` there, never
through a host pointer (:mod:`~vllm_hawk.kvflow.device`).

Block sizes: the decode names its own in ``dst_layout.block_size``; destination block
``first_block + j`` holds the request's tokens ``[(first_block + j) * dst_block_size, ...)``
(:func:`src_block_span` finds the source blocks that hold them). GN-HAWK regroups tokens
into the decode's blocks whatever the two sizes; the vLLM-layout sources serve their
blocks as they are to a decode whose blocks are the same size or a multiple of theirs
(the decode regroups them, :mod:`~vllm_hawk.kvflow.regroup`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import torch

from vllm_hawk.integrity import wire_format
from vllm_hawk.kvflow.base import Capabilities, KVSource, Prepared
from vllm_hawk.kvflow.gather import BlockGather
from vllm_hawk.kvflow.streams import KVRegionMap, PerHeadRange, ring_segments, source_segments
from vllm_hawk.layout.device_profiles import DeviceProfile
from vllm_hawk.layout.formats import tile_format
from vllm_hawk.layout.tt_kv_cache import KV_DTYPES, TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.layout.vllm_kv import as_transform_source
from vllm_hawk.protocol import KVRequest, LayoutDesc, Segment
from vllm_hawk.transform import make_plan, transform_source

MAX_BANKS = 64  # bound on a peer's num_banks when its device profile is unknown here
MAX_PAGE_NBYTES = 1 << 20  # likewise for page_nbytes
MAX_BLOCK_SIZE = 4096  # tokens per destination block (vLLM's largest kernel block is 1024)
#: The destination a ring is sized for (:meth:`TileTransformSource.request_nbytes`): the
#: decode's tile dtype and block size are named only in each KVRequest, so the largest
#: tiles (bfloat16) in the largest blocks a Tenstorrent decode here runs (64 tokens,
#: docs/tenstorrent.md; a 32-token decode pads less)
RING_SIZING_DTYPE, RING_SIZING_BLOCK_SIZE = "bfloat16", 64


def vllm_layout_desc(
    region_map: KVRegionMap, name: str, dtype: str, block_size: int, num_kv_heads: int, head_dim: int
) -> LayoutDesc:
    """The LayoutDesc of a vLLM paged cache (``num_banks`` 1; ``tile_nbytes`` = bytes of one
    block of one layer, ``page_nbytes`` = the block stride)."""
    r0 = region_map.layers[0]
    return LayoutDesc(
        name=name[:256],
        dtype=dtype,
        block_size=block_size,
        num_layers=len(region_map.layers),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_banks=1,
        tile_nbytes=r0.block_nbytes,
        page_nbytes=r0.block_stride_nbytes,
    )


def head_range_error(msg: KVRequest, num_kv_heads: int) -> str:
    """'' when ``msg``'s head range lies inside this rank's ``num_kv_heads`` heads."""
    if msg.num_heads and msg.head_start + msg.num_heads > num_kv_heads:
        return (
            f"KV heads {msg.head_start}..{msg.head_start + msg.num_heads - 1} asked for, this prefill rank "
            f"holds {num_kv_heads} (check both sides' tensor_parallel_size)"
        )
    return ""


def share_heads(msg: KVRequest, num_kv_heads: int) -> tuple[int, int] | None:
    """``(start, count)`` of a KVRequest for part of the heads, or None for all of them."""
    if not msg.num_heads or (msg.head_start == 0 and msg.num_heads == num_kv_heads):
        return None
    return msg.head_start, msg.num_heads


def src_block_span(first_block: int, dst_block_size: int, num_tokens: int, src_block_size: int) -> tuple[int, int, int]:
    """The request's source blocks ``[lo, hi)`` holding its tokens ``[first_block *
    dst_block_size, num_tokens)`` (destination blocks ``first_block`` to the last one),
    and the token of the span's start inside source block ``lo`` (0 when the sizes match)."""
    t0 = first_block * dst_block_size
    lo = t0 // src_block_size
    return lo, -(-num_tokens // src_block_size), t0 - lo * src_block_size


def _shape_mismatch(mine: LayoutDesc, theirs: LayoutDesc, fields: Sequence[str]) -> str:
    for f in fields:
        if getattr(mine, f) != getattr(theirs, f):
            return f"destination {f} is {getattr(theirs, f)!r}, this prefill has {getattr(mine, f)!r}"
    return ""


class _VllmStreams(KVSource):
    """Shared by the two vLLM-layout sources: the decode must have the same block bytes.
    ``heads(start, count)``: the region map of those KV heads only (None: no shares);
    ``caches``: the per-layer cache tensors, required (their device is the source's, so the
    memory location its ranges are registered under; the ring gather reads them)."""

    def __init__(
        self,
        region_map: KVRegionMap,
        layout: LayoutDesc,
        storages: Sequence[tuple[int, int]],
        heads: Callable[[int, int], KVRegionMap] | None = None,
        caches: Sequence[torch.Tensor] = (),
    ) -> None:
        if not caches:
            raise ValueError(f"{type(self).__name__} reads the device and the bytes of the cache tensors: pass caches")
        self.region_map, self.layout, self.storages = region_map, layout, list(storages)
        self.heads, self.caches = heads, list(caches)
        self.device = self.caches[0].device
        self._maps = PerHeadRange(heads) if heads is not None else None
        self._storages: list | None = None  # export_view's storages, found on first use
        self._setup()

    def _setup(self) -> None:
        """What a subclass builds from the caches once."""

    @property
    def wire_format(self) -> str:
        """The format of the bytes served: the caches' own element dtype (not the one the
        layout claims), so a decode that expects another never verifies them."""
        return wire_format("vllm-blocks", self.caches[0].dtype)

    def share_map(self, msg: KVRequest) -> KVRegionMap:
        """The region map of the heads ``msg`` asks for (built once per head range)."""
        sh = share_heads(msg, self.layout.num_kv_heads)
        if sh is None:
            return self.region_map
        if self._maps is None:
            raise ValueError("this prefill serves whole requests only (no head ranges)")
        return self._maps(*sh)

    def check(self, msg: KVRequest) -> str:
        d = msg.dst_layout
        err = head_range_error(msg, self.layout.num_kv_heads)
        if err:
            return err
        mine = self.layout
        if d.block_size % mine.block_size or d.block_size > MAX_BLOCK_SIZE:
            return (
                f"destination block_size {d.block_size} is not a multiple of this prefill's {mine.block_size}: "
                f"a vLLM decode regroups the prefill's blocks only into blocks a multiple of theirs (start the "
                f"decode with --block-size {mine.block_size} or a multiple of it, or use a Tenstorrent decode, "
                "whose GN-HAWK transform regroups tokens)"
            )
        ratio = d.block_size // mine.block_size  # the decode regroups `ratio` of our blocks into one of its own
        if share_heads(msg, mine.num_kv_heads) is not None:
            if self.heads is None:
                return "this prefill serves whole requests only (no head ranges)"
            mine = msgspec.structs.replace(
                mine, num_kv_heads=msg.num_heads, tile_nbytes=self.share_map(msg).layers[0].block_nbytes
            )
        mine = msgspec.structs.replace(mine, tile_nbytes=mine.tile_nbytes * ratio)
        err = _shape_mismatch(mine, d, ("num_layers", "num_kv_heads", "head_dim", "dtype", "tile_nbytes"))
        if err:
            return err
        if d.num_banks != 1:
            return f"destination has {d.num_banks} banks: a Tenstorrent layout needs device_profile set on both sides"
        return ""


class VllmBlockSource(_VllmStreams):
    """GG-Direct: the cache's buffers (``storages``: ``(addr, nbytes)``) are exported and
    KVReady points at the blocks in place."""

    name = "vllm-blocks"
    uses_ring = False

    def exports(self) -> list[tuple[int, int]]:
        return self.storages

    def prepare(self, msg: KVRequest, src_blocks: np.ndarray, export_base: int) -> Prepared:
        segs = source_segments(self.share_map(msg), src_blocks.tolist(), export_base)
        return Prepared(0, lambda addr, view: None, lambda off: segs, wire_format=self.wire_format)

    def export_view(self, addr: int, nbytes: int) -> torch.Tensor:
        """The cache bytes at ``addr`` (an address in the caches' own space, as exported),
        viewed through a cache tensor whose storage holds them."""
        if self._storages is None:  # (start, end, a uint8 tensor on it) per storage, found once
            seen: dict[tuple[int, int], torch.Tensor] = {}
            for c in self.caches:  # layers are views of one storage (vLLM): one range
                base = c.data_ptr() - c.storage_offset() * c.element_size()
                seen.setdefault((base, base + c.untyped_storage().nbytes()), c.view(torch.uint8))
            self._storages = [(a, b, u8) for (a, b), u8 in seen.items()]
        for start, end, u8 in self._storages:
            if start <= addr and addr + nbytes <= end:
                return torch.as_strided(u8, (nbytes,), (1,), addr - start)
        raise ValueError(f"{nbytes} bytes at {addr:#x} lie in no KV cache tensor of this prefill")


class RingGatherSource(_VllmStreams):
    """Staged: the blocks' layer streams are copied into a ring range (P6), by torch
    operations on the caches' device."""

    name = "ring-gather"
    uses_ring = True

    def _setup(self) -> None:
        self._gathers = PerHeadRange(lambda s, c: BlockGather.of_caches([x[:, s : s + c] for x in self.caches]))
        self._whole = BlockGather(self.caches, [r.template for r in self.region_map.layers])

    def exports(self) -> list[tuple[int, int]]:
        return []

    def prepare(self, msg: KVRequest, src_blocks: np.ndarray, export_base: int) -> Prepared:
        ids = src_blocks.tolist()
        rmap = self.share_map(msg)
        rmap.check_blocks(ids)
        sh = share_heads(msg, self.layout.num_kv_heads)
        gather = self._whole if sh is None else self._gathers(*sh)
        n = len(ids)
        return Prepared(
            n * rmap.block_nbytes,
            lambda addr, view: gather(ids, view),
            lambda off: ring_segments(rmap, n, off),
            wire_format=self.wire_format,
        )

    def request_nbytes(self, num_tokens: int) -> int:
        """The layer streams of the ``ceil(num_tokens / block_size)`` blocks that hold
        ``num_tokens`` tokens, as :meth:`prepare` sizes them (a decode with larger blocks
        pulls the same source blocks)."""
        return -(-num_tokens // self.layout.block_size) * self.region_map.block_nbytes


def tt_paged_desc(src: LayoutDesc, dtype: str, profile: DeviceProfile, block_size: int = 0) -> LayoutDesc:
    """The destination a Tenstorrent decode on ``profile`` names for a source of ``src``'s
    geometry: tt-paged, ``dtype`` tiles, ``block_size`` tokens per block (0: ``src``'s)."""
    tb = tile_format(dtype).tile_nbytes
    return LayoutDesc(
        name="tt-paged",
        dtype=dtype,
        block_size=block_size or src.block_size,
        num_layers=src.num_layers,
        num_kv_heads=src.num_kv_heads,
        head_dim=src.head_dim,
        num_banks=profile.num_banks,
        tile_nbytes=tb,
        page_nbytes=profile.aligned_page(tb),
    )


def spec_from_desc(desc: LayoutDesc, num_blocks: int) -> TTKVCacheSpec:
    return TTKVCacheSpec(desc.num_layers, num_blocks, desc.num_kv_heads, desc.block_size, desc.head_dim, desc.dtype)


def tt_layout_of(desc: LayoutDesc, num_blocks: int) -> TTKVCacheLayout:
    """A Tenstorrent KV layout with the peer's geometry (bank bases 0: plans are relative)."""
    return TTKVCacheLayout(
        spec_from_desc(desc, num_blocks), desc.num_banks, desc.page_nbytes, ((0, 0),) * desc.num_layers
    )


def group_segments(plan, offset: int, lo: int, hi: int) -> list[Segment]:
    """Segments of layers lo..hi-1 of G' at ``offset``: in each bank's segment (layer 0 K,
    layer 0 V, layer 1 K, ...) the group's slots are one contiguous range."""
    tb = plan.layout.spec.tile_nbytes
    out = []
    for b in range(plan.bank_counts.size):
        per_slot = int(plan.bank_counts[b]) * tb
        if per_slot:
            out.append(Segment(b, offset + int(plan.segment_offset[b]) + 2 * lo * per_slot, 2 * (hi - lo) * per_slot))
    return out


class TileTransformSource(KVSource):
    """GN-HAWK: the vLLM cache's blocks, transformed into G' for the decode's tile layout (P4+P6).

    views: a :class:`~vllm_hawk.layout.vllm_kv.TransformSource` (zero-copy logical views
    ``[num_blocks, heads, block_size, head_dim]`` per layer, or a gather of the request's
    blocks for packed layouts such as CPU AMX), or per-layer (K, V) views; layout: this cache's
    shape as a LayoutDesc (layers, heads, head_dim, block_size); profile: the device
    profile named in the handshake (None: unknown here, peers bounded by MAX_BANKS /
    MAX_PAGE_NBYTES)."""

    name = "tile-transform"
    uses_ring = True
    caps = Capabilities(layer_groups=True)

    def __init__(self, views, layout: LayoutDesc, profile: DeviceProfile | None) -> None:
        self.views, self.layout, self.profile = as_transform_source(views), layout, profile
        self.device = self.views.device
        self._shares = PerHeadRange(self.views.heads)  # head-sliced TransformSources

    def exports(self) -> list[tuple[int, int]]:
        return []

    def share_views(self, msg: KVRequest):
        """The transform input of the heads ``msg`` asks for (built once per head range)."""
        sh = share_heads(msg, self.layout.num_kv_heads)
        return self.views if sh is None else self._shares(*sh)

    def check(self, msg: KVRequest) -> str:
        d = msg.dst_layout
        err = head_range_error(msg, self.layout.num_kv_heads)
        if err:
            return err
        mine = self.layout
        if share_heads(msg, mine.num_kv_heads) is not None:
            mine = msgspec.structs.replace(mine, num_kv_heads=msg.num_heads)
        err = _shape_mismatch(mine, d, ("num_layers", "num_kv_heads", "head_dim"))
        if err:
            return err
        if d.dtype not in KV_DTYPES or tile_format(d.dtype).tile_nbytes != d.tile_nbytes:
            return f"destination dtype {d.dtype!r} with {d.tile_nbytes}-byte tiles is not supported"
        if d.block_size > MAX_BLOCK_SIZE:
            return f"destination block_size {d.block_size} is over {MAX_BLOCK_SIZE} tokens"
        if d.block_size % 32:
            return f"destination block_size {d.block_size} is not a multiple of 32 (a TILE layout's)"
        if d.page_nbytes < d.tile_nbytes or d.head_dim % 32:
            return "destination page/head_dim do not describe a TILE layout"
        p = self.profile
        if p is not None:
            if d.num_banks != p.num_banks:
                return f"destination has {d.num_banks} banks; device profile {p.name!r} has {p.num_banks}"
            if d.page_nbytes != p.aligned_page(d.tile_nbytes):
                return (
                    f"destination page of {d.page_nbytes} bytes; device profile {p.name!r} pages "
                    f"{d.tile_nbytes}-byte tiles into {p.aligned_page(d.tile_nbytes)} bytes"
                )
        elif d.num_banks > MAX_BANKS or d.page_nbytes > MAX_PAGE_NBYTES:
            return (
                f"destination has {d.num_banks} banks and {d.page_nbytes}-byte pages; with its device "
                f"profile unknown here the limits are {MAX_BANKS} and {MAX_PAGE_NBYTES}"
            )
        return ""

    def prepare(self, msg: KVRequest, src_blocks: np.ndarray, export_base: int) -> Prepared:
        d = msg.dst_layout
        dst = np.asarray(msg.dst_block_ids, dtype=np.int64)
        plan = make_plan(tt_layout_of(d, int(dst.max()) + 1), dst, "staged")
        bs = self.layout.block_size
        offset = src_block_span(msg.first_block, d.block_size, msg.num_tokens, bs)[2]

        memo: dict = {}  # per-tile kernel arguments, shared by the request's layer groups
        L = self.layout.num_layers
        views = self.share_views(msg)

        def fill_layers(addr: int, view, lo: int, hi: int) -> None:  # on the cache's device, into ``view``
            transform_source(
                views,
                src_blocks,
                bs,
                plan,
                view,
                None if (lo, hi) == (0, L) else (lo, hi),
                memo=memo,
                src_token_offset=offset,
            )

        def segments_layers(off: int, lo: int, hi: int) -> list[Segment]:
            return group_segments(plan, off, lo, hi)

        return Prepared(
            int(plan.total_nbytes),
            lambda addr, view: fill_layers(addr, view, 0, L),
            lambda off: segments_layers(off, 0, L),
            fill_layers,
            segments_layers,
            wire_format("tt-tiles", plan.layout.spec.dtype),  # the tiles the kernel writes
        )

    def request_nbytes(self, num_tokens: int) -> int:
        """G' of ``num_tokens`` tokens for a decode of :data:`RING_SIZING_DTYPE` tiles in
        :data:`RING_SIZING_BLOCK_SIZE`-token blocks (tokens padded to whole blocks): the
        plan's ``total_nbytes``, as :meth:`prepare` makes it (every block has the same
        tiles, so one block's plan times the blocks). A bfloat8_b decode's G' is 1088/2048
        of it, a bfloat4_b decode's 576/2048."""
        if self.profile is None:
            raise ValueError("TileTransformSource.request_nbytes needs the decode's device profile")
        d = tt_paged_desc(self.layout, RING_SIZING_DTYPE, self.profile, RING_SIZING_BLOCK_SIZE)
        n = -(-num_tokens // d.block_size)
        return n * int(make_plan(tt_layout_of(d, 1), [0], "staged").total_nbytes)

    def warm(self, profile: DeviceProfile) -> None:
        """Compile the transform kernels (numba: seconds on first use, under a second from
        its cache) and build the cache's kernel views before the first request: one block
        of each tile dtype into a scratch buffer on the cache's device."""
        for dtype in KV_DTYPES:
            tile_block = -(-self.layout.block_size // 32) * 32  # a TILE layout's (16-token sources too)
            d = tt_paged_desc(self.layout, dtype, profile, tile_block)
            plan = make_plan(tt_layout_of(d, 1), [0], "staged")
            out = torch.empty(plan.total_nbytes, dtype=torch.uint8, device=self.device)
            transform_source(self.views, [0], self.layout.block_size, plan, out)
