"""The Tenstorrent paged KV cache layout (tt-metal ``tt_transformers`` / the Tenstorrent
vLLM plugin).

Per layer there are two tensors, K and V, each ``[num_blocks, num_kv_heads, block_size,
head_dim]`` in TILE layout, interleaved over the DRAM banks with one tile per page. vLLM
block ids index dim 0. Tile index of (block, head, token, dim)::

    ((block * H + head) * (block_size / 32) + token // 32) * (head_dim / 32) + dim // 32

and page (= tile) ``t`` lives in bank ``t % num_banks`` at byte ``address + (t //
num_banks) * aligned_page`` of that bank. Units: bytes unless said otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Tile geometry, restated here so this module needs only numpy: the ttnn device adapter imports it
# in the Python 3.12 side environment, which has no torch. tests/layout/test_tt_kv_cache.py
# checks these equal vllm_hawk.layout.tiles / formats.
TILE = 32  # tile edge (elements)
FACE = 16  # face edge (elements)
BFP_EXP_NBYTES = 64  # shared-exponent bytes at the head of a block-float tile
TILE_NBYTES = {"bfloat16": 2048, "bfloat8_b": 1088, "bfloat4_b": 576}  # bytes per 32x32 tile

KV_DTYPES = ("bfloat16", "bfloat8_b", "bfloat4_b")
K, V = 0, 1


@dataclass(frozen=True)
class TTKVCacheSpec:
    """Shapes of a Tenstorrent paged KV cache (one device, after tensor parallelism)."""

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int  # tokens per block, multiple of 32
    head_dim: int  # multiple of 32
    dtype: str = "bfloat8_b"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "num_kv_heads", "block_size", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"TTKVCacheSpec.{field} must be positive, got {getattr(self, field)}")
        if self.block_size % TILE or self.head_dim % TILE:
            raise ValueError(
                f"TTKVCacheSpec: block_size ({self.block_size}) and head_dim "
                f"({self.head_dim}) must be multiples of {TILE}"
            )
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"TTKVCacheSpec.dtype must be one of {KV_DTYPES}, got {self.dtype!r}")

    @property
    def tile_nbytes(self) -> int:
        return TILE_NBYTES[self.dtype]

    @property
    def tiles_per_block(self) -> int:
        """Tiles of one (block) across all heads: H * (block_size/32) * (head_dim/32)."""
        return self.num_kv_heads * (self.block_size // TILE) * (self.head_dim // TILE)

    @property
    def tiles_per_tensor(self) -> int:
        return self.num_blocks * self.tiles_per_block

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def tile_index(self, block, head, token, dim):
        """Tile index (page) of element (block, head, token, dim); works on ints or arrays."""
        return ((block * self.num_kv_heads + head) * (self.block_size // TILE) + token // TILE) * (
            self.head_dim // TILE
        ) + dim // TILE

    def element_byte_in_tile(self, token, dim):
        """Byte offset inside its tile of the data byte holding element (token, dim).

        bfloat4_b packs two elements per byte (even position in the low nibble)."""
        r, c = token % TILE, dim % TILE
        pos = ((r // FACE) * 2 + c // FACE) * FACE * FACE + (r % FACE) * FACE + c % FACE
        if self.dtype == "bfloat16":
            return 2 * pos
        if self.dtype == "bfloat8_b":
            return BFP_EXP_NBYTES + pos
        return BFP_EXP_NBYTES + pos // 2


@dataclass(frozen=True)
class TTKVCacheLayout:
    """A KV cache placed on a device: the spec plus each tensor's lockstep address.

    addresses[layer] = (K address, V address), byte offsets valid in every bank."""

    spec: TTKVCacheSpec
    num_banks: int
    aligned_page: int
    addresses: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if len(self.addresses) != self.spec.num_layers:
            raise ValueError(f"TTKVCacheLayout: {len(self.addresses)} address pairs for {self.spec.num_layers} layers")

    @property
    def size_per_bank(self) -> int:
        """Bytes one tensor (one layer's K or V) occupies in each bank."""
        return -(-self.spec.tiles_per_tensor // self.num_banks) * self.aligned_page

    def tile_location(self, layer: int, kv: int, tile):
        """(bank, byte offset in bank) of a tile of tensor (layer, K=0|V=1); ints or arrays."""
        base = self.addresses[layer][kv]
        return tile % self.num_banks, base + (tile // self.num_banks) * self.aligned_page

    def locate(self, layer: int, kv: int, block, head, token, dim):
        """(bank, byte offset in bank) of the data byte of one KV element."""
        s = self.spec
        bank, off = self.tile_location(layer, kv, s.tile_index(block, head, token, dim))
        return bank, off + s.element_byte_in_tile(token, dim)

    def block_tiles(self, blocks) -> np.ndarray:
        """Tile indices of whole blocks, block-major: int64 [len(blocks) * tiles_per_block]."""
        tpb = self.spec.tiles_per_block
        b = np.asarray(blocks, dtype=np.int64)
        return (b[:, None] * tpb + np.arange(tpb, dtype=np.int64)[None, :]).reshape(-1)
