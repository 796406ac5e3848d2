"""Source KV layouts of vLLM 0.32 (vllm_hawk.layout.vllm_kv).

* pure-torch tests: round trips, byte ranges against strides, the AMX order against a
  scalar port of the C++ index arithmetic (runs on every host), the transform over the
  AMX layout (gathered) equals the transform over the vec layout, factory errors;
* kernel test: vLLM's own ``cpu_attn_reshape_and_cache`` writes, the adapter reads (the
  amx case wherever AMX works here);
* engine proof (@pytest.mark.vllm): the tiny Llama prefilled by a real in-process vLLM
  engine, once as the AMX policy decides here (``HAWK_CPU_AMX=auto``) and once with
  ``HAWK_CPU_AMX=off`` (non-AMX layout on every host); the adapter's K/V for the
  request's blocks equal HF transformers' K/V.
"""

from __future__ import annotations

import pytest
import torch

from vllm_hawk.layout.vllm_kv import (
    CPU_ATTN_ISAS,
    KV_CACHE_LAYOUTS,
    CpuAttnKVLayout,
    FlashAttnKVLayout,
    FlashInferKVLayout,
    SourceKVLayout,
    TransformSource,
    TritonAttnKVLayout,
    block_byte_ranges,
    detect_cpu_attn_isa,
    make_layer_caches,
    source_layout_for,
    source_layout_from_layer,
)

H, N, D = 4, 32, 32


def _rand_kv(n, heads=H, block=N, dim=D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (n, heads, block, dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as uint8 (offset 0 = storage start)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),))


# --------------------------------------------------------------------------- CPU_ATTN


