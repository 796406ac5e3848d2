"""The prefill-side transform: vLLM-layout KV blocks -> G' (torch, CPU or CUDA).

Input per layer: logical K and V views ``[num_src_blocks, num_kv_heads, src_block_size,
head_dim]`` of the prefill engine's cache (any strides: the source-layout adapters in
``vllm_hawk.layout.vllm_kv`` give views without copying). The request's tokens are
``src_blocks[p // src_block_size]`` at ``p % src_block_size``; they are regrouped into
the destination's blocks of ``block_size`` tokens, tilized, packed to the destination
dtype and written bank-major into G' (uint8 [plan.total_nbytes]), exactly as the
:class:`~vllm_hawk.transform.plan.TransferPlan` describes. Token groups past the end of
the source blocks are zero tiles.

On the CPU a fused numba kernel (:mod:`vllm_hawk.transform.cpu_kernel`) does gather,
tilize and pack in one pass; on CUDA one fused Triton kernel
(:mod:`vllm_hawk.transform.triton_kernel`) does the same in one launch per request or
layer group, reading source blocks of any size in place (no regroup copy). The torch
path is the reference, and the fallback where neither applies (no numba, no triton,
a float32 target): a strided permute copy per run of source blocks when the bank of a
tile is a suffix of its digits, else a gather of the source tiles in G' order, then
packing into each bank's segment. ``HAWK_TRANSFORM_IMPL=torch|cpu_kernel|triton`` forces
one implementation (``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``). Index tables
go to the device by :func:`~vllm_hawk.transform.uploads.to_device` (pinned, asynchronous,
on the caller's current stream).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import numpy as np
import torch

from vllm_hawk import envs
from vllm_hawk.layout.formats import pack_tiles
from vllm_hawk.layout.tiles import TILE, TILE_ELEMS, tile_view
from vllm_hawk.transform import cpu_kernel
from vllm_hawk.transform.plan import TransferPlan, block_runs
from vllm_hawk.transform.uploads import to_device

IMPLS = ("auto", "cpu_kernel", "torch", "triton")
_HAVE_TRITON = importlib.util.find_spec("triton") is not None
TRITON_TARGETS = ("bfloat16", "bfloat8_b", "bfloat4_b")  # triton_kernel.TARGETS (kept importable without triton)
TRITON_SOURCES = (torch.bfloat16, torch.float16, torch.float32)


def uses_triton(impl: str, x: torch.Tensor, out: torch.Tensor, dtype: str) -> bool:
    """Whether :func:`transform_kv` runs the Triton kernel: when forced, or under
    ``auto`` for a CUDA G' from views it supports (triton importable)."""
    if impl == "triton":
        return True
    return (
        impl == "auto"
        and out.device.type == "cuda"
        and _HAVE_TRITON
        and dtype in TRITON_TARGETS
        and x.dtype in TRITON_SOURCES
    )


def triton_transform(
    layers,
    src: np.ndarray,
    src_block_size: int,
    plan: TransferPlan,
    out: torch.Tensor,
    lo: int,
    hi: int,
    offset: int = 0,
    memo: dict | None = None,
) -> int:
    """The Triton kernel over layers lo..hi-1 (any source block size and token offset).
    Its tables go to the device once per request (``memo``, kept across the request's
    layer groups; pinned, asynchronous copies on CUDA). Returns the kernel launches, also
    added up in ``memo["triton_launches"]``."""
    from vllm_hawk.transform import triton_kernel

    memo = {} if memo is None else memo
    if "triton_table" not in memo:
        memo["triton_table"] = to_device(triton_kernel.tile_table(plan, offset), out.device)
        memo["triton_blocks"] = to_device(np.ascontiguousarray(src, dtype=np.int64), out.device)
    n = triton_kernel.launch(
        layers, int(src.size), src_block_size, plan, out, lo, hi, memo["triton_table"], memo["triton_blocks"]
    )
    memo["triton_launches"] = memo.get("triton_launches", 0) + n
    return n


