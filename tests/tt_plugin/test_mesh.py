"""The KV cache sharded over the chips of a mesh (tenstorrent.emulated.mesh), without vLLM."""

from __future__ import annotations

import pytest
import torch

from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tp import HeadShard, TPMismatch
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.tenstorrent.emulated.config import TTPluginConfig, TTPluginConfigError
from vllm_hawk.tenstorrent.emulated.kv_cache import TTPagedKVCache, paged_attention
from vllm_hawk.tenstorrent.emulated.mesh import TTMeshKVCache

BS, D = 32, 64


def _spec(heads: int, dtype: str, blocks: int = 10) -> TTKVCacheSpec:
    return TTKVCacheSpec(2, blocks, heads, BS, D, dtype)


def _devices(profile: str, n: int) -> list[EmulatedDevice]:
    return [EmulatedDevice(profile, bank_size_bytes=4 << 20) for _ in range(n)]


def _fill(caches, heads: int, blocks: list[int], n_tok: int, seed: int = 0):
    """Write the same random K/V (all heads) into every cache; returns dense K, V
    float32 [len(blocks), heads, BS, D] (zeros at unwritten positions)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_tok, heads, D, generator=g).bfloat16().float()
    v = torch.randn(n_tok, heads, D, generator=g).bfloat16().float()
    pos = torch.arange(n_tok)
    slots = torch.tensor(blocks)[pos // BS] * BS + pos % BS
    for c in caches:
        c.write_tokens("l1", k, v, slots)
    dense = []
    for x in (k, v):
        d = torch.zeros(len(blocks) * BS, heads, D)
        d[:n_tok] = x
        dense.append(d.reshape(len(blocks), BS, heads, D).transpose(1, 2).contiguous())
    return dense


@pytest.mark.parametrize(
    "profile,n,dtype", [("n300", 2, "bfloat16"), ("p150a", 2, "bfloat8_b"), ("p150a", 4, "bfloat16")]
)
def test_each_chip_holds_its_heads_in_tile_layout(profile, n, dtype):
    heads, blocks = 4, [3, 7, 1]
    mesh = TTMeshKVCache(_devices(profile, n), _spec(heads, dtype), ["l0", "l1"])
    single = TTPagedKVCache(EmulatedDevice(profile, bank_size_bytes=4 << 20), _spec(heads, dtype), ["l0", "l1"])
    k, v = _fill([mesh, single], heads, blocks, 80)
    per = heads // n
    assert mesh.num_chips == n and mesh.num_kv_heads == heads and mesh.num_banks == load_profile(profile).num_banks
    for c, chip in enumerate(mesh.chips):
        assert mesh.heads_of(c) == HeadShard(c, c * per, per)
        assert chip.spec.num_kv_heads == per and chip.spec.tensor_shape == (10, per, BS, D)
        assert chip.device is not mesh.chips[c - 1].device or n == 1  # its own banks and allocator
        sl = slice(c * per, (c + 1) * per)
        assert torch.equal(chip.read_block_bytes("l1", 0, blocks), tilize_pack(k[:, sl], dtype))
        assert torch.equal(chip.read_block_bytes("l1", 1, blocks), tilize_pack(v[:, sl], dtype))
    # the global view is the single-chip cache's bytes and values
    for kv in (0, 1):
        assert torch.equal(mesh.read_block_bytes("l1", kv, blocks), single.read_block_bytes("l1", kv, blocks))
        assert torch.equal(mesh.read_blocks("l1", kv, blocks), single.read_blocks("l1", kv, blocks))
    mesh.close()
    assert all(chip.device.live_buffers() == [] for chip in mesh.chips)


def test_fewer_heads_than_chips_replicates():
    mesh = TTMeshKVCache(_devices("p150a", 4), _spec(2, "bfloat16"), ["l0", "l1"])
    assert [(s.start, s.count) for s in mesh.shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    k, _ = _fill([mesh], 2, [2], 30)
    b = [c.read_block_bytes("l1", 0, [2]) for c in mesh.chips]
    assert torch.equal(b[0], b[1]) and torch.equal(b[2], b[3]) and not torch.equal(b[0], b[2])
    assert torch.equal(mesh.read_block_bytes("l1", 0, [2]), tilize_pack(k, "bfloat16"))
    mesh.close()


def test_zero_and_copy_fan_out_to_every_chip():
    mesh = TTMeshKVCache(_devices("n300", 2), _spec(4, "bfloat16"), ["l0", "l1"])
    _fill([mesh], 4, [3, 5], 64)
    mesh.copy_blocks([(3, 8)])
    mesh.zero_blocks([5])
    for chip in mesh.chips:
        for kv in (0, 1):
            assert torch.equal(chip.read_block_bytes("l1", kv, [8]), chip.read_block_bytes("l1", kv, [3]))
            assert chip.read_block_bytes("l1", kv, [3]).count_nonzero() > 0
            assert chip.read_block_bytes("l1", kv, [5]).count_nonzero() == 0
    mesh.close()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_mesh_attention_equals_single_chip(n):
    """Each chip's query heads over its KV heads, gathered == the single-chip attention."""
    heads, hq = 4, 8
    mesh = TTMeshKVCache(_devices("p150a", n), _spec(heads, "bfloat16", blocks=12), ["l0", "l1"])
    single = TTPagedKVCache(
        EmulatedDevice("p150a", bank_size_bytes=4 << 20), _spec(heads, "bfloat16", 12), ["l0", "l1"]
    )
    _fill([mesh, single], heads, [5, 2, 9], 70)
    g = torch.Generator().manual_seed(1)
    table = torch.tensor([[5, 2, 9], [5, 2, 0]], dtype=torch.int32)
    starts, lens = torch.tensor([0, 70, 72]), torch.tensor([70, 40])  # a prefill and a chunk of 2
    q = torch.randn(72, hq, D, generator=g).bfloat16()
    want = paged_attention(single, 1, q, starts, lens, table, 0.125, torch.empty(72, hq, D, dtype=torch.bfloat16))
    got = mesh.paged_attention(1, q, starts, lens, table, 0.125, torch.empty(72, hq, D, dtype=torch.bfloat16))
    assert torch.equal(got, want)
    mesh.close()