@pytest.mark.parametrize("isa", CPU_ATTN_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_roundtrip(isa, dtype):
    block, dim = (32, 48) if isa == "vec16" else (64, 32)
    if isa == "amx" and dtype != torch.bfloat16:
        with pytest.raises(ValueError, match="bf16"):
            CpuAttnKVLayout(H, block, dim, dtype, isa=isa)
        return
    lay = CpuAttnKVLayout(H, block, dim, dtype, isa=isa)
    cache = torch.zeros(10, H, block, 2 * dim, dtype=dtype)
    ids = torch.tensor([7, 2, 5])
    k, v = _rand_kv(3, block=block, dim=dim, dtype=dtype)
    lay.write_blocks(cache, ids, k, v)
    k2, v2 = lay.read_blocks(cache, ids)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    untouched = [i for i in range(10) if i not in ids.tolist()]
    assert cache[untouched].abs().sum() == 0


def test_cpu_vec_stores_k_transposed():
    """vec: slab = K as [D, N] (dim-major) then V as [N, D]; raw element check."""
    lay = CpuAttnKVLayout(H, N, D, torch.float32, isa="vec")
    cache = torch.zeros(3, H, N, 2 * D)
    k, v = _rand_kv(1, dtype=torch.float32)
    lay.write_blocks(cache, torch.tensor([1]), k, v)
    slab = cache[1].reshape(H, 2 * N * D)
    assert torch.equal(slab[:, : N * D].view(H, D, N), k[0].transpose(-1, -2))
    assert torch.equal(slab[:, N * D :].view(H, N, D), v[0])


def _amx_scalar_offsets(block, dim):
    """Element offsets inside a (block, head) slab, ported from the C++ loops of vLLM 0.32
    ``csrc/cpu/cpu_attn_amx.hpp``, ``AttentionImpl<ISA::AMX>::reshape_and_cache`` (bf16:
    64-byte tile rows). K: token group ``t // 16``, 32-bit words ``j`` of the token 16
    words apart. V: head-dim groups of 16 (``block * 16`` elements apart), token pairs
    ``t // 2`` 32 elements apart, the pair's two tokens interleaved."""
    k_off = torch.empty(block, dim, dtype=torch.long)
    v_off = torch.empty(block, dim, dtype=torch.long)
    tok_per_group = 64 // 4  # tokens per K group
    words = dim // 2  # 32-bit words per token (2 bf16 each)
    for t in range(block):
        g, o = divmod(t, tok_per_group)
        for j in range(words):
            word = g * tok_per_group * words + o + j * tok_per_group
            k_off[t, 2 * j] = 2 * word
            k_off[t, 2 * j + 1] = 2 * word + 1
        sg, so = divmod(t, 2)
        for i in range(dim // 16):
            for j in range(16):
                v_off[t, 16 * i + j] = block * dim + i * block * 16 + sg * 2 * 16 + so + 2 * j
    return k_off, v_off


@pytest.mark.parametrize("block,dim", [(64, 32), (32, 64), (128, 128)])
def test_cpu_amx_matches_cpp_index_arithmetic(block, dim):
    """The layout model of vLLM's AMX KV cache, derived from its source; runs on every host
    (no AMX needed), whatever the CPU."""
    lay = CpuAttnKVLayout(H, block, dim, isa="amx")
    cache = torch.zeros(2, H, block, 2 * dim, dtype=torch.bfloat16)
    k, v = _rand_kv(1, block=block, dim=dim)
    lay.write_blocks(cache, torch.tensor([1]), k, v)
    slab = cache[1].reshape(H, -1)
    k_off, v_off = _amx_scalar_offsets(block, dim)
    assert torch.equal(slab[:, k_off], k[0]) and torch.equal(slab[:, v_off], v[0])


def test_cpu_refuses_unknown_isa_and_fp8():
    with pytest.raises(NotImplementedError, match="neon"):
        CpuAttnKVLayout(H, N, D, isa="neon")
    with pytest.raises(NotImplementedError, match="fp8"):
        CpuAttnKVLayout(H, N, D, torch.uint8, isa="vec")


@pytest.mark.parametrize(
    "isa,block,dim",
    [("vec", 32, 32), ("vec", 128, 64), ("vec16", 32, 48), ("vec16", 16, 64), ("amx", 32, 32), ("amx", 64, 128)],
)
def test_cpu_layout_matches_vllm_kernel(isa, block, dim):
    """vLLM's C++ cpu_attn_reshape_and_cache writes; the adapter reads it back exactly.

    amx: wherever AMX works here (probe in a child process); elsewhere the source-derived
    model (test_cpu_amx_matches_cpp_index_arithmetic) covers the layout."""
    from vllm_fixtures import require_vllm

    require_vllm()
    if isa == "amx":
        from vllm_hawk.cpu_amx import decide

        d = decide("auto")
        if not d.use_amx:
            pytest.skip(
                f"vLLM's AMX kernel cannot run here ({d.reason}); the layout model "
                "derived from vLLM's source is tested instead"
            )
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from vllm._custom_ops import cpu_attn_reshape_and_cache

    cache = torch.zeros(5, H, block, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(5, H, 2 * block, dim).chunk(2, dim=2)
    ids = torch.tensor([3, 1])
    k, v = _rand_kv(2, block=block, dim=dim)
    tokens_k = k.transpose(1, 2).reshape(-1, H, dim)  # [tokens, heads, dim]
    tokens_v = v.transpose(1, 2).reshape(-1, H, dim)
    slots = (ids[:, None] * block + torch.arange(block)).reshape(-1)
    cpu_attn_reshape_and_cache(tokens_k, tokens_v, key_cache, value_cache, slots, isa)
    lay = CpuAttnKVLayout(H, block, dim, isa=isa)
    k2, v2 = lay.read_blocks(cache, ids)
    assert torch.equal(k2, k) and torch.equal(v2, v)


# --------------------------------------------------------------------------- FLASH_ATTN


@pytest.mark.parametrize("layout", sorted(KV_CACHE_LAYOUTS))
def test_flash_roundtrip_random_block_tables(layout):
    layers, blocks, block = 3, 12, 16
    caches = make_layer_caches(layers, blocks, H, block, 2 * D, layout=layout)
    lay = FlashAttnKVLayout(H, block, D)
    g = torch.Generator().manual_seed(1)
    written = {}
    for li, cache in enumerate(caches):
        ids = torch.randperm(blocks, generator=g)[:5]
        k, v = _rand_kv(5, block=block, seed=li)
        lay.write_blocks(cache, ids, k, v)
        written[li] = (ids, k, v)
    for li, (ids, k, v) in written.items():
        k2, v2 = lay.read_blocks(caches[li], ids)
        assert torch.equal(k2, k) and torch.equal(v2, v)
        # channels [:D] are K of the token, [D:] its V
        b, h, t = int(ids[0]), 2, 5
        assert torch.equal(caches[li][b, h, t, :D], k[0, h, t])
        assert torch.equal(caches[li][b, h, t, D:], v[0, h, t])


@pytest.mark.parametrize("layout", sorted(KV_CACHE_LAYOUTS))
def test_byte_ranges_follow_strides(layout):
    layers, blocks, block = 2, 6, 16
    caches = make_layer_caches(layers, blocks, H, block, 2 * D, layout=layout)
    lay = FlashAttnKVLayout(H, block, D)
    runs_expected = 1 if layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC") else H
    for _li, cache in enumerate(caches):
        origin = cache.data_ptr() - cache.untyped_storage().data_ptr()
        seen = torch.zeros(cache.untyped_storage().nbytes(), dtype=torch.bool)
        for b in range(blocks):
            runs = lay.block_byte_ranges(cache, b)
            assert len(runs) == runs_expected
            assert sum(n for _, n in runs) == lay.block_nbytes
            # the runs hold exactly this block's bytes, in the cache's own order
            _bytes_of(cache).zero_()  # all layers
            k, v = _rand_kv(1, block=block, seed=b)
            lay.write_blocks(cache, torch.tensor([b]), k, v)
            raw = _bytes_of(cache)
            inside = torch.zeros_like(seen)
            for off, n in runs:
                assert off >= 0 and off % cache.element_size() == 0
                inside[origin + off : origin + off + n] = True
            assert not (seen & inside).any(), "blocks overlap"
            seen |= inside
            assert raw[~inside].count_nonzero() == 0
            got = torch.cat([raw[origin + o : origin + o + n] for o, n in runs])
            ref = cache[b]  # element order of the runs = physical order of [H, N, C]
            order = sorted(range(3), key=lambda d: -ref.stride(d))
            phys = ref.permute(*order).contiguous().view(torch.uint8).reshape(-1)
            assert torch.equal(got, phys)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_dim_order_is_the_physical_order_whatever_the_heads_and_block_size(heads):
    """What a GG pair's handshake names (``src_layout``): the same for every TP rank's share
    of heads (a rank with one head too) and every block size."""
    from vllm_hawk.layout.vllm_kv import dim_order

    want = {"LBHNC": "BHNC", "LBNHC": "BNHC", "LHBNC": "HBNC", "BLHNC": "BHNC", "BLNHC": "BNHC", "BHLNC": "BHNC"}
    for layout, order in want.items():
        for block in (16, 64):
            cache = make_layer_caches(2, 5, heads, block, 2 * D, layout=layout)[1]
            assert dim_order(cache) == order, (layout, heads, block)
            assert dim_order(cache[:, :1]) == order  # one head of the cache


def test_cpu_byte_ranges_one_run_per_block():
    cache = make_layer_caches(2, 8, H, N, 2 * D, layout="LBHNC")[1]
    lay = CpuAttnKVLayout(H, N, D, isa="vec")
    nbytes = H * N * 2 * D * 2
    assert lay.block_byte_ranges(cache, 3) == [(3 * nbytes, nbytes)]
    assert block_byte_ranges(cache, 0) == [(0, nbytes)]


# --------------------------------------------------------------------------- factory


def test_factory():
    lay = source_layout_for("FLASH_ATTN", num_kv_heads=H, block_size=N, head_dim=D)
    assert isinstance(lay, FlashAttnKVLayout) and isinstance(lay, SourceKVLayout)
    lay = source_layout_for("CPU_ATTN", num_kv_heads=H, block_size=N, head_dim=D, isa="vec")
    assert isinstance(lay, CpuAttnKVLayout) and isinstance(lay, SourceKVLayout)
    for name, cls in (("FLASHINFER", FlashInferKVLayout), ("TRITON_ATTN", TritonAttnKVLayout)):
        lay = source_layout_for(name, num_kv_heads=H, block_size=N, head_dim=D)
        assert type(lay) is cls and lay.name == name and lay.strided
    with pytest.raises(NotImplementedError, match="XFORMERS.*supported: CPU_ATTN, FLASH_ATTN, FLASHINFER, TRITON_ATTN"):
        source_layout_for("XFORMERS", num_kv_heads=H, block_size=N, head_dim=D)


def test_shape_mismatch_is_reported():
    lay = FlashAttnKVLayout(H, N, D)
    with pytest.raises(ValueError, match="not \\[num_blocks, 4, 32, 64\\]"):
        lay.read_blocks(torch.zeros(2, H, N, D, dtype=torch.bfloat16), torch.tensor([0]))


# --------------------------------------------------------------------------- real engine

PROMPT_LEN = 70  # 3 blocks of 32, the last one partial


@pytest.fixture(scope="module", params=["auto", "off"])
def prefilled(request):
    """One in-process vLLM engine per ``HAWK_CPU_AMX`` mode: tiny bf16 Llama, block 32,
    one prompt prefilled. ``auto``: the AMX layout wherever AMX works here; ``off``: the
    non-AMX layout on every host (the policy applied in this process, as the launchers
    do in each engine process)."""
    from vllm_fixtures import attention_layers, capture_block_ids, inprocess_llm, require_vllm, tiny_model_path

    from vllm_hawk.cpu_amx import apply_cpu_amx_policy, reset_cpu_amx_policy

    require_vllm()
    path = tiny_model_path()
    reset_cpu_amx_policy()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HAWK_CPU_AMX", request.param)
            decision = apply_cpu_amx_policy()
            with inprocess_llm(path, block_size=32, enable_prefix_caching=False) as llm:
                from vllm import SamplingParams

                captured = capture_block_ids(llm)
                g = torch.Generator().manual_seed(0)
                prompt = torch.randint(2, 1024, (PROMPT_LEN,), generator=g).tolist()
                llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0))
                ((block_ids,),) = captured.values()  # one request, one KV cache group
                layers = attention_layers(llm)
                yield dict(path=path, prompt=prompt, block_ids=block_ids, layers=layers, amx=decision)
    finally:
        reset_cpu_amx_policy()


@pytest.fixture(scope="module")
def hf_kv(prefilled):
    """Per-layer (K, V) [kv_heads, tokens, head_dim] float32 after RoPE, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(prefilled["path"]), dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([prefilled["prompt"]]), use_cache=True)
    cache = out.past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[blocks, heads, block_size, dim] -> [heads, blocks*block_size, dim] float32."""
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3]).float()


