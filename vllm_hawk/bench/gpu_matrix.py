"""The transform's byte-equality matrix on a device, against the CPU reference: what
``scripts/gpu_check.py --suite full`` runs first.

Every vLLM 0.32 FlashAttention-family source layout
(:data:`~vllm_hawk.layout.vllm_kv.KV_CACHE_LAYOUTS`) x source block sizes {16, 32, 64} x
destination block sizes {32, 64} x {bfloat16, bfloat8_b, bfloat4_b} x {whole request,
layer groups, head share}, each with scattered source blocks, a partial last block and a
non-zero first destination block (the span starts inside a source block where the
destination's blocks are smaller). Per case, G' from
:func:`~vllm_hawk.transform.transform_source` on the device (``impl``: ``auto``, the
Triton kernel on CUDA, ``triton`` under its interpreter on the CPU, or ``torch``) equals
G' from both CPU references over a host copy of the same caches: the numba kernel (over
the same tokens regrouped into destination-sized blocks where the source is not
tile-aligned; ``ref`` says which) and the torch path. Layer groups: ``layer_range`` calls into one buffer
(prefilled with 0xAB) that must add up to the whole G'. Head share: heads 1..H-1 of the
source (``TransformSource.heads``).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hawk.kvflow.sources import src_block_span
from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.formats import tile_format
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.layout.vllm_kv import KV_CACHE_LAYOUTS, FlashAttnKVLayout, TransformSource, make_layer_caches
from vllm_hawk.transform import make_plan, transform_kv, transform_source
from vllm_hawk.transform.kv_transform import regroup_tokens, tile_aligned

__all__ = ["DTYPES", "SHARES", "MatrixGeo", "cases", "matrix_rows", "random_sources", "tt_plan"]

DTYPES = ("bfloat16", "bfloat8_b", "bfloat4_b")
SRC_BLOCK_SIZES = (16, 32, 64)
DST_BLOCK_SIZES = (32, 64)
SHARES = ("whole", "layer-group", "head-share")


@dataclass(frozen=True)
class MatrixGeo:
    """One cache geometry: layers (>= 2: two layer groups), KV heads (>= 2: the share is
    heads 1..H-1), head_dim, the request's tokens (not a multiple of any block size: a partial
    last block) and its first destination block (the decode holds the ones before it)."""

    layers: int = 3
    heads: int = 4
    head_dim: int = 64
    tokens: int = 165
    first_block: int = 1


def random_sources(layout: str, layers: int, blocks: int, heads: int, bs: int, dim: int, device, seed: int = 0):
    """(device TransformSource, host TransformSource) over FlashAttention caches ``[blocks,
    heads, bs, 2*dim]`` of vLLM ``layout`` holding the same bf16 values (made on the host:
    normal values over many exponents, every 7th V channel an exact zero)."""
    adapters = [FlashAttnKVLayout(heads, bs, dim)] * layers
    host = make_layer_caches(layers, blocks, heads, bs, 2 * dim, layout=layout)
    g = torch.Generator().manual_seed(seed)
    for c in host:
        k = torch.randn(blocks, heads, bs, dim, generator=g) * torch.exp2(
            torch.randint(-30, 30, (1, 1, bs, 1), generator=g).float()
        )
        v = torch.randn(blocks, heads, bs, dim, generator=g)
        v[..., ::7] = 0
        c.copy_(torch.cat([k, v], dim=-1).to(torch.bfloat16))
    dev = make_layer_caches(layers, blocks, heads, bs, 2 * dim, layout=layout, device=device)  # vLLM's strides
    for d, c in zip(dev, host, strict=True):
        d.copy_(c.to(device))
    return TransformSource(adapters, dev), TransformSource(adapters, host)


@functools.cache
def _profile(name: str):
    return load_profile(name)


def tt_plan(layers: int, heads: int, bs: int, dim: int, dtype: str, dst_ids, profile: str = "p150a"):
    """The staged transfer plan of a Tenstorrent KV cache (``bs``-token blocks of
    ``dtype`` tiles on ``profile``) for destination blocks ``dst_ids``."""
    prof = _profile(profile)
    tb = tile_format(dtype).tile_nbytes
    spec = TTKVCacheSpec(layers, int(max(dst_ids)) + 1, heads, bs, dim, dtype)
    return make_plan(
        TTKVCacheLayout(spec, prof.num_banks, prof.aligned_page(tb), ((0, 0),) * layers), dst_ids, "staged"
    )


def cases(layouts=None, src_sizes=SRC_BLOCK_SIZES, dst_sizes=DST_BLOCK_SIZES, dtypes=DTYPES, shares=SHARES):
    """The matrix: (layout, src block size, dst block size, dtype, share) tuples."""
    return list(itertools.product(sorted(layouts or KV_CACHE_LAYOUTS), src_sizes, dst_sizes, dtypes, shares))


def _g_prime(src, ids, sbs, plan, offset, impl, share, layers, device) -> tuple[torch.Tensor, dict]:
    """G' of one case on ``device`` by ``impl`` (layer groups: two ``layer_range`` calls),
    and the request's memo (``triton_launches``: the Triton kernel's launches)."""
    out = torch.full((plan.total_nbytes,), 0xAB, dtype=torch.uint8, device=device)
    memo: dict = {}
    ranges = ((0, 1), (1, layers)) if share == "layer-group" else (None,)
    for r in ranges:
        transform_source(src, ids, sbs, plan, out, layer_range=r, impl=impl, memo=memo, src_token_offset=offset)
    return out, memo


def _references(host, ids, sbs: int, plan, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(numba G', torch-path G') of one case from the host caches. The numba kernel reads
    tile-aligned blocks only: elsewhere it gets the same tokens regrouped into
    destination-sized blocks (what the torch path does first)."""
    views, sel = host.select(ids)
    torch_ref = transform_kv(views, sel, sbs, plan, impl="torch", src_token_offset=offset)
    if tile_aligned(sbs, offset):
        out = torch.empty(plan.total_nbytes, dtype=torch.uint8)
        return transform_source(host, ids, sbs, plan, out, impl="cpu_kernel", src_token_offset=offset), torch_ref
    bs, n_layers = plan.layout.spec.block_size, plan.layout.spec.num_layers
    grouped, gids = regroup_tokens(views, sel, sbs, offset, bs, 0, n_layers)
    return transform_kv(grouped, gids, bs, plan, impl="cpu_kernel"), torch_ref


