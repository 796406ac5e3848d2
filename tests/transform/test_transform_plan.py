"""Applying a transfer plan with plain memcpy into the emulated device yields exactly the
bytes a tilize-and-pack of the request's logical KV gives (staged and direct modes), for
source blocks of 16 tokens (a GPU's) to 128 and for the caches of vLLM's GPU attention
backends (FLASHINFER, TRITON_ATTN) written as their kernels write them."""

import ctypes

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.layout.vllm_kv import TransformSource, make_layer_caches, source_layout_for
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.transform import make_plan, transform_kv, transform_source

NUM_LAYERS = 2


def reference_blocks(x, src_blocks, src_bs, n_dst, bs):
    """Logical request KV [H, tokens, D] regrouped into n_dst blocks [n_dst, H, bs, D], zero padded."""
    tok = torch.cat([x[b] for b in src_blocks], dim=1)
    h, n, d = tok.shape
    out = torch.zeros(h, n_dst * bs, d)
    m = min(n, n_dst * bs)
    out[:, :m] = tok[:, :m]
    return out.reshape(h, n_dst, bs, d).transpose(0, 1)


def apply_plan(dev, plan, g: torch.Tensor):
    """Move G' into the device with memcpy exactly as the plan says (the transport's job)."""
    gaddr = g.data_ptr()
    recv = None
    if plan.mode == "staged":
        recv = dev.allocate_bank_buffers(plan.recv_nbytes_per_bank)
        dev.map_buffer_dma(recv)
    ops = plan.rdma
    for s, b, d, n in zip(
        ops.src_offset.tolist(), ops.bank.tolist(), ops.dst_offset.tolist(), ops.nbytes.tolist(), strict=False
    ):
        base = dev.get_buffer_address_bank(recv, b) if recv else dev.bank_address(b)
        ctypes.memmove(base + d, gaddr + s, n)
    if recv:
        for b in range(dev.num_banks):
            o = plan.intra_bank.for_bank(b)
            dev.copy_in_bank(b, o.src_offset + recv.address, o.dst_offset, o.nbytes)
        dev.unmap_buffer_dma(recv)
        dev.free_buffer(recv)


@st.composite
def cases(draw):
    profile = draw(st.sampled_from(["p100", "p150a", "n150"]))
    bs = draw(st.sampled_from([32, 64, 128]))
    src_bs = draw(st.sampled_from([16, 32, 64, 128]))
    head_dim = draw(st.sampled_from([64, 128]))
    heads = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(["bfloat16", "bfloat8_b"]))
    mode = draw(st.sampled_from(["staged", "direct"]))
    num_tokens = draw(st.integers(1, 400))
    n_dst = -(-num_tokens // bs)
    n_src = -(-num_tokens // src_bs)
    dst_blocks = draw(st.permutations(range(n_dst + 6)))[:n_dst]
    src_blocks = draw(st.permutations(range(n_src + 4)))[:n_src]
    src_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31))
    return profile, bs, src_bs, head_dim, heads, dtype, mode, dst_blocks, src_blocks, src_dtype, seed


@pytest.mark.parametrize("impl", ["cpu_kernel", "torch"])
@given(case=cases())
def test_plan_applied_with_memcpy_matches_tilize_and_pack(impl, case):
    """Both implementations of the transform (the fused CPU kernel and the torch path)."""
    profile, bs, src_bs, head_dim, heads, dtype, mode, dst_blocks, src_blocks, src_dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    spec = TTKVCacheSpec(NUM_LAYERS, max(dst_blocks) + 1, heads, bs, head_dim, dtype)
    dev = EmulatedDevice(profile, 16 << 20)
    layout, bufs = dev.allocate_kv_cache(spec)
    n_src_total = max(src_blocks) + 1
    # K in a transposed storage ([blocks, H, D, tokens] viewed as [blocks, H, tokens, D]) like
    # the CPU backend; V row-major.
    src = [
        (
            torch.randn(n_src_total, heads, head_dim, src_bs, generator=g).to(src_dtype).transpose(2, 3),
            torch.randn(n_src_total, heads, src_bs, head_dim, generator=g).to(src_dtype),
        )
        for _ in range(NUM_LAYERS)
    ]
    plan = make_plan(layout, dst_blocks, mode)
    gp = transform_kv(src, src_blocks, src_bs, plan, impl=impl)
    assert gp.numel() == plan.total_nbytes == plan.rdma.total_nbytes
    apply_plan(dev, plan, gp)
    for layer in range(NUM_LAYERS):
        for kv in range(2):
            want = tilize_pack(reference_blocks(src[layer][kv].float(), src_blocks, src_bs, len(dst_blocks), bs), dtype)
            got = dev.read_tiles(layout, layer, kv, layout.block_tiles(dst_blocks))
            assert torch.equal(got, want), (layer, kv)
    assert len(dev.live_buffers()) == 2 * NUM_LAYERS  # the receive buffer was returned