@pytest.mark.vllm
@pytest.mark.inprocess_engine
def test_engine_layer_metadata(prefilled):
    assert len(prefilled["block_ids"]) == 3 and 0 not in prefilled["block_ids"]
    for layer in prefilled["layers"].values():
        lay = source_layout_from_layer(layer)
        assert isinstance(lay, CpuAttnKVLayout)
        assert (lay.num_kv_heads, lay.block_size, lay.head_dim) == (4, 32, 32)
        assert lay.dtype == torch.bfloat16
        assert lay.isa == detect_cpu_attn_isa(torch.bfloat16, 32, 32)
        if prefilled["amx"].use_amx:
            assert lay.isa == "amx" and not lay.strided
        else:  # HAWK_CPU_AMX=off, or AMX absent/unusable: the x86 vector kernel
            assert lay.isa == "vec" and lay.strided


@pytest.mark.vllm
@pytest.mark.inprocess_engine
def test_engine_kv_cache_matches_transformers(prefilled, hf_kv):
    ids = torch.tensor(prefilled["block_ids"])
    T = PROMPT_LEN
    layers = list(prefilled["layers"].values())
    assert len(layers) == len(hf_kv) == 4
    for layer, (ref_k, ref_v) in zip(layers, hf_kv, strict=False):
        lay = source_layout_from_layer(layer)
        k, v = lay.read_blocks(layer.kv_cache, ids)
        K, V = _tokens(k), _tokens(v)
        tol_k, tol_v = 0.03 * ref_k.abs().max(), 0.03 * ref_v.abs().max()  # bf16 vs fp32
        assert (K[:, :T] - ref_k).abs().max() <= tol_k
        assert (V[:, :T] - ref_v).abs().max() <= tol_v
        assert K[:, T:].abs().max() == 0 and V[:, T:].abs().max() == 0  # unwritten slots
        # What the transform reads (zero-copy views for vec, a gather for amx) is the same.
        (views,), sel = TransformSource([lay], [layer.kv_cache]).select(prefilled["block_ids"])
        assert torch.equal(views[0][sel], k) and torch.equal(views[1][sel], v)
        # Reading K as row-major [N, D] (ignoring the vec transpose / amx packing) must NOT match.
        slabs = layer.kv_cache[ids].reshape(len(ids), lay.num_kv_heads, 2, N, D)
        wrong_k = _tokens(slabs[:, :, 0])
        assert (wrong_k[:, :T] - ref_k).abs().max() > 10 * tol_k


