"""A vLLM-layout paged KV cache held in torch, for tests and benchmarks (the engine's own
cache takes its place when vLLM runs): the prefill's cache, and the decode's cache in
the GPU-to-GPU baselines.

Per layer a FlashAttention cache ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``
(channels ``[:D]`` K, ``[D:]`` V), all layers views of ONE buffer in vLLM's default
``LBNHC`` ("NHD") order, via :mod:`vllm_hawk.layout.vllm_kv`. So block ``b`` of layer
``l`` is one contiguous byte range ``l * layer_nbytes + b * block_nbytes`` of
``block_nbytes`` bytes, and consecutive blocks are adjacent: a run of blocks moves as
one transfer entry per layer. ``backend="CPU_ATTN"`` (with its kernel ``isa``) gives
vLLM's CPU cache instead, and ``kv_layout="LBHNC"`` FlashAttention's HND order: the same
one run per block, in those layouts.
"""

from __future__ import annotations

import torch

from vllm_hawk.kvflow.sources import vllm_layout_desc
from vllm_hawk.kvflow.streams import KVRegionMap, LayerRegion
from vllm_hawk.layout.vllm_kv import make_layer_caches, source_layout_for
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
        *,
        backend: str = "FLASH_ATTN",
        kv_layout: str | None = None,
        isa: str | None = None,
    ) -> None:
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.num_kv_heads, self.block_size, self.head_dim, self.dtype = num_kv_heads, block_size, head_dim, dtype
        self.kv_layout = kv_layout or ("LBHNC" if backend == "CPU_ATTN" else "LBNHC")
        if self.kv_layout not in ("LBNHC", "LBHNC"):
            raise ValueError(f"PagedKVCache keeps each block one run: kv_layout LBNHC or LBHNC, not {kv_layout!r}")
        self.adapter = source_layout_for(
            backend,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            head_dim=head_dim,
            dtype=dtype,
            **({"isa": isa} if backend == "CPU_ATTN" else {}),
        )
        self.name = (
            LAYOUT_NAME
            if (backend, self.kv_layout) == ("FLASH_ATTN", "LBNHC")
            else f"vllm-{backend}-{isa or self.kv_layout}"
        )
        self.layers = make_layer_caches(
            num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype, layout=self.kv_layout
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
        """Per layer (K, V) logical views [num_blocks, num_kv_heads, block_size, head_dim] (no copy;
        not for CPU_ATTN's packed amx layout: :meth:`tokens`)."""
        return [self.adapter.kv_views(c) for c in self.layers]

    def tokens(self, layer: int, kv: int, block_ids) -> torch.Tensor:
        """K (``kv`` 0) or V (1) of ``block_ids`` of ``layer``, tokens in order: ``[H, n * block_size, D]``."""
        x = self.adapter.read_blocks(self.layers[layer], torch.as_tensor(list(block_ids)))[kv]
        return x.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)

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
            self.name,
            str(self.dtype).removeprefix("torch."),
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )
