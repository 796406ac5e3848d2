"""The emulated device's paged KV cache and the attention that reads it, without vLLM: token
writes give the byte-exact packer's tiles and read back as its values, in every tile format."""

from __future__ import annotations

import pytest
import torch

from vllm_hawk.layout.formats import tilize_pack, unpack_untilize
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.tenstorrent.emulated.kv_cache import TTPagedKVCache, kv_budget_blocks, paged_attention


def _cache(profile: str, dtype: str, blocks: int = 10, heads: int = 4, bs: int = 64, dim: int = 64):
    dev = EmulatedDevice(profile, bank_size_bytes=8 << 20)
    return TTPagedKVCache(dev, TTKVCacheSpec(2, blocks, heads, bs, dim, dtype), ["l0", "l1"])


def _tokens(blocks: list[int], n: int, heads: int, bs: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(len(blocks) * bs, heads, dim, generator=g)
    flat[n:] = 0  # unwritten positions stay zero in the device
    x = flat.reshape(len(blocks), bs, heads, dim).transpose(1, 2).contiguous()
    pos = torch.arange(n)
    slots = torch.tensor(blocks)[pos // bs] * bs + pos % bs
    return x, flat[:n].clone(), slots


@pytest.mark.parametrize("profile", ["p150a", "n150"])
@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat8_b", "bfloat4_b"])
def test_token_writes_give_tilize_pack_bytes(profile, dtype):
    c = _cache(profile, dtype)
    blocks, n = [3, 7, 1], 150
    k, k_tok, slots = _tokens(blocks, n, 4, 64, 64, 0)
    v, v_tok, _ = _tokens(blocks, n, 4, 64, 64, 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    pad = torch.full((3,), -1)
    for part in (perm[:70], perm[70:]):  # out of order, two steps, with padding slots
        c.write_tokens(
            "l1",
            torch.cat([k_tok[part], k_tok[:3]]),
            torch.cat([v_tok[part], v_tok[:3]]),
            torch.cat([slots[part], pad]),
        )
    assert torch.equal(c.read_block_bytes("l1", 0, blocks), tilize_pack(k, dtype))
    assert torch.equal(c.read_block_bytes("l1", 1, blocks), tilize_pack(v, dtype))
    # the attention's read path gives the packer's values back (lossy formats: what they keep)
    assert torch.equal(c.read_blocks("l1", 0, blocks), unpack_untilize(tilize_pack(k, dtype), dtype, k.shape))
    assert c.read_block_bytes("l0", 0, blocks).count_nonzero() == 0  # other layer untouched
    c.copy_blocks([(3, 8)])  # 8 tiles per block: bank-crossing on n150
    assert torch.equal(c.read_block_bytes("l1", 1, [8]), c.read_block_bytes("l1", 1, [3]))
    c.zero_blocks([7])
    assert c.read_block_bytes("l1", 0, [7]).count_nonzero() == 0
    c.close()
    assert c.device.live_buffers() == []


def test_budget_counts_lockstep_rounding():
    # 12 banks, 8 tiles per block: 3 blocks = 24 tiles = 2 page rows; 4 blocks need 3 rows
    assert kv_budget_blocks(8, 1, 12, 2048, 2 * 2 * 2048) == 3
    assert kv_budget_blocks(8, 1, 8, 2048, 2 * 2 * 2048) == 2


def _reference_attention(q, k, v, scale):
    """q [nq, Hq, D] as the LAST nq of len(k) positions; k, v [len, H, D]."""
    hq, h = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // h, dim=1).transpose(0, 1)
    v = v.repeat_interleave(hq // h, dim=1).transpose(0, 1)
    s = q.transpose(0, 1) @ k.transpose(1, 2) * scale
    ln, nq = k.shape[1], q.shape[0]
    s.masked_fill_(torch.arange(ln)[None, :] > torch.arange(ln - nq, ln)[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)


def test_paged_attention_mixed_batch_matches_dense_reference():
    c = _cache("n150", "bfloat16", blocks=12, heads=2, bs=32, dim=32)
    g = torch.Generator().manual_seed(3)
    reqs = [([5, 2, 9], 70, 70), ([1], 20, 1), ([4, 11], 40, 6)]  # prefill, decode, chunk
    qs, refs, starts, lens, table = [], [], [0], [], torch.zeros(3, 3, dtype=torch.int32)
    for r, (blocks, ln, nq) in enumerate(reqs):
        k = torch.randn(ln, 2, 32, generator=g).bfloat16().float()
        v = torch.randn(ln, 2, 32, generator=g).bfloat16().float()
        pos = torch.arange(ln)
        c.write_tokens(0, k, v, torch.tensor(blocks)[pos // 32] * 32 + pos % 32)
        q = torch.randn(nq, 4, 32, generator=g)
        qs.append(q)
        refs.append(_reference_attention(q, k, v, 0.17))
        starts.append(starts[-1] + nq)
        lens.append(ln)
        table[r, : len(blocks)] = torch.tensor(blocks)
    out = torch.empty(starts[-1], 4, 32)
    paged_attention(c, 0, torch.cat(qs), torch.tensor(starts), torch.tensor(lens), table, 0.17, out)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)