def tile_aligned(src_block_size: int, src_token_offset: int = 0) -> bool:
    """True when every 32-token tile row lies inside one source block."""
    return src_block_size % TILE == 0 and src_token_offset % TILE == 0


def source_tile_index(
    plan: TransferPlan, src_blocks, src_block_size: int, src_token_offset: int = 0
) -> tuple[np.ndarray, ...]:
    """For each request tile in G' order: (src block, head, src token-tile, dim-tile, valid).

    int64 arrays of length ``plan.tiles_per_tensor``; needs :func:`tile_aligned`."""
    spec = plan.layout.spec
    if not tile_aligned(src_block_size, src_token_offset):
        raise ValueError(
            f"source block_size and token offset must be multiples of {TILE}, got {src_block_size}, {src_token_offset}"
        )
    src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    tr_per_blk, tc_per = spec.block_size // TILE, spec.head_dim // TILE
    j = plan.bank_order
    i, u = j // spec.tiles_per_block, j % spec.tiles_per_block
    head = u // (tr_per_blk * tc_per)
    tr = (u // tc_per) % tr_per_blk
    tc = u % tc_per
    token0 = (i * tr_per_blk + tr) * TILE + src_token_offset  # first token of this token-tile
    sidx = token0 // src_block_size
    valid = sidx < src.size
    sblk = src[np.minimum(sidx, max(src.size - 1, 0))] if src.size else np.zeros_like(sidx)
    s_tr = (token0 % src_block_size) // TILE
    return sblk, head, s_tr, tc, valid


def bank_digit_split(heads: int, tr: int, tc: int, num_banks: int) -> list[tuple[int, int]] | None:
    """Split the tile digits (head, token-tile, dim-tile) of a block so that the bank
    ``u % num_banks`` of local tile ``u`` is a suffix of digits: returns per digit
    (high size, low size) with the lows forming the bank, or None if impossible."""
    remaining, out = num_banks, []
    for size in (tc, tr, heads):
        if remaining == 1:
            out.append((size, 1))
        elif remaining % size == 0:
            out.append((1, size))
            remaining //= size
        elif size % remaining == 0:
            out.append((size // remaining, remaining))
            remaining = 1
        else:
            return None
    return None if remaining != 1 else out[::-1]  # (head, tr, tc) order


def regroup_tokens(
    layers, src: np.ndarray, src_block_size: int, src_token_offset: int, block_size: int, lo: int, hi: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], np.ndarray]:
    """Layers lo..hi-1 of the span (from ``src_token_offset`` in ``src``'s blocks) gathered
    into new blocks of ``block_size`` tokens, zero-padded: per layer (K, V) ``[m, H,
    block_size, D]`` on the views' device, and their ids ``0..m-1``. The other layers'
    entries repeat layer ``lo``'s (never read: the transform's ``layer_range`` is lo..hi)."""
    device = layers[lo][0].device
    idx = to_device(src, device)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    m = 0
    for layer in range(lo, hi):
        pair = []
        for x in layers[layer]:
            t = x.index_select(0, idx)  # [n, H, src_block_size, D]
            n, h, sbs, d = t.shape
            t = t.permute(1, 0, 2, 3).reshape(h, n * sbs, d)[:, src_token_offset:]
            m = max(1, -(-t.shape[1] // block_size))
            t = torch.cat([t, t.new_zeros(h, m * block_size - t.shape[1], d)], dim=1)
            pair.append(t.view(h, m, block_size, d).permute(1, 0, 2, 3))
        out.append((pair[0], pair[1]))
    full = [out[0]] * lo + out + [out[0]] * (len(layers) - hi)
    return full, np.arange(m, dtype=np.int64)


class _FusedTilizer:
    """Fast path: source block size == destination block size, the same number of tiles
    per bank for every block (tiles_per_block % num_banks == 0) and a digit split exists.
    Then G' order is a pure permutation of the source's tile view, copied run by run."""

    def __init__(self, plan: TransferPlan, src_blocks: np.ndarray, split):
        spec = plan.layout.spec
        self.split, self.nb, self.n = split, plan.layout.num_banks, plan.dst_blocks.size
        self.runs = block_runs(src_blocks)
        self.digits = (spec.num_kv_heads, spec.block_size // TILE, spec.head_dim // TILE)

    def __call__(self, x: torch.Tensor, dst: torch.Tensor) -> None:
        """x: logical [blocks, H, bs, D]; dst: [nb, n, tiles_per_bank_per_block * 1024] view."""
        (h1, h0), (r1, r0), (c1, c0) = self.split
        d = dst.reshape(h0, r0, c0, self.n, h1, r1, c1, 2, 2, 16, 16)
        for pos, first, length in self.runs:
            tv = tile_view(x[first : first + length])  # [len, H, TR, TC, 2, 2, 16, 16]
            tv = tv.reshape(length, h1, h0, r1, r0, c1, c0, 2, 2, 16, 16)
            d[:, :, :, pos : pos + length].copy_(tv.permute(2, 4, 6, 0, 1, 3, 5, 7, 8, 9, 10))


def transform_kv(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src_blocks,
    src_block_size: int,
    plan: TransferPlan,
    out: torch.Tensor | None = None,
    impl: str | None = None,
    *,
    layer_range: tuple[int, int] | None = None,
    kernel_views: cpu_kernel.KernelViews | None = None,
    src_token_offset: int = 0,
    memo: dict | None = None,
) -> torch.Tensor:
    """Build G' for one request. ``layers[l] = (K, V)`` logical views (see module doc).

    ``impl``: "auto" (default, or $HAWK_TRANSFORM_IMPL), "cpu_kernel", "torch" or "triton".
    ``layer_range=(a, b)``: write only layers a..b-1 (their bytes in every bank's segment;
    the rest of ``out`` is untouched), for layer-group pipelining. ``kernel_views``: the
    CPU kernel's view of ``layers``, built once (:class:`~vllm_hawk.transform.cpu_kernel.KernelViews`).
    ``src_token_offset``: the span's first token inside ``src_blocks[0]``. ``memo``: a
    dict kept across the layer groups of one request (the Triton kernel's tile table).
    Returns ``out`` (allocated if None): uint8 [plan.total_nbytes] on the views' device."""
    lo, hi, src, out = _checked(layers, src_blocks, src_block_size, plan, out, layer_range)
    impl = impl or envs.transform_impl()
    if impl not in IMPLS:
        raise ValueError(f"transform impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if not 0 <= src_token_offset < max(1, src_block_size):
        raise ValueError(f"transform_kv: token offset {src_token_offset} not inside a {src_block_size}-token block")
    if uses_triton(impl, layers[0][0], out, plan.layout.spec.dtype):
        triton_transform(layers, src, src_block_size, plan, out, lo, hi, src_token_offset, memo)
        return out
    if not tile_aligned(src_block_size, src_token_offset):
        bs = plan.layout.spec.block_size
        grouped, ids = regroup_tokens(layers, src, src_block_size, src_token_offset, bs, lo, hi)
        return transform_kv(grouped, ids, bs, plan, out, "torch", layer_range=layer_range)
    k0 = layers[0][0]
    if impl == "cpu_kernel" or (impl == "auto" and cpu_kernel.available(k0) and out.device.type == "cpu"):
        kv = kernel_views if kernel_views is not None else cpu_kernel.KernelViews.of_views(layers)
        kernel_transform(kv, src, src_block_size, plan, out, (lo, hi), src_token_offset=src_token_offset)
        return out
    _torch_transform(layers, src, src_block_size, plan, out, lo, hi, src_token_offset)
    return out


def _checked(layers, src_blocks, src_block_size: int, plan: TransferPlan, out, layer_range):
    """:func:`transform_kv`'s arguments checked: ``(lo, hi, src block ids, out)``, ``out``
    allocated (uint8 [plan.total_nbytes] on the views' device) when None."""
    spec = plan.layout.spec
    if len(layers) != spec.num_layers:
        raise ValueError(f"transform_kv: {len(layers)} layers given, plan has {spec.num_layers}")
    lo, hi = (0, spec.num_layers) if layer_range is None else (int(layer_range[0]), int(layer_range[1]))
    if not 0 <= lo < hi <= spec.num_layers:
        raise ValueError(f"transform_kv: layer range {layer_range} not inside [0, {spec.num_layers})")
    k0 = layers[0][0]
    if tuple(k0.shape[1:]) != (spec.num_kv_heads, src_block_size, spec.head_dim):
        raise ValueError(
            f"transform_kv: source K is {tuple(k0.shape)}, expected "
            f"[*, {spec.num_kv_heads}, {src_block_size}, {spec.head_dim}]"
        )
    src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    if src.size and (src.min() < 0 or src.max() >= k0.shape[0]):
        raise ValueError(f"transform_kv: source block ids must be in [0, {k0.shape[0]})")
    if out is None:
        out = torch.empty(plan.total_nbytes, dtype=torch.uint8, device=k0.device)
    elif out.numel() != plan.total_nbytes or out.dtype != torch.uint8:
        raise ValueError(f"transform_kv: out must be uint8 [{plan.total_nbytes}]")
    return lo, hi, src, out


def _torch_transform(
    layers, src: np.ndarray, src_block_size: int, plan: TransferPlan, out: torch.Tensor, lo: int, hi: int, offset: int
) -> None:
    """The torch transform of layers lo..hi-1 into ``out``: a fused tilizer when every
    bank holds the same tiles per block and block sizes match, else a gather by tile
    index (``offset``: the span's first token in ``src[0]``, a multiple of 32)."""
    spec = plan.layout.spec
    device = layers[0][0].device
    counts = plan.bank_counts
    nb, n2l, n_tiles = len(counts), 2 * spec.num_layers, plan.tiles_per_tensor
    uniform = bool((counts == counts[0]).all())
    split = bank_digit_split(spec.num_kv_heads, spec.block_size // TILE, spec.head_dim // TILE, nb)
    fused = idx = invalid = None
    if (
        src_block_size == spec.block_size
        and offset == 0
        and src.size >= plan.dst_blocks.size
        and uniform
        and spec.tiles_per_block % nb == 0
        and split is not None
    ):
        fused = _FusedTilizer(plan, src[: plan.dst_blocks.size], split)
    else:
        sblk, head, s_tr, tc, valid = source_tile_index(plan, src, src_block_size, offset)
        idx = [to_device(a, device) for a in (sblk, head, s_tr, tc)]
        invalid = None if valid.all() else to_device(~valid, device)
    direct_bf16 = fused is not None and spec.dtype == "bfloat16" and layers[0][0].dtype == torch.bfloat16
    slots = out.view(nb, n2l, -1) if uniform else None
    for layer in range(lo, hi):
        for kv, x in enumerate(layers[layer]):
            slot = layer * 2 + kv
            if direct_bf16:  # G' bytes are the bf16 elements themselves: permute straight in
                fused(x, slots[:, slot].view(torch.bfloat16).view(nb, plan.dst_blocks.size, -1))
                continue
            if fused is not None:
                tiles = torch.empty(n_tiles, TILE_ELEMS, dtype=x.dtype, device=device)
                fused(x, tiles.view(nb, plan.dst_blocks.size, -1))
            else:
                tiles = tile_view(x)[idx[0], idx[1], idx[2], idx[3]].reshape(-1, TILE_ELEMS)
                if invalid is not None:
                    tiles[invalid] = 0
            packed = pack_tiles(tiles, spec.dtype)  # [T_req, tb] in G' (bank-major) order
            if uniform:
                slots[:, slot] = packed.view(nb, -1)
            else:
                _scatter_slot(out, packed, plan, slot)


def _scatter_slot(out: torch.Tensor, packed: torch.Tensor, plan: TransferPlan, slot: int) -> None:
    """Write one (layer, K|V) slot's packed tiles (bank-major) into each bank's segment."""
    tb, start = plan.layout.spec.tile_nbytes, 0
    for c, cnt in enumerate(int(x) for x in plan.bank_counts):
        if cnt:
            o = int(plan.segment_offset[c]) + slot * cnt * tb
            out[o : o + cnt * tb] = packed[start : start + cnt].reshape(-1)
        start += cnt


def kernel_tile_args(
    plan: TransferPlan, src: np.ndarray, src_block_size: int, src_token_offset: int = 0
) -> tuple[np.ndarray, ...]:
    """The CPU kernel's per-tile arguments for one request (:func:`cpu_kernel.tile_args`):
    computed once per request, reused by each layer group."""
    spec = plan.layout.spec
    tb, counts = spec.tile_nbytes, plan.bank_counts
    idx = source_tile_index(plan, src, src_block_size, src_token_offset)
    bank_of = np.repeat(np.arange(counts.size), counts)
    k_in_bank = np.arange(bank_of.size) - np.repeat(np.cumsum(counts) - counts, counts)
    first = plan.segment_offset[bank_of] + k_in_bank * tb  # byte offset in G' for slot 0
    stride = counts[bank_of] * tb  # bytes between consecutive (layer, K|V) slots
    return cpu_kernel.tile_args(idx, first, stride)


def kernel_transform(
    kv: cpu_kernel.KernelViews,
    src: np.ndarray,
    src_block_size: int,
    plan: TransferPlan,
    out: torch.Tensor,
    layer_range: tuple[int, int] | None = None,
    args=None,
    src_token_offset: int = 0,
) -> None:
    """The CPU kernel's transform: ``kv`` (built once per cache) -> G' in ``out`` (uint8,
    CPU, ``plan.total_nbytes``); ``layer_range`` and ``src_token_offset`` as in
    :func:`transform_kv`; ``args``: :func:`kernel_tile_args` when already computed."""
    spec = plan.layout.spec
    if (kv.tokens, kv.head_dim, kv.num_slots) != (src_block_size, spec.head_dim, 2 * spec.num_layers):
        raise ValueError(
            f"transform: kernel views of {kv.num_slots // 2} layers x {kv.tokens} tokens x "
            f"{kv.head_dim} dims do not match the plan"
        )
    if args is None:
        args = kernel_tile_args(plan, src, src_block_size, src_token_offset)
    cpu_kernel.launch(kv, args, out, spec.dtype, layer_range)


def transform_source(
    source,
    src_blocks,
    src_block_size: int,
    plan: TransferPlan,
    out: torch.Tensor,
    layer_range: tuple[int, int] | None = None,
    impl: str | None = None,
    memo: dict | None = None,
    src_token_offset: int = 0,
) -> torch.Tensor:
    """:func:`transform_kv` from a :class:`~vllm_hawk.layout.vllm_kv.TransformSource`:
    on the CPU through its kernel views (built once; vLLM's packed AMX layout read in
    place), elsewhere (a device, or blocks that are not tile-aligned) through
    ``source.select`` (zero-copy views, or a gather). ``memo``: a dict kept across the
    layer groups of one request (per-tile arguments)."""
    impl = impl or envs.transform_impl()
    src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    if impl in ("auto", "cpu_kernel") and out.device.type == "cpu" and tile_aligned(src_block_size, src_token_offset):
        kv = cpu_kernel.views_for(source)
        if kv is not None:
            if src.size and (src.min() < 0 or src.max() >= source.num_blocks):
                raise ValueError(f"transform: source block ids must be in [0, {source.num_blocks})")
            if out.numel() != plan.total_nbytes or out.dtype != torch.uint8:
                raise ValueError(f"transform: out must be uint8 [{plan.total_nbytes}]")
            spec = plan.layout.spec
            if source.num_layers != spec.num_layers:
                raise ValueError(f"transform: {source.num_layers} layers given, plan has {spec.num_layers}")
            args = None if memo is None else memo.get("tile_args")
            if args is None:
                args = kernel_tile_args(plan, src, src_block_size, src_token_offset)
                if memo is not None:
                    memo["tile_args"] = args
            kernel_transform(kv, src, src_block_size, plan, out, layer_range, args)
            return out
    layers, ids = source.select(src)
    return transform_kv(
        layers,
        ids,
        src_block_size,
        plan,
        out,
        impl,
        layer_range=layer_range,
        src_token_offset=src_token_offset,
        memo=memo,
    )
