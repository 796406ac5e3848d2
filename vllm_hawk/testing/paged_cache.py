"""A vLLM-layout paged KV cache held in torch, for tests and benchmarks (the engine's own
cache takes its place when vLLM runs): the prefill's cache, and the decode's cache in
the GPU-to-GPU baselines.

Per layer a FlashAttention cache ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``
(channels ``[:D]`` K, ``[D:]`` V), all layers views of ONE buffer in vLLM's default
``LBNHC`` ("NHD") order, via :mod:`vllm_hawk.layout.vllm_kv`. So block ``b`` of layer
``l`` is one contiguous byte range ``l * layer_nbytes + b * block_nbytes`` of
``block_nbytes`` bytes, and consecutive blocks are adjacent: a run of blocks moves as
one transfer entry per layer.
"""

from __future__ import annotations

import torch

from vllm_hawk.kvflow.sources import vllm_layout_desc
from vllm_hawk.kvflow.streams import KVRegionMap, LayerRegion
from vllm_hawk.layout.vllm_kv import FlashAttnKVLayout, make_layer_caches
from vllm_hawk.protocol import LayoutDesc

__all__ = ["LAYOUT_NAME", "PagedKVCache"]

LAYOUT_NAME = "vllm-flash-nhd"


class PagedKVCache:
    """num_layers x [num_blocks, num_kv_heads, block_size, 2*head_dim] in one buffer (bytes below)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.num_kv_heads, self.block_size, self.head_dim, self.dtype = num_kv_heads, block_size, head_dim, dtype
        self.adapter = FlashAttnKVLayout(
            num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim, dtype=dtype
        )
        self.layers = make_layer_caches(
            num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype, layout="LBNHC"
        )
        storage = self.layers[0].untyped_storage()
        self.base_addr = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self.block_nbytes = self.adapter.block_nbytes  # K+V of one block of one layer
        self.layer_nbytes = num_blocks * self.block_nbytes
        assert self.layer_nbytes * num_layers == self.nbytes
        assert self.layers[0].data_ptr() == self.base_addr
        assert self.layers[-1].data_ptr() == self.base_addr + (num_layers - 1) * self.layer_nbytes

    @property
    def flat(self) -> torch.Tensor:
        """The whole buffer as uint8 [nbytes] (no copy)."""
        return torch.empty(0, dtype=torch.uint8).set_(self.layers[0].untyped_storage()).view(-1)

    def fill_random(self, seed: int, chunk_elems: int = 1 << 24) -> PagedKVCache:
        """Deterministic N(0, 1) values (the same for the same seed and shapes)."""
        g = torch.Generator().manual_seed(seed)
        flat = self.flat.view(self.dtype)
        for s in range(0, flat.numel(), chunk_elems):
            n = min(chunk_elems, flat.numel() - s)
            flat[s : s + n] = torch.randn(n, generator=g).to(self.dtype)
        return self

    def kv_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) logical views [num_blocks, num_kv_heads, block_size, head_dim] (no copy)."""
        d = self.head_dim
        return [(c[..., :d], c[..., d:]) for c in self.layers]

    def block_offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) from ``base_addr``."""
        return layer * self.layer_nbytes + block * self.block_nbytes

    @property
    def region_map(self) -> KVRegionMap:
        """Per layer: block 0's address, the block stride, one run of ``block_nbytes``."""
        bn = self.block_nbytes
        return KVRegionMap(
            tuple(LayerRegion(self.base_addr + i * self.layer_nbytes, bn, ((0, bn),)) for i in range(self.num_layers)),
            self.num_blocks,
        )

    @property
    def storages(self) -> list[tuple[int, int]]:
        """The one buffer holding every layer: ``[(addr, nbytes)]``."""
        return [(self.base_addr, self.nbytes)]

    @property
    def desc(self) -> LayoutDesc:
        return vllm_layout_desc(
            self.region_map,
            LAYOUT_NAME,
            str(self.dtype).removeprefix("torch."),
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )
