"""GPU fast path of the transform: one fused Triton kernel per request or layer group.

Each program handles one destination tile of one (layer, K|V) slot: it reads the tile's
32 tokens x 32 dims straight from the source cache through the views' strides, puts them
in face order, packs them (bf16 round-to-nearest-even, or block-float with the shared
exponents and rounding of :func:`vllm_hawk.layout.formats.pack_tiles`) and stores the
tile's bytes at its place in G'. Source blocks of any size (16, 32, 64, ... tokens) and a
span starting inside a block are read row by row (``token // src_block_size`` picks the
block), so 16-token caches need no regroup copy; rows past the last source block are
zero. Grid: (tiles of the request, slots of the layer range): one launch per request, or
per layer group. The slots' views must share dtype and strides (vLLM's layer caches do);
each group of equal strides is one launch.

Arguments (all on the cache's device, built once per request by :func:`tile_table`):

* ``tiles``: int64 ``[T, 5]`` per request tile in G' order: first source token of its
  token-tile (counted in the concatenated source blocks), head, dim-tile, byte offset in
  G' of slot 0, bytes between consecutive slots;
* ``blocks``: int64 ``[n]`` the request's source block ids;
* ``slot_off``: int64 ``[2L]`` element offset of each slot's view from the base view.

Written against Triton's public API (``triton.jit``, ``tl.load``/``tl.store``); CI runs it
under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) and compares its bytes
with the torch path and the numba kernel. On a GPU it is the default (``auto``) for CUDA
caches; the torch path stays the reference and the fallback. Not exercised on a GPU in CI.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from vllm_hawk.layout.tiles import TILE
from vllm_hawk.transform.uploads import to_device

#: Target codes of the kernel (float32 G' is not a KV format: the torch path packs it).
TARGETS = {"bfloat16": 0, "bfloat8_b": 7, "bfloat4_b": 3}
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_COLS = 5  # token0, head, tc, first, step


@triton.jit
def bf16_bits(bits):
    """float32 bits -> bf16 bits, round to nearest even; every NaN -> 0x7FC0 (ttnn)."""
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(nan, 0x7FC0, rounded)


@triton.jit
def bfp_code(bits, exp, shared, MBITS: tl.constexpr):
    """One element's block-float code ``sign << MBITS | magnitude`` (formats._pack_bfp)."""
    man = (bits & 0x7FFFFF) | 0x800000
    man = man >> tl.minimum(shared - exp, 31)  # aligned to the shared exponent, truncating
    rest = man & ((1 << (24 - MBITS)) - 1)
    q = man >> (24 - MBITS)
    tie = 1 << (23 - MBITS)
    q = q + ((rest > tie) | ((rest == tie) & ((q & 1) == 1))).to(tl.int32)
    q = tl.minimum(q, (1 << MBITS) - 1)
    q = tl.where(exp == 0, 0, q)  # +-0.0 and subnormals -> 0
    sign = tl.where(q == 0, 0, (bits >> 31) & 1)
    return (sign << MBITS) | q


