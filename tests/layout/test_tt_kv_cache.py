"""The Tenstorrent paged KV cache: shapes, tile index and element addresses."""

import numpy as np
import pytest
import torch

from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice


def test_worked_case_blackhole_bfp8_block64_dim128():
    """docs/tenstorrent-layout.md, worked case: each (block, head) is 8 tiles, one per bank."""
    spec = TTKVCacheSpec(1, 4, 2, 64, 128, "bfloat8_b")
    assert spec.tiles_per_block == 2 * 8 and spec.tile_nbytes == 1088
    tiles = spec.tile_index(3, 1, np.arange(64)[:, None], np.arange(128)[None, :])
    assert sorted(np.unique(tiles % 8)) == list(range(8)) and np.unique(tiles).size == 8


def test_spec_validation():
    with pytest.raises(ValueError, match="multiples of 32"):
        TTKVCacheSpec(1, 4, 2, 48, 128)
    with pytest.raises(ValueError, match="dtype"):
        TTKVCacheSpec(1, 4, 2, 64, 128, "float16")


@pytest.mark.parametrize("profile,dtype", [("p150a", "bfloat16"), ("n150", "bfloat8_b"), ("p100", "bfloat4_b")])
def test_locate_finds_the_element_written_through_pages(profile, dtype):
    dev = EmulatedDevice(profile, 8 << 20)
    spec = TTKVCacheSpec(2, 5, 3, 64, 64, dtype)
    layout, bufs = dev.allocate_kv_cache(spec)
    x = torch.randn(spec.tensor_shape)
    pages = tilize_pack(x, dtype)  # one tile per page, tile index = page index
    for p in range(pages.shape[0]):
        dev.write_page(bufs[3], p, pages[p].numpy())  # layer 1, V
    rng = np.random.default_rng(0)
    for _ in range(50):
        b, h, t, d = (int(rng.integers(s)) for s in spec.tensor_shape)
        bank, off = layout.locate(1, 1, b, h, t, d)
        tile = spec.tile_index(b, h, t, d)
        assert dev.banks[bank][off] == pages[tile, spec.element_byte_in_tile(t, d)]
        if dtype == "bfloat16":
            got = torch.from_numpy(dev.banks[bank][off : off + 2].copy()).view(torch.bfloat16)
            assert got.item() == x[b, h, t, d].to(torch.bfloat16).item()
    for b in bufs:
        dev.free_buffer(b)
    assert dev.allocator.used_bytes() == 0


def test_tile_constants_match_formats():
    """tt_kv_cache restates tile geometry to stay torch-free (the ttnn side env has no torch)."""
    from vllm_hawk.layout import formats, tiles
    from vllm_hawk.layout import tt_kv_cache as m

    assert (m.TILE, m.FACE, m.BFP_EXP_NBYTES) == (tiles.TILE, tiles.FACE, formats.BFP_EXP_NBYTES)
    assert {d: formats.tile_format(d).tile_nbytes for d in m.KV_DTYPES} == m.TILE_NBYTES
