"""The paged KV cache a Tenstorrent model allocated, as HawkConnector's sink sees it.

vllm-tt-plugin's runner asks the model for its cache (``model.allocate_kv_cache(shape,
dtype, num_layers)``, tt_transformers' ``allocate_vllm_kv_cache``): ``kv_cache[submesh][layer]
= [K, V]`` ttnn tensors (one submesh), each ``[num_blocks, kv_heads per chip, block_size,
head_dim]``, TILE layout, DRAM interleaved. :class:`TTNNMeshKVCache` describes those tensors, per chip of
the mesh, by the addresses ttnn gives them (no copy, no allocation of its own):

    cache.spec              the model's cache (all KV heads)
    cache.chips[c].device   chip c's :class:`~vllm_hawk.npu.ttnn_chip.TTNNChip`
    cache.chips[c].layout   TTKVCacheLayout (addresses from ``buffer_address()``)
    cache.chips[c].buffers  DeviceBuffers K0, V0, K1, ... of chip c's part of each tensor
    cache.heads_of(c)       global KV heads ``[start, stop)`` chip c holds

the :mod:`vllm_hawk.tenstorrent.kv_cache` protocols, which the connector reaches through
:mod:`vllm_hawk.tenstorrent.registry`. Numpy and ttnn only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from vllm_hawk.layout.tp import HeadShard, shard_heads
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.ttnn_chip import TTNNChip, dtype_name, import_ttnn

__all__ = ["TTNNChipKVCache", "TTNNMeshKVCache", "one_submesh"]


def one_submesh(kv_cache, ttnn) -> list:
    """The per-layer ``[[K, V], ...]`` of the model's cache. tt_transformers'
    ``allocate_vllm_kv_cache`` returns ``kv_cache[submesh][layer] = [K, V]`` (its generators
    index ``kv_cache[model_id]``); one submesh is unwrapped, several (data parallelism) are
    refused. A cache that already is ``[[K, V], ...]`` is returned as it is."""
    try:
        head = kv_cache[0][0]
    except (TypeError, IndexError, KeyError):
        raise ValueError(
            f"KV cache: expected tt_transformers' kv_cache[submesh][layer] = [K, V], got {type(kv_cache).__name__}"
        ) from None
    if isinstance(head, ttnn.Tensor):  # [layer][K, V]
        return list(kv_cache)
    if len(kv_cache) != 1:
        raise ValueError(
            f"KV cache holds {len(kv_cache)} submeshes (tt_data_parallel={len(kv_cache)}): the HAWK sink lands "
            "one model's cache on one mesh; data parallelism over submeshes is not supported, run one decode "
            "server per submesh instead"
        )
    return list(kv_cache[0])


class TTNNChipKVCache:
    """One chip's part of the model's paged cache (``spec``: that chip's heads); implements
    :class:`~vllm_hawk.tenstorrent.kv_cache.ChipKVCache`."""

    def __init__(self, device: TTNNChip, spec: TTKVCacheSpec, kv_cache, layer_names: Sequence[str]) -> None:
        self.device, self.spec, self.layer_names = device, spec, list(layer_names)
        self.layout, self.buffers = device.adopt_kv_cache(kv_cache, spec)

    @property
    def num_banks(self) -> int:
        return self.layout.num_banks

    def buffer(self, layer: int, kv: int):
        return self.buffers[2 * layer + kv]

    def read_block_bytes(self, layer: int, kv: int, blocks) -> np.ndarray:
        """Bytes of whole blocks read back through ttnn, in the tile order of ``[len(blocks),
        H, block_size, head_dim]``: uint8 ``[tiles, tile_nbytes]``."""
        pages = self.device.read_tensor_pages(self.buffer(layer, kv))
        return pages[self.layout.block_tiles(np.asarray(blocks, dtype=np.int64))]

    def nonzero_blocks(self) -> list[int]:
        """Blocks holding a non-zero byte in any layer's K or V (read back through ttnn)."""
        tpb = self.spec.tiles_per_block
        hit = np.zeros(self.spec.num_blocks, dtype=bool)
        for buf in self.buffers:
            pages = self.device.read_tensor_pages(buf)
            hit |= pages.reshape(self.spec.num_blocks, tpb * pages.shape[1]).any(axis=1)
        return np.nonzero(hit)[0].tolist()

    def close(self) -> None:
        """Forget the tensors (the model owns them)."""
        for buf in self.buffers:
            self.device.free_buffer(buf)
        self.buffers = []


class TTNNMeshKVCache:
    """The model's cache on every chip of the mesh (see module doc), a
    :class:`~vllm_hawk.tenstorrent.kv_cache.MeshKVCache`. ``kv_cache``: the model's
    ``kv_cache[submesh][layer] = [K, V]`` (one submesh, :func:`one_submesh`); ``chips``: one
    :class:`TTNNChip` per mesh chip. Chip ``c`` holds KV heads ``[c*H/n, (c+1)*H/n)``
    (tt_transformers' split over a mesh)."""

    def __init__(self, chips: Sequence[TTNNChip], kv_cache, num_kv_heads: int, block_size: int) -> None:
        ttnn = import_ttnn()
        if not chips:
            raise ValueError("TTNNMeshKVCache needs at least one chip")
        kv_cache = one_submesh(kv_cache, ttnn)
        for i, pair in enumerate(kv_cache):
            if len(pair) != 2 or not all(isinstance(t, ttnn.Tensor) for t in pair):
                raise ValueError(
                    f"KV cache layer {i}: expected a [K, V] pair of ttnn tensors, got {type(pair).__name__} "
                    "(the HAWK sink lands one uniform cache: hybrid per-group caches are not supported)"
                )
        k0 = kv_cache[0][0]
        num_blocks, per_chip, bs, head_dim = (int(x) for x in k0.shape)
        if bs != block_size:
            raise ValueError(f"KV cache block size {bs} != vLLM's block_size {block_size}")
        self.spec = TTKVCacheSpec(len(kv_cache), num_blocks, num_kv_heads, bs, head_dim, dtype_name(ttnn, k0.dtype))
        self.shards: list[HeadShard] = [
            shard_heads(num_kv_heads, len(chips), c, "mesh chips") for c in range(len(chips))
        ]
        if any(sh.count != per_chip for sh in self.shards):
            raise ValueError(
                f"KV cache holds {per_chip} heads per chip; {num_kv_heads} KV heads over {len(chips)} chips are "
                f"{[sh.count for sh in self.shards]}: allocate [num_blocks, heads per chip, block_size, head_dim] "
                "per chip, as vllm-tt-plugin's kv_cache_shape asks (tt_transformers shards KV heads over the mesh)"
            )
        names = [f"layers.{i}" for i in range(self.spec.num_layers)]
        self.route = None  # the worker's LandingRoute (vllm_hawk.tenstorrent.route)
        self.chips: list[TTNNChipKVCache] = []
        try:
            for dev, sh in zip(chips, self.shards, strict=True):
                spec = dataclasses.replace(self.spec, num_kv_heads=sh.count)
                self.chips.append(TTNNChipKVCache(dev, spec, kv_cache, names))
        except Exception:
            self.close()
            raise

    @property
    def num_chips(self) -> int:
        return len(self.chips)

    @property
    def num_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    @property
    def layer_names(self) -> list[str]:
        return self.chips[0].layer_names

    def heads_of(self, chip: int) -> HeadShard:
        return self.shards[chip]

    def read_block_bytes(self, layer: int, kv: int, blocks) -> np.ndarray:
        """Bytes of whole blocks, all heads, as one chip holding them all would have them."""
        if self.num_chips == 1:
            return self.chips[0].read_block_bytes(layer, kv, blocks)
        nblk = np.asarray(blocks).size
        parts = [c.read_block_bytes(layer, kv, blocks) for c in self.chips]
        return np.concatenate([p.reshape(nblk, -1, p.shape[1]) for p in parts], axis=1).reshape(-1, parts[0].shape[1])

    def nonzero_blocks(self) -> list[int]:
        """Blocks holding a non-zero byte in any layer's K or V, on any chip."""
        return sorted(set().union(*(c.nonzero_blocks() for c in self.chips)))

    def close(self) -> None:
        for c in self.chips:
            c.close()
        self.chips = []