@pytest.mark.parametrize("case", ["vec", "vec16"] + sorted(KV_CACHE_LAYOUTS))
def test_kv_views_equal_read_blocks_without_copying(case):
    """kv_views (the transform's zero-copy input) sees what read_blocks returns."""
    if case in ("vec", "vec16"):
        lay, cache = CpuAttnKVLayout(H, N, D, isa=case), make_layer_caches(1, 6, H, N, 2 * D, layout="LBHNC")[0]
    else:
        lay, cache = FlashAttnKVLayout(H, N, D), make_layer_caches(2, 6, H, N, 2 * D, layout=case)[1]
    ids = torch.tensor([4, 1, 5])
    lay.write_blocks(cache, ids, *_rand_kv(3))
    k_all, v_all = lay.kv_views(cache)
    assert k_all.data_ptr() >= cache.data_ptr()
    assert k_all.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    k, v = lay.read_blocks(cache, ids)
    assert torch.equal(k_all[ids], k) and torch.equal(v_all[ids], v)


def test_kv_views_refuses_amx():
    with pytest.raises(NotImplementedError, match="isa='amx'.*TransformSource"):
        CpuAttnKVLayout(H, N, D, isa="amx").kv_views(make_layer_caches(1, 2, H, N, 2 * D, layout="LBHNC")[0])


