"""Where a request's KV bytes are, and how to pair them into few large copies (pure).

Both sides describe their paged KV cache with a :class:`KVRegionMap`: per layer, the
address of block 0, the byte stride from one block to the next, and the byte runs of
one block (``template``: ``(offset_bytes, nbytes)`` from the block's start; one run for
the CPU and FlashAttention layouts of vLLM, one per head for head-outer layouts).

The wire contract between prefill and decode is the **layer stream**: for layer ``l``,
the request's blocks in request order, each block's template runs in template order,
concatenated. The prefill describes that stream with segments (``bank`` = layer index;
byte ranges inside its exported region, adjacent ranges merged); in ``staged`` mode the
stream lies contiguously in its ring. The decode walks the stream and its own
destination blocks together and emits one copy per piece that is contiguous on BOTH
sides (:func:`pair_stream`), so consecutive blocks on both sides become one entry.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_hawk.protocol import Segment

Entry = tuple[int, int, int]  # (local_addr, remote_addr, nbytes)


@dataclass(frozen=True)
class LayerRegion:
    """One layer's cache: ``addr`` of block 0, ``block_stride_nbytes``, runs of a block."""

    addr: int
    block_stride_nbytes: int
    template: tuple[tuple[int, int], ...]

    @property
    def block_nbytes(self) -> int:
        return sum(n for _o, n in self.template)


@dataclass(frozen=True)
class KVRegionMap:
    """All layers of one engine's KV cache (in layer order) and its block count."""

    layers: tuple[LayerRegion, ...]
    num_blocks: int

    @property
    def block_nbytes(self) -> int:
        """K+V bytes of one block summed over layers."""
        return sum(lr.block_nbytes for lr in self.layers)

    def signature(self) -> str:
        """What both sides must share for stream pairing: layers and block template."""
        t = {lr.template for lr in self.layers}
        return f"L{len(self.layers)}:" + ";".join(",".join(f"{o}+{n}" for o, n in tmpl) for tmpl in sorted(t))

    def check_blocks(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} outside [0, {self.num_blocks})")


def _merge(runs: list[list[int]], addr: int, nbytes: int) -> None:
    if runs and runs[-1][0] + runs[-1][1] == addr:
        runs[-1][1] += nbytes
    else:
        runs.append([addr, nbytes])


