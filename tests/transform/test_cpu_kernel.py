"""The numba CPU kernel against the torch packer: every bf16 bit pattern against every
shared exponent (the 16-bit-lane arithmetic), and every CPU / FlashAttention source
layout of vLLM 0.32 into every Tenstorrent KV dtype, whole and by layer groups."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.formats import pack_tiles, tile_format
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.layout.vllm_kv import (
    KV_CACHE_LAYOUTS,
    CpuAttnKVLayout,
    FlashAttnKVLayout,
    TransformSource,
    make_layer_caches,
)
from vllm_hawk.transform import cpu_kernel, make_plan, transform_kv, transform_source

DTYPES = ("bfloat16", "bfloat8_b", "bfloat4_b")
SOURCES = ("vec", "vec16", "amx", *sorted(KV_CACHE_LAYOUTS))


def every_bf16_against_every_exponent() -> torch.Tensor:
    """Face rows whose first value sets the shared exponent s (s = 255: +inf) and whose
    other 15 hold every bf16 pattern with an exponent <= s, for every s: bf16 tiles."""
    v = np.arange(1 << 16, dtype=np.uint32)
    e = (v >> 7) & 0xFF
    rows = []
    for shared in range(256):
        vals = v[e <= shared].astype(np.uint16)
        vals = np.concatenate([vals, np.zeros(-vals.size % 15, np.uint16)]).reshape(-1, 15)
        setter = np.full((vals.shape[0], 1), shared << 7 if shared < 255 else 0x7F80, np.uint16)
        rows.append(np.concatenate([setter, vals], 1))
    rows = np.concatenate(rows)
    rows = np.concatenate([rows, np.zeros((-rows.shape[0] % 64, 16), np.uint16)]).reshape(-1, 1024)
    return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat8_b", "bfloat4_b"])
def test_bf16_lanes_exhaustive(dtype):
    """Every bf16 value (NaN, inf, subnormals, zeros of both signs included) against every
    shared exponent: the kernel's 16-bit arithmetic equals the float32 packer."""
    tiles = every_bf16_against_every_exponent()
    assert torch.equal(cpu_kernel.pack_tiles_bf16(tiles, dtype), pack_tiles(tiles.float(), dtype))


def _source(kind: str, layers: int, blocks: int, heads: int, bs: int, dim: int, seed: int):
    if kind in ("vec", "vec16", "amx"):
        lay, caches = (
            CpuAttnKVLayout(heads, bs, dim, isa=kind),
            make_layer_caches(layers, blocks, heads, bs, 2 * dim, layout="LBHNC"),
        )
    else:
        lay, caches = (
            FlashAttnKVLayout(heads, bs, dim),
            make_layer_caches(layers, blocks, heads, bs, 2 * dim, layout=kind),
        )
    g = torch.Generator().manual_seed(seed)
    for c in caches:  # values over many exponents, some exact zeros
        k = torch.randn(blocks, heads, bs, dim, generator=g) * torch.exp2(
            torch.randint(-30, 30, (1, 1, bs, 1), generator=g).float()
        )
        v = torch.randn(blocks, heads, bs, dim, generator=g)
        v[..., ::7] = 0
        lay.write_blocks(c, torch.arange(blocks), k, v)
    return TransformSource([lay] * layers, caches)


def _plan(layers, heads, bs, dim, dtype, dst, profile="p150a"):
    prof = load_profile(profile)
    tb = tile_format(dtype).tile_nbytes
    spec = TTKVCacheSpec(
        num_layers=layers, num_blocks=max(dst) + 1, num_kv_heads=heads, block_size=bs, head_dim=dim, dtype=dtype
    )
    return make_plan(TTKVCacheLayout(spec, prof.num_banks, prof.aligned_page(tb), ((0, 0),) * layers), dst, "staged")


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_source_layout_equals_torch(kind, dtype):
    """Kernel (views read in place: amx too) == torch path (select: views or a gather)."""
    layers, heads, bs, dim = 3, 2, 64, 64
    src = _source(kind, layers, 9, heads, bs, dim, seed=len(kind))
    assert cpu_kernel.views_for(src) is cpu_kernel.views_for(src) is not None  # built once
    plan = _plan(layers, heads, bs, dim, dtype, [1, 4, 6, 0, 7])
    ids = [7, 2, 5, 3, 8]
    got = torch.zeros(plan.total_nbytes, dtype=torch.uint8)
    transform_source(src, ids, bs, plan, got)
    views, sel = src.select(ids)
    want = transform_kv(views, sel, bs, plan, impl="torch")
    assert torch.equal(got, want)
    groups = torch.full_like(got, 0xAB)
    for lo, hi in ((0, 1), (1, 3)):  # layer groups write disjoint bytes that add up to G'
        transform_source(src, ids, bs, plan, groups, layer_range=(lo, hi))
    assert torch.equal(groups, want)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(SOURCES),
    dtype=st.sampled_from(DTYPES),
    heads=st.integers(1, 4),
    bs=st.sampled_from([32, 64, 128]),
    dim=st.sampled_from([32, 64, 128]),
    tokens=st.integers(1, 300),
    profile=st.sampled_from(["p150a", "n150", "p100"]),
    seed=st.integers(0, 2**31),
)
def test_random_shapes_equal_torch(kind, dtype, heads, bs, dim, tokens, profile, seed):
    if kind == "amx" and dim % 16:
        return
    layers = 2
    rng = np.random.default_rng(seed)
    n = -(-tokens // bs)
    blocks = n + 3
    src = _source(kind, layers, blocks, heads, bs, dim, seed % 1000)
    ids = rng.permutation(blocks)[:n]
    plan = _plan(layers, heads, bs, dim, dtype, rng.permutation(n + 5)[:n].tolist(), profile)
    got = torch.zeros(plan.total_nbytes, dtype=torch.uint8)
    transform_source(src, ids, bs, plan, got)
    views, sel = src.select(ids)
    assert torch.equal(got, transform_kv(views, sel, bs, plan, impl="torch"))


def test_layer_range_is_checked():
    src = _source("LBNHC", 2, 3, 1, 32, 32, 0)
    plan = _plan(2, 1, 32, 32, "bfloat16", [0])
    views, sel = src.select([1])
    with pytest.raises(ValueError, match="layer range"):
        transform_kv(views, sel, 32, plan, layer_range=(1, 3))