@pytest.mark.parametrize("dst_dtype", ["bfloat16", "bfloat8_b"])
def test_transform_of_amx_source_equals_vec_source(dst_dtype):
    """The same logical K/V stored as vLLM's amx and vec layouts give byte-identical G'
    (amx: TransformSource gathers the request's blocks; vec: zero-copy views)."""
    from vllm_hawk.layout.device_profiles import load_profile
    from vllm_hawk.layout.formats import tile_format
    from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout, TTKVCacheSpec
    from vllm_hawk.transform import make_plan, transform_kv

    layers, blocks, block = 2, 9, 64
    src_ids = [7, 2, 5, 3]
    sources = {}
    for isa in ("amx", "vec"):
        lay = CpuAttnKVLayout(H, block, D, isa=isa)
        caches = make_layer_caches(layers, blocks, H, block, 2 * D, layout="LBHNC")
        sources[isa] = (lay, caches, TransformSource([lay] * layers, caches))
    for li in range(layers):
        k, v = _rand_kv(blocks, block=block, seed=10 + li)
        for lay, caches, _ in sources.values():
            lay.write_blocks(caches[li], torch.arange(blocks), k, v)
    assert not sources["amx"][2].zero_copy and sources["vec"][2].zero_copy
    assert not torch.equal(sources["amx"][1][0], sources["vec"][1][0])  # different bytes
    prof = load_profile("p150a")
    tb = tile_format(dst_dtype).tile_nbytes
    spec = TTKVCacheSpec(num_layers=layers, num_blocks=8, num_kv_heads=H, block_size=block, head_dim=D, dtype=dst_dtype)
    layout = TTKVCacheLayout(spec, prof.num_banks, prof.aligned_page(tb), ((0, 0),) * layers)
    plan = make_plan(layout, [1, 4, 6, 0], "staged")
    out = {}
    for isa, (_, _, src) in sources.items():
        views, ids = src.select(src_ids)
        out[isa] = transform_kv(views, ids, block, plan)
        if isa == "amx":
            assert ids.tolist() == [0, 1, 2, 3] and views[0][0].shape == (4, H, block, D)
    assert torch.equal(out["amx"], out["vec"])
