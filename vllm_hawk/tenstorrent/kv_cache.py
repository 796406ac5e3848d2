"""What a Tenstorrent engine's KV cache offers the connector: one protocol per chip, one per mesh.

Both engine integrations implement them: the emulated platform's
:class:`~vllm_hawk.tenstorrent.emulated.mesh.TTMeshKVCache` (chips:
:class:`~vllm_hawk.tenstorrent.emulated.kv_cache.TTPagedKVCache`) and the vllm-tt-plugin
worker's :class:`~vllm_hawk.tenstorrent.vllm_tt.kv_cache.TTNNMeshKVCache` (chips:
:class:`~vllm_hawk.tenstorrent.vllm_tt.kv_cache.TTNNChipKVCache`). The connector reaches the
running engine's cache through :mod:`vllm_hawk.tenstorrent.registry` and reads only these
members.

Units: heads for head ranges; bytes (uint8 arrays) for block reads; block ids are vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from vllm_hawk.layout.tp import HeadShard
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.npu.bank_buffer import BankBufferAPI, DeviceBuffer

__all__ = ["ChipKVCache", "MeshKVCache"]


@runtime_checkable
class ChipKVCache(Protocol):
    """One chip's part of the paged KV cache: K and V per layer in that chip's DRAM banks.

    ``spec``: the chip's cache (``num_kv_heads`` = the heads it holds); ``layout``: where each
    tile lies; ``buffers``: the device buffers K0, V0, K1, V1, ...; ``device``: the chip, a
    bank-buffer backend."""

    device: BankBufferAPI
    spec: TTKVCacheSpec
    layout: TTKVCacheLayout
    buffers: list[DeviceBuffer]
    num_banks: int  # DRAM banks the cache's buffers are interleaved over
    layer_names: list[str]  # vLLM layer names, in layer-index order

    def buffer(self, layer: int, kv: int) -> DeviceBuffer:
        """The buffer of layer ``layer``'s K (``kv`` 0) or V (1)."""

    def read_block_bytes(self, layer: int, kv: int, blocks) -> Any:
        """Bytes of whole blocks in tile order: uint8 ``[tiles, tile_nbytes]`` (numpy or torch)."""

    def close(self) -> None:
        """Release the cache's buffers (or forget them, when the model owns them)."""


@runtime_checkable
class MeshKVCache(Protocol):
    """The model's paged KV cache over the chips of a mesh, KV heads sharded by chip.

    ``spec``: the model's cache (all KV heads); ``chips[c]``: chip ``c``'s
    :class:`ChipKVCache`; a one-chip mesh is the single-chip cache."""

    spec: TTKVCacheSpec
    chips: Sequence[ChipKVCache]
    num_chips: int
    num_kv_heads: int  # KV heads of the model (all chips together)
    layer_names: list[str]

    def heads_of(self, chip: int) -> HeadShard:
        """Global KV heads ``[start, stop)`` chip ``chip`` holds."""

    def read_block_bytes(self, layer: int, kv: int, blocks) -> Any:
        """Bytes of whole blocks, all heads, as one chip holding them all would have them."""

    def nonzero_blocks(self) -> list[int]:
        """Blocks holding a non-zero byte in any layer's K or V, on any chip."""

    def close(self) -> None: ...
