"""Tile order and block-float packing, against an independent scalar reference of
tt-metal's host packer (the byte-for-byte check against ttnn itself is
tests/test_ttnn_crosscheck.py)."""

import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_hawk.layout.formats import FORMATS, pack_tiles, tilize_pack, unpack_tiles, unpack_untilize
from vllm_hawk.layout.tiles import num_tiles, tilize, untilize


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def ref_bfp_byte(v: float, shared: int, mbits: int) -> int:
    """One value, written from the algorithm's description, one bit at a time."""
    bits = f32_bits(v)
    if bits & 0x7F800000 == 0:  # zeros and subnormals flush to code 0
        return 0
    exp, sign = (bits >> 23) & 0xFF, bits >> 31
    man = (bits & 0x7FFFFF) | (1 << 23)
    man >>= min(shared - exp, 31)
    shift = 24 - mbits
    rest, q = man & ((1 << shift) - 1), man >> shift
    half = 1 << (shift - 1)
    if rest > half or (rest == half and q & 1):
        q += 1
    q = min(q, (1 << mbits) - 1)
    return (sign if q else 0) << mbits | q


def ref_pack_tile(tile_face_order: np.ndarray, dtype: str) -> bytes:
    mbits = FORMATS[dtype].mantissa_bits
    rows = tile_face_order.reshape(64, 16)
    exps = [max((f32_bits(float(v)) >> 23) & 0xFF for v in row) for row in rows]
    body = [ref_bfp_byte(float(v), exps[i // 16], mbits) for i, v in enumerate(tile_face_order)]
    if mbits == 3:
        body = [body[i] | body[i + 1] << 4 for i in range(0, 1024, 2)]
    return bytes(exps) + bytes(body)


def test_tile_element_position():
    x = torch.arange(32 * 32, dtype=torch.float32).reshape(32, 32)
    t = tilize(x)[0]
    for r, c in [(0, 0), (0, 17), (5, 15), (16, 0), (20, 31), (31, 31)]:
        f = (r // 16) * 2 + c // 16
        assert t[f * 256 + (r % 16) * 16 + c % 16] == x[r, c]


def test_tiles_row_major_with_leading_dims_and_padding():
    x = torch.randn(2, 3, 40, 70)
    assert num_tiles(x.shape) == 2 * 3 * 2 * 3
    t = tilize(x).reshape(2, 3, 2, 3, 1024)
    assert torch.equal(t[1, 2, 1, 2][:8], torch.cat([x[1, 2, 32, 64:70], torch.zeros(2)]))
    assert torch.equal(untilize(tilize(x), x.shape), x)


@pytest.mark.parametrize(
    "dtype,nbytes", [("float32", 4096), ("bfloat16", 2048), ("bfloat8_b", 1088), ("bfloat4_b", 576)]
)
def test_tile_sizes(dtype, nbytes):
    assert tilize_pack(torch.randn(64, 64), dtype).shape == (4, nbytes)


def test_bf16_round_to_nearest_even():
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: RNE keeps the even mantissa (1.0).
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8], dtype=torch.float32)
    tiles = torch.zeros(1, 1024)
    tiles[0, :2] = x
    got = unpack_tiles(pack_tiles(tiles, "bfloat16"), "bfloat16")[0, :2]
    assert got.tolist() == [1.0, 1 + 4 * 2**-8]


@pytest.mark.parametrize("dtype", ["bfloat8_b", "bfloat4_b"])
def test_bfp_hand_cases(dtype):
    mbits = FORMATS[dtype].mantissa_bits
    tile = np.zeros(1024, dtype=np.float32)
    tile[:16] = [1.0, -1.0, 0.5, 0.0, -0.0, 2.0**-30, 1.5, 0.75, 3.0, -3.0, 1e-40, 2.0, 2.0, 2.0, 2.0, 2.0]
    got = pack_tiles(torch.from_numpy(tile)[None], dtype)[0].numpy()
    assert got[0] == 128  # shared exponent of row 0 = exponent of 3.0 (2^1 -> 128)
    assert bytes(got) == ref_pack_tile(tile, dtype)
    if mbits == 7:
        assert got[64] == 0x20 and got[65] == 0xA0  # 1.0 = 0.0100000 x 2^1 ; -1.0 sign bit
        assert got[64 + 3] == 0 and got[64 + 4] == 0  # +0 and -0 -> 0 (no sign on zero)


finite = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(
    st.lists(finite, min_size=16, max_size=16),
    st.integers(0, 63),
    st.integers(0, 2**31),
    st.sampled_from(["bfloat8_b", "bfloat4_b"]),
)
def test_bfp_matches_scalar_reference(row, row_index, seed, dtype):
    """One hypothesis-chosen face row (edge values) inside a tile of random values."""
    tile = np.random.default_rng(seed).standard_normal(1024).astype(np.float32)
    tile[row_index * 16 : (row_index + 1) * 16] = row
    assert bytes(pack_tiles(torch.from_numpy(tile)[None], dtype)[0].numpy()) == ref_pack_tile(tile, dtype)


@given(st.integers(0, 2**31), st.sampled_from(["bfloat8_b", "bfloat4_b"]))
def test_bfp_unpack_is_a_left_inverse_on_packed_values(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    packed = tilize_pack(x, dtype)
    again = tilize_pack(unpack_untilize(packed, dtype, x.shape), dtype)
    assert torch.equal(packed, again)


def test_unknown_dtype_names_choices():
    with pytest.raises(ValueError, match="bfloat8_b"):
        tilize_pack(torch.zeros(32, 32), "int8")