@triton.jit
def transform_tiles(
    src,  # the base view's first element (the lowest of the slots' views)
    slot_off,  # int64 [2L]
    blocks,  # int64 [n]
    n_blocks,
    tiles,  # int64 [T, 5]
    out8,  # uint8 G'
    out16,  # int16 view of G' (bf16 targets)
    slot0,
    sb,
    sh,
    st,
    sd,
    SBS: tl.constexpr,  # source block size (tokens)
    MBITS: tl.constexpr,  # 0: bf16; 7: bfloat8_b; 3: bfloat4_b
):
    t = tl.program_id(0).to(tl.int64)
    slot = slot0 + tl.program_id(1)
    row = tiles + t * 5
    token0 = tl.load(row)
    head = tl.load(row + 1)
    tc = tl.load(row + 2)
    dst = tl.load(row + 3) + slot * tl.load(row + 4)  # this tile's first byte in G'
    base = tl.load(slot_off + slot)

    fr = tl.arange(0, 64)[:, None]  # face row: face fr // 16, row fr % 16 of that face
    k = tl.arange(0, 8)[None, :]  # element pair (2k, 2k + 1) of the face row
    face = fr // 16
    r = (face // 2) * 16 + fr % 16  # tile row
    c = (face % 2) * 16 + 2 * k  # tile column of the pair's first element
    p = token0 + r  # [64, 1] token in the concatenated source blocks
    bi = p // SBS
    live = bi < n_blocks
    blk = tl.load(blocks + bi, mask=live, other=0)
    off = base + blk * sb + head * sh + (p % SBS) * st + (tc * 32 + c) * sd  # [64, 8]
    live8 = live & (k < 8)
    even = tl.load(src + off, mask=live8, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    odd = tl.load(src + off + sd, mask=live8, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    e = fr * 16 + 2 * k  # face-order index of the pair's first element

    if MBITS == 0:
        tl.store(out16 + dst // 2 + e, bf16_bits(even).to(tl.int16))
        tl.store(out16 + dst // 2 + e + 1, bf16_bits(odd).to(tl.int16))
    else:
        exp_e = (even >> 23) & 0xFF
        exp_o = (odd >> 23) & 0xFF
        shared = tl.maximum(tl.max(exp_e, axis=1), tl.max(exp_o, axis=1))  # [64]
        tl.store(out8 + dst + tl.arange(0, 64), shared.to(tl.uint8))
        lo = bfp_code(even, exp_e, shared[:, None], MBITS)
        hi = bfp_code(odd, exp_o, shared[:, None], MBITS)
        if MBITS == 7:
            tl.store(out8 + dst + 64 + e, lo.to(tl.uint8))
            tl.store(out8 + dst + 64 + e + 1, hi.to(tl.uint8))
        else:
            tl.store(out8 + dst + 64 + e // 2, (lo | (hi << 4)).to(tl.uint8))


def tile_table(plan, src_token_offset: int = 0) -> np.ndarray:
    """int64 ``[T, 5]`` per request tile in G' order (module doc): first source token of
    its token-tile, head, dim-tile, byte offset of slot 0 in G', bytes between slots."""
    spec = plan.layout.spec
    tb, counts = spec.tile_nbytes, plan.bank_counts
    tr_per_blk, tc_per = spec.block_size // TILE, spec.head_dim // TILE
    j = plan.bank_order
    i, u = j // spec.tiles_per_block, j % spec.tiles_per_block
    bank_of = np.repeat(np.arange(counts.size), counts)
    k_in_bank = np.arange(bank_of.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty((j.size, _COLS), dtype=np.int64)
    out[:, 0] = (i * tr_per_blk + (u // tc_per) % tr_per_blk) * TILE + src_token_offset
    out[:, 1] = u // (tr_per_blk * tc_per)
    out[:, 2] = u % tc_per
    out[:, 3] = plan.segment_offset[bank_of] + k_in_bank * tb
    out[:, 4] = counts[bank_of] * tb
    return out


def slot_groups(layers, lo: int, hi: int) -> list[tuple[torch.Tensor, list[int], np.ndarray]]:
    """The slots ``2*lo .. 2*hi-1`` grouped by (dtype, strides): per group the base view
    (lowest address), the first slot and the slots' element offsets from the base,
    consecutive slots only (a launch covers a slot range)."""
    flat = [(2 * layer + kv, x) for layer in range(lo, hi) for kv, x in enumerate(layers[layer])]
    groups: list[list] = []
    for s, x in flat:
        key = (x.dtype, tuple(x.stride()), x.device)
        if groups and groups[-1][0] == key:
            groups[-1][1].append((s, x))
        else:
            groups.append([key, [(s, x)]])
    out = []
    for _, items in groups:
        base = min((x for _, x in items), key=lambda x: x.data_ptr())
        esz = base.element_size()
        offs = []
        for _, x in items:
            d = x.data_ptr() - base.data_ptr()
            if d % esz:
                raise ValueError("triton transform: views of one dtype must be element-aligned to each other")
            offs.append(d // esz)
        out.append((base, [s for s, _ in items], np.asarray(offs, dtype=np.int64)))
    return out


def launch(
    layers,
    n_blocks: int,
    src_block_size: int,
    plan,
    out: torch.Tensor,
    lo: int,
    hi: int,
    table: torch.Tensor,
    blocks: torch.Tensor,
) -> int:
    """Transform layers ``lo..hi-1`` of ``layers`` (per-layer (K, V) logical views
    ``[blocks, H, src_block_size, D]``) into G' ``out`` (uint8 ``[plan.total_nbytes]``, on
    the views' device). ``table``: :func:`tile_table` and ``blocks``: the ``n_blocks``
    source block ids (int64), both on the device. Returns the number of kernel launches
    (one per group of slots with equal strides: one for vLLM's caches)."""
    dtype = plan.layout.spec.dtype
    if dtype not in TARGETS:
        raise ValueError(f"triton transform: target dtype {dtype!r} unsupported; one of {sorted(TARGETS)}")
    if out.data_ptr() % 2:
        raise ValueError("triton transform: G' must start at an even address")
    if out.device.type == "cpu" and not interpreted():
        raise ValueError("triton transform on CPU tensors runs only under TRITON_INTERPRET=1")
    out16 = out.view(torch.int16) if out.numel() % 2 == 0 else out[:-1].view(torch.int16)
    launches = 0
    for base, slots, offs in slot_groups(layers, lo, hi):
        if base.dtype not in SOURCE_DTYPES:
            raise ValueError(f"triton transform: source dtype {base.dtype} unsupported")
        if base.device != out.device:
            raise ValueError(f"triton transform: source on {base.device}, G' on {out.device}")
        sb, sh, st, sd = base.stride()
        full = np.zeros(slots[-1] + 1, np.int64)
        full[slots] = offs
        off = to_device(full, out.device)
        transform_tiles[(int(table.shape[0]), len(slots))](
            base,
            off,
            blocks,
            n_blocks,
            table,
            out,
            out16,
            slots[0],
            sb,
            sh,
            st,
            sd,
            SBS=int(src_block_size),
            MBITS=TARGETS[dtype],
        )
        launches += 1
    return launches


def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