def test_coalescing_counts_worked_case():
    """p150a, bfp8, block 64, head_dim 128, 2 KV heads: 16 tiles per block, 2 per bank."""
    spec = TTKVCacheSpec(80, 64, 2, 64, 128, "bfloat8_b")
    dev = EmulatedDevice("p150a", 64 << 20)
    layout, _ = dev.allocate_kv_cache(spec)
    contiguous = make_plan(layout, [10, 11, 12, 13], "direct")
    assert len(contiguous.rdma) == 8 * 80 * 2  # one run per (bank, layer, K|V)
    assert set(contiguous.rdma.nbytes.tolist()) == {4 * 2 * 1088}
    scattered = make_plan(layout, [10, 20, 30, 40], "direct")
    assert len(scattered.rdma) == 4 * 8 * 80 * 2
    staged = make_plan(layout, [10, 20, 30, 40], "staged")
    assert len(staged.rdma) == 8 and len(staged.intra_bank) == len(scattered.rdma)
    assert len(staged.per_tile_ops()) == 4 * 16 * 80 * 2
    assert staged.total_nbytes == 4 * 16 * 1088 * 160


def test_plan_rejects_bad_blocks():
    dev = EmulatedDevice("p150a", 4 << 20)
    layout, _ = dev.allocate_kv_cache(TTKVCacheSpec(1, 8, 1, 32, 64, "bfloat16"))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        make_plan(layout, [3, 8])
    with pytest.raises(ValueError, match="distinct"):
        make_plan(layout, [3, 3])
    with pytest.raises(ValueError, match="mode"):
        make_plan(layout, [1], "scatter")


def write_as_vllm_kernels(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K, V ``[blocks, H, N, D]`` as vLLM 0.32's FLASHINFER / TRITON_ATTN code does:
    ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` gives the ``[B, N, H, D]`` caches
    that ``reshape_and_cache_flash`` writes slot by slot."""
    k_cache, v_cache = cache.transpose(1, 2).split(k.shape[-1], dim=-1)
    k_cache.copy_(k.transpose(1, 2))
    v_cache.copy_(v.transpose(1, 2))


@pytest.mark.parametrize(
    "backend,layout",
    [("FLASHINFER", "LBNHC"), ("FLASHINFER", "LBHNC"), ("FLASHINFER", "BLHNC"), ("TRITON_ATTN", "LBNHC")],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat8_b"])
@pytest.mark.parametrize("src_bs", [16, 64])
def test_gpu_backend_caches_transform_to_tilize_and_pack(backend, layout, dtype, src_bs):
    heads, head_dim, bs, blocks, tokens = 2, 64, 64, 12, 150
    g = torch.Generator().manual_seed(len(backend) + src_bs)
    adapter = source_layout_for(backend, num_kv_heads=heads, block_size=src_bs, head_dim=head_dim)
    caches = make_layer_caches(NUM_LAYERS, blocks, heads, src_bs, 2 * head_dim, layout=layout)
    logical = []
    for c in caches:
        k, v = (torch.randn(blocks, heads, src_bs, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
        write_as_vllm_kernels(c, k, v)
        logical.append((k, v))
    src_blocks = [9, 2, 5, 0, 7, 11, 3, 8, 1, 10][: -(-tokens // src_bs)]
    dst_blocks = [3, 0, 2]
    dev = EmulatedDevice("p150a", 16 << 20)
    layout_tt, _bufs = dev.allocate_kv_cache(TTKVCacheSpec(NUM_LAYERS, 4, heads, bs, head_dim, dtype))
    plan = make_plan(layout_tt, dst_blocks, "staged")
    gp = torch.zeros(plan.total_nbytes, dtype=torch.uint8)
    transform_source(TransformSource([adapter] * NUM_LAYERS, caches), src_blocks, src_bs, plan, gp)
    apply_plan(dev, plan, gp)
    for layer in range(NUM_LAYERS):
        for kv in range(2):
            want = tilize_pack(reference_blocks(logical[layer][kv].float(), src_blocks, src_bs, 3, bs), dtype)
            assert torch.equal(dev.read_tiles(layout_tt, layer, kv, layout_tt.block_tiles(dst_blocks)), want)


def test_gpu_backend_caches_that_are_not_k_v_channels_are_refused():
    with pytest.raises(NotImplementedError, match="NVFP4"):
        source_layout_for("FLASHINFER", num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.uint8)
    adapter = source_layout_for("TRITON_ATTN", num_kv_heads=2, block_size=16, head_dim=64)
    padded = torch.zeros(4, 2, 16, 2 * (64 + 2), dtype=torch.bfloat16)  # per-token-head quantized: scales padded in
    with pytest.raises(ValueError, match="not \\[num_blocks, 2, 16, 128\\]"):
        adapter.kv_views(padded)