def test_head_split_mismatch_names_the_variable():
    with pytest.raises(TPMismatch, match=r"HAWK_TT_CHIPS=3 does not divide the model's 4 KV heads"):
        TTMeshKVCache(_devices("p150a", 3), _spec(4, "bfloat16"))
    with pytest.raises(TPMismatch, match=r"HAWK_TT_CHIPS=6 is not a multiple of the model's 4 KV heads"):
        TTMeshKVCache(_devices("p150a", 6), _spec(4, "bfloat16"))


def test_one_chip_mesh_is_the_single_chip_cache():
    dev = _devices("p150a", 1)
    mesh = TTMeshKVCache(dev, _spec(4, "bfloat8_b"), ["l0", "l1"])
    chip = mesh.chips[0]
    assert mesh.device is dev[0] and mesh.layout is chip.layout and mesh.buffers is chip.buffers
    assert mesh.buffer("l1", 1) == chip.buffer("l1", 1) and chip.spec == mesh.spec
    two = TTMeshKVCache(_devices("p150a", 2), _spec(4, "bfloat8_b"))
    with pytest.raises(AttributeError, match=r"sharded over 2 chips; use .chips\[c\].device"):
        _ = two.device
    mesh.close()
    two.close()


def test_chip_count_config_and_per_chip_profile():
    n300, n150 = load_profile("n300"), load_profile("n150")
    assert n300.chips == 2 and n150.chips == 1
    # each n300 chip is organised like an n150: same banks, same size per bank
    assert (n300.num_banks, n300.bank_size_bytes, n300.usable_bank_bytes) == (
        n150.num_banks,
        n150.bank_size_bytes,
        n150.usable_bank_bytes,
    )
    cfg = TTPluginConfig.from_env({"HAWK_TT_PLATFORM": "emulated", "HAWK_TT_DEVICE": "n300"})
    assert cfg.chips is None and cfg.num_chips(n300.chips) == 2
    cfg = TTPluginConfig.from_env({"HAWK_TT_DEVICE": "p150a", "HAWK_TT_CHIPS": "4"})
    assert cfg.num_chips(load_profile("p150a").chips) == 4
    for bad in ("0", "two", "-2"):
        with pytest.raises(TTPluginConfigError, match="HAWK_TT_CHIPS"):
            TTPluginConfig.from_env({"HAWK_TT_CHIPS": bad})