def _one(case, impl: str, geo: MatrixGeo, device, pools: dict, rng) -> dict:
    layout, sbs, dbs, dtype, share = case
    key = (layout, sbs)
    n_total = -(-geo.tokens // sbs)
    if key not in pools:  # one cache pair per (layout, source block size)
        pools[key] = random_sources(layout, geo.layers, 2 * n_total + 3, geo.heads, sbs, geo.head_dim, device, sbs)
    dev, host = pools[key]
    all_src = rng.permutation(2 * n_total + 3)[:n_total]  # scattered
    lo, hi, offset = src_block_span(geo.first_block, dbs, geo.tokens, sbs)
    ids = all_src[lo:hi]
    n_dst = -(-geo.tokens // dbs) - geo.first_block
    dst = rng.permutation(n_dst + 4)[:n_dst]
    heads = geo.heads
    if share == "head-share":
        heads = geo.heads - 1
        dev, host = dev.heads(1, heads), host.heads(1, heads)
    plan = tt_plan(geo.layers, heads, dbs, geo.head_dim, dtype, dst)
    numba, torch_ref = _references(host, ids, sbs, plan, offset)
    t0 = time.perf_counter()
    got, memo = _g_prime(dev, ids, sbs, plan, offset, impl, share, geo.layers, device)
    if torch.device(device).type != "cpu":
        torch.cuda.synchronize(device)
    ms = 1e3 * (time.perf_counter() - t0)
    return {
        "layout": layout,
        "src_block_size": sbs,
        "dst_block_size": dbs,
        "dtype": dtype,
        "share": share,
        "impl": impl,
        "ref": "numba" if tile_aligned(sbs, offset) else "numba-regrouped",
        "token_offset": offset,
        "bytes_equal": bool(torch.equal(got.cpu(), numba) and torch.equal(numba, torch_ref)),
        "torch_equal": bool(torch.equal(got.cpu(), torch_ref)),
        "triton_launches": memo.get("triton_launches", 0),
        "ms": ms,
    }


def matrix_rows(device, impl: str, geo: MatrixGeo, case_list, deadline: float | None = None) -> tuple[list, int]:
    """One row per case of ``case_list`` (:func:`cases`) for ``impl`` on ``device``;
    stops at ``deadline`` (``time.monotonic``). Returns (rows, cases not run)."""
    rng, pools, rows = np.random.default_rng(0), {}, []
    for i, case in enumerate(case_list):
        if deadline is not None and time.monotonic() > deadline:
            return rows, len(case_list) - i
        rows.append(_one(case, impl, geo, device, pools, rng))
    return rows, 0