def stream_runs(region: LayerRegion, block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Absolute ``(addr, nbytes)`` runs of one layer's stream, adjacent runs merged."""
    runs: list[list[int]] = []
    for b in block_ids:
        base = region.addr + b * region.block_stride_nbytes
        for off, n in region.template:
            _merge(runs, base + off, n)
    return [(a, n) for a, n in runs]


def source_segments(kv: KVRegionMap, block_ids: Sequence[int], export_base: int) -> list[Segment]:
    """Direct mode, prefill side: the request's layer streams as segments (offsets from
    ``export_base``; ``bank`` = layer index)."""
    kv.check_blocks(block_ids)
    out = []
    for layer, region in enumerate(kv.layers):
        for addr, n in stream_runs(region, block_ids):
            out.append(Segment(layer, addr - export_base, n))
    return out


def ring_segments(kv: KVRegionMap, num_blocks: int, ring_offset: int) -> list[Segment]:
    """Staged mode: the streams of ``num_blocks`` blocks stored layer after layer from
    ``ring_offset`` (one segment per layer)."""
    out, off = [], ring_offset
    for layer, region in enumerate(kv.layers):
        n = num_blocks * region.block_nbytes
        out.append(Segment(layer, off, n))
        off += n
    return out


def pair_stream(
    segments: Sequence[Segment],
    remote_base: int,
    dst: KVRegionMap,
    dst_block_ids: Sequence[int],
    first_block: int,
    sub_blocks: tuple[int, int] | None = None,
) -> list[Entry]:
    """Decode side: ``(local_addr, remote_addr, nbytes)`` entries that copy stream blocks
    ``first_block .. first_block + len(dst_block_ids) - 1`` into ``dst_block_ids``.

    ``segments`` describe the remote streams (``bank`` = layer, offsets from
    ``remote_base``). A piece is merged with the previous one when it continues it on
    both sides. ``sub_blocks`` ``(num_src, ratio)``: the stream holds ``num_src`` source
    blocks, each ``1/ratio`` of a destination block; only their bytes are paired, so the
    last destination block may be filled in part (:mod:`~vllm_hawk.kvflow.regroup`).
    Raises ValueError when the segments do not cover the needed bytes.
    """
    dst.check_blocks(dst_block_ids)
    by_layer: dict[int, list[Segment]] = {}
    for s in segments:
        by_layer.setdefault(s.bank, []).append(s)
    if sorted(by_layer) != list(range(len(dst.layers))):
        raise ValueError(f"segments name layers {sorted(by_layer)}, the destination has {len(dst.layers)} layers")
    out: list[list[int]] = []
    for layer, region in enumerate(dst.layers):
        segs = by_layer[layer]
        starts, pos = [], 0
        for s in segs:
            starts.append(pos)
            pos += s.nbytes
        bn = region.block_nbytes
        need_end = (first_block + len(dst_block_ids)) * bn
        if sub_blocks is not None:
            need_end = first_block * bn + sub_blocks[0] * (bn // sub_blocks[1])
        if need_end > pos:
            raise ValueError(f"layer {layer}: the prefill sent {pos} bytes, {need_end} needed")
        for j, b in enumerate(dst_block_ids):
            s_off = (first_block + j) * bn
            base = region.addr + b * region.block_stride_nbytes
            for off, n in region.template:
                local = base + off
                n = max(0, min(n, need_end - s_off))
                while n:
                    i = bisect.bisect_right(starts, s_off) - 1
                    seg = segs[i]
                    inside = s_off - starts[i]
                    take = min(n, seg.nbytes - inside)
                    remote = remote_base + seg.offset_bytes + inside
                    last = out[-1] if out else None
                    if last and last[0] + last[2] == local and last[1] + last[2] == remote:
                        last[2] += take
                    else:
                        out.append([local, remote, take])
                    local += take
                    s_off += take
                    n -= take
    return [(a, b, n) for a, b, n in out]


def region_map_from_caches(caches: Sequence, templates: Sequence[Sequence[tuple[int, int]]]) -> KVRegionMap:
    """Build a map from per-layer cache tensors ``[num_blocks, ...]`` and block templates
    (``SourceKVLayout.block_byte_ranges(cache, 0)``)."""
    layers = []
    for cache, tmpl in zip(caches, templates, strict=False):
        stride = cache.stride(0) * cache.element_size()
        layers.append(LayerRegion(cache.data_ptr(), stride, tuple((int(o), int(n)) for o, n in tmpl)))
    nb = {int(c.shape[0]) for c in caches}
    if len(nb) != 1:
        raise ValueError(f"layers have different block counts {sorted(nb)}")
    return KVRegionMap(tuple(layers), nb.pop())


class PerHeadRange:
    """``build(start, count)`` once per KV head range, kept (thread-safe): the head-sliced
    region maps, transform views and sink views of tensor-parallel shares."""

    def __init__(self, build: Callable[[int, int], object]) -> None:
        self._build, self._got, self._lock = build, {}, threading.Lock()

    def __call__(self, start: int, count: int):
        with self._lock:
            got = self._got.get((start, count))
            if got is None:
                got = self._got[(start, count)] = self._build(start, count)
            return got


def head_maps(caches: Sequence) -> Callable[[int, int], KVRegionMap]:
    """``(start, count) -> KVRegionMap`` of KV heads ``[start, start+count)`` of per-layer
    caches ``[num_blocks, H, ...]`` (dim 1 = heads in every vLLM 0.32 layout; byte runs
    from the head-sliced views' strides: one run per block for head-outer layouts such
    as CPU_ATTN, one per token for FlashAttention's NHD)."""
    from vllm_hawk.layout.vllm_kv import block_byte_ranges

    def for_heads(start: int, count: int) -> KVRegionMap:
        sliced = [c[:, start : start + count] for c in caches]
        return region_map_from_caches(sliced, [block_byte_ranges(c, 0) for c in sliced])

    return for_heads
