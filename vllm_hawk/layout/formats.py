"""Tenstorrent tile data formats: byte-exact packing of 32x32 tiles.

Per tile (1024 elements, face order, see :mod:`vllm_hawk.layout.tiles`):

* ``float32``   4096 B: little-endian IEEE floats.
* ``bfloat16``  2048 B: float32 -> bf16 with round-to-nearest-even (subnormals rounded,
  not flushed; every NaN becomes 0x7FC0, as ttnn writes it).
* ``bfloat8_b`` 1088 B: 64 shared exponents (one per 16-value face row, faces 0..3 in
  order), then 1024 bytes ``sign << 7 | magnitude7``.
* ``bfloat4_b``  576 B: the same 64 exponents, then 512 bytes of ``sign << 3 |
  magnitude3`` nibbles, earlier element in the low nibble.

Block-float packing follows ttnn 0.81.1's host packer (measured byte for byte, see
tests/test_ttnn_crosscheck.py): the shared exponent is the largest raw 8-bit float32
exponent in the face row (inf/NaN count as 255); each normal value's 24-bit mantissa
(hidden bit added) is shifted right by (shared - own exponent) with truncation, then
rounded to 7 (or 3) bits to nearest, ties to even, and saturated at the largest code
(no exponent bump); zeros and subnormals become code 0, and a zero magnitude gets sign 0.
Values are packed from float32, not via bf16. Decoding assembles bits: a magnitude m > 0
is normalised with exponent ``shared - shift``; an exponent below 0 decodes to +0.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hawk.layout.tiles import FACE, FACE_ROWS_PER_TILE, TILE_ELEMS, tilize, untilize


@dataclass(frozen=True)
class TileFormat:
    """A tile data format: its name as ttnn spells it and its bytes per 32x32 tile."""

    name: str
    tile_nbytes: int
    mantissa_bits: int = 0  # block-float magnitude bits (7 or 3); 0 for plain floats

    @property
    def is_block_float(self) -> bool:
        return self.mantissa_bits > 0


FORMATS: dict[str, TileFormat] = {
    "float32": TileFormat("float32", 4096),
    "bfloat16": TileFormat("bfloat16", 2048),
    "bfloat8_b": TileFormat("bfloat8_b", 1088, 7),
    "bfloat4_b": TileFormat("bfloat4_b", 576, 3),
}
BFP_EXP_NBYTES = FACE_ROWS_PER_TILE  # 64 shared-exponent bytes per block-float tile


def tile_format(name: str) -> TileFormat:
    """Look up a format by name; the error lists the valid names."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tile dtype {name!r}; expected one of {sorted(FORMATS)}") from None


def pack_tiles(tiles: torch.Tensor, dtype: str) -> torch.Tensor:
    """Face-ordered tiles ``[n, 1024]`` (any float dtype) -> bytes ``uint8 [n, tile_nbytes]``."""
    fmt = tile_format(dtype)
    if tiles.shape[-1] != TILE_ELEMS:
        raise ValueError(f"pack_tiles expects [n, {TILE_ELEMS}] tiles, got {tuple(tiles.shape)}")
    if fmt.name == "bfloat16":
        half = tiles.to(torch.bfloat16).contiguous().view(torch.int16)
        half = torch.where(torch.isnan(tiles), torch.full_like(half, 0x7FC0), half)  # ttnn: one quiet NaN
        return half.view(torch.uint8)
    if fmt.name == "float32":
        return tiles.to(torch.float32).contiguous().view(torch.uint8)
    return _pack_bfp(tiles.to(torch.float32), fmt.mantissa_bits)


def unpack_tiles(data: torch.Tensor, dtype: str) -> torch.Tensor:
    """Bytes ``uint8 [n, tile_nbytes]`` -> float32 tiles ``[n, 1024]`` (face order)."""
    fmt = tile_format(dtype)
    data = data.reshape(-1, fmt.tile_nbytes)
    if fmt.name == "bfloat16":
        return data.contiguous().view(torch.bfloat16).to(torch.float32)
    if fmt.name == "float32":
        return data.contiguous().view(torch.float32).clone()
    return _unpack_bfp(data, fmt.mantissa_bits)


def tilize_pack(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """``x`` [..., H, W] -> the bytes ttnn's host tilizer makes: ``uint8 [num_tiles, tile_nbytes]``."""
    return pack_tiles(tilize(x), dtype)


def unpack_untilize(data: torch.Tensor, dtype: str, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of :func:`tilize_pack`: bytes -> float32 tensor of ``shape`` [..., H, W]."""
    return untilize(unpack_tiles(data, dtype), shape)


def _pack_bfp(tiles: torch.Tensor, mbits: int) -> torch.Tensor:
    n = tiles.shape[0]
    bits = tiles.contiguous().view(torch.int32).reshape(n, FACE_ROWS_PER_TILE, FACE)
    exp = (bits >> 23) & 0xFF
    sign = (bits >> 31) & 1
    shared = exp.amax(dim=-1, keepdim=True)  # [n, 64, 1] raw float32 exponents
    man = (bits & 0x7FFFFF) | 0x800000
    man = man >> (shared - exp).clamp(max=31)  # align to the shared exponent, truncating
    shift = 24 - mbits
    round_value = man & ((1 << shift) - 1)
    q = man >> shift
    tie = 1 << (shift - 1)
    q = q + ((round_value > tie) | ((round_value == tie) & ((q & 1) == 1))).to(q.dtype)
    q = q.clamp(max=(1 << mbits) - 1)
    q = torch.where(exp == 0, torch.zeros_like(q), q)  # +-0.0 and subnormals -> 0
    sign = torch.where(q == 0, torch.zeros_like(sign), sign)
    byte = ((sign << mbits) | q).to(torch.uint8).reshape(n, TILE_ELEMS)
    if mbits == 3:
        pair = byte.reshape(n, TILE_ELEMS // 2, 2)
        byte = pair[..., 0] | (pair[..., 1] << 4)
    return torch.cat([shared.reshape(n, FACE_ROWS_PER_TILE).to(torch.uint8), byte], dim=1)


def _unpack_bfp(data: torch.Tensor, mbits: int) -> torch.Tensor:
    n = data.shape[0]
    shared = data[:, :BFP_EXP_NBYTES].to(torch.int64).reshape(n, FACE_ROWS_PER_TILE, 1)
    body = data[:, BFP_EXP_NBYTES:].to(torch.int64)
    if mbits == 3:
        body = torch.stack([body & 0xF, body >> 4], dim=-1)
    body = body.reshape(n, FACE_ROWS_PER_TILE, FACE)
    mask = (1 << mbits) - 1
    man = body & mask
    sign = body >> mbits
    # Normalise: shift until the top magnitude bit is set, dropping it as the hidden bit.
    top = torch.floor(torch.log2(man.clamp(min=1).to(torch.float32))).to(torch.int64)
    shift_cnt = (mbits - 1) - top
    frac = (man << (shift_cnt + 1)) & mask
    exp = shared - shift_cnt
    word = (sign << 31) | (exp.clamp(min=0) << 23) | (frac << (23 - mbits))
    word = torch.where(exp < 0, torch.zeros_like(word), word)  # exponent underflow -> +0.0
    word = torch.where(man == 0, sign << 31, word)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.view(torch.float32).reshape(n, TILE_ELEMS)
