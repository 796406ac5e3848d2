"""A KV cache sharded over the chips of a Tenstorrent mesh (n300, a Blackhole group).

Each chip is its own :class:`~vllm_hawk.npu.emulated.EmulatedDevice` (own banks, own
allocator) and holds a :class:`~vllm_hawk.tenstorrent.emulated.kv_cache.TTPagedKVCache` of its KV
heads, as tt_transformers shards a decode's cache over a mesh: with ``H`` KV heads and
``n`` chips, chip ``c`` holds heads ``[c*H/n, (c+1)*H/n)`` (one head replicated on
``n/H`` chips when ``H < n``; :func:`vllm_hawk.layout.tp.shard_heads`), so each chip's
cache is ``[num_blocks, H/n, block_size, head_dim]`` per layer, K and V, in TILE layout:
the bytes ttnn would hold on that chip. vLLM block ids are the same on every chip.

What the model runner does on the cache fans out: token writes give each chip its
heads' slice; zeroing and copy-on-write run on every chip; attention runs per chip on
that chip's query heads (``[c*Hq/n, (c+1)*Hq/n)``, the ones reading its KV heads) and the
outputs are gathered (the all-gather after a mesh's attention). A one-chip mesh is the
single-chip cache: same allocations, same bytes, same calls.

Units: heads for head ranges, bytes for bank bytes, tokens for ``block_size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from vllm_hawk.layout.tp import HeadShard, TPMismatch, shard_heads
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.tenstorrent.emulated.kv_cache import TTPagedKVCache, paged_attention

__all__ = ["TTMeshKVCache", "TPMismatch", "chip_shards"]

CHIPS_NAME = "HAWK_TT_CHIPS"  # what a head-split error names (tt_plugin.config.ENV_CHIPS)


def chip_shards(num_kv_heads: int, num_chips: int, who: str = CHIPS_NAME) -> list[HeadShard]:
    """The KV heads of each chip; raises :class:`TPMismatch` naming ``who`` and the values."""
    return [shard_heads(num_kv_heads, num_chips, c, who) for c in range(num_chips)]


class TTMeshKVCache:
    """K/V of ``spec.num_layers`` layers sharded by KV head over ``devices`` (one per chip);
    implements :class:`~vllm_hawk.tenstorrent.kv_cache.MeshKVCache`.

    ``spec`` is the model's (global) cache: ``spec.num_kv_heads`` heads; chip ``c`` gets
    ``dataclasses.replace(spec, num_kv_heads=heads_of(c).count)``. ``chips[c]`` is chip
    ``c``'s :class:`TTPagedKVCache` (its ``.device``, ``.layout``, ``.spec``,
    ``.buffer(layer, kv)``, ``.layer_names``). The mesh owns the chip caches: :meth:`close`
    frees them. With one chip, ``device``, ``layout``, ``buffers`` and ``buffer`` are that
    chip's; with more they raise AttributeError (use ``chips[c]``).
    """

    def __init__(
        self, devices: Sequence, spec: TTKVCacheSpec, layer_names: Sequence[str] = (), who: str = CHIPS_NAME
    ) -> None:
        if not devices:
            raise ValueError("TTMeshKVCache needs at least one device")
        self.spec = spec
        self.shards = chip_shards(spec.num_kv_heads, len(devices), who)
        self.chips: list[TTPagedKVCache] = []
        try:
            for dev, sh in zip(devices, self.shards, strict=False):
                self.chips.append(TTPagedKVCache(dev, dataclasses.replace(spec, num_kv_heads=sh.count), layer_names))
        except Exception:
            for c in self.chips:
                c.close()
            raise
        # for the global views: the lowest chip holding each head range (replicas skipped)
        self._distinct = [c for c, sh in enumerate(self.shards) if c == 0 or sh.start != self.shards[c - 1].start]

    # ---- identity -----------------------------------------------------------------
    @property
    def num_chips(self) -> int:
        return len(self.chips)

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the model (all chips together)."""
        return self.spec.num_kv_heads

    def heads_of(self, chip: int) -> HeadShard:
        """Global KV heads ``[start, stop)`` chip ``chip`` holds."""
        if not 0 <= chip < self.num_chips:
            raise IndexError(f"chip {chip} outside [0, {self.num_chips})")
        return self.shards[chip]

    @property
    def num_banks(self) -> int:
        """DRAM banks of each chip (all chips share one profile)."""
        return self.chips[0].num_banks

    @property
    def layer_names(self) -> list[str]:
        return self.chips[0].layer_names

    def layer_index(self, layer: int | str) -> int:
        return self.chips[0].layer_index(layer)

    def _single(self, what: str) -> TTPagedKVCache:
        if self.num_chips != 1:
            raise AttributeError(
                f"TTMeshKVCache.{what}: the cache is sharded over {self.num_chips} chips; "
                f"use .chips[c].{what} (chip c holds heads .heads_of(c))"
            )
        return self.chips[0]

    @property
    def device(self):
        return self._single("device").device

    @property
    def layout(self):
        return self._single("layout").layout

    @property
    def buffers(self):
        return self._single("buffers").buffers

    def buffer(self, layer: int | str, kv: int):
        return self._single("buffer").buffer(layer, kv)

    # ---- fan-out of what vLLM does on its blocks ----------------------------------
    def zero_blocks(self, blocks) -> None:
        """Zero the blocks (all layers) on every chip."""
        for c in self.chips:
            c.zero_blocks(blocks)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` (all layers) on every chip."""
        for c in self.chips:
            c.copy_blocks(pairs)

    def write_tokens(self, layer: int | str, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store K/V of tokens ``[T, H, head_dim]`` (all heads): each chip its heads."""
        for c, sh in zip(self.chips, self.shards, strict=False):
            if sh.count == self.num_kv_heads:
                c.write_tokens(layer, key, value, slots)
            else:
                c.write_tokens(layer, key[:, sh.start : sh.stop], value[:, sh.start : sh.stop], slots)

    def paged_attention(
        self,
        layer: int,
        query: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """:func:`~vllm_hawk.tenstorrent.emulated.kv_cache.paged_attention` on each chip over its
        query heads (``[c*Hq/n, (c+1)*Hq/n)``, those of its KV heads), then the gather of
        the chips' outputs into ``out`` ``[num_tokens, Hq, head_dim]``."""
        n = self.num_chips
        if n == 1:
            return paged_attention(self.chips[0], layer, query, query_start_loc, seq_lens, block_table, scale, out)
        hq = query.shape[1]
        if hq % n or hq % self.num_kv_heads:
            raise TPMismatch(
                f"{CHIPS_NAME}={n}: the model's {hq} query heads do not split over {n} chips "
                f"with {self.num_kv_heads} KV heads"
            )
        per = hq // n
        for c, chip in enumerate(self.chips):
            q = query[:, c * per : (c + 1) * per]
            part = torch.empty(q.shape, dtype=out.dtype)
            paged_attention(chip, layer, q, query_start_loc, seq_lens, block_table, scale, part)
            out[:, c * per : (c + 1) * per] = part  # all-gather
        return out

    # ---- global views (all heads; debug dumps, tests) -----------------------------
    def read_block_bytes(self, layer: int | str, kv: int, blocks) -> torch.Tensor:
        """Bytes of whole blocks in the tile order of the model's ``[len(blocks), H,
        block_size, head_dim]`` (tiles are block-major, then head): per block, each chip's
        tiles in head order. Equal to the single-chip cache's bytes of the same K/V."""
        parts = [self.chips[c].read_block_bytes(layer, kv, blocks) for c in self._distinct]
        if len(parts) == 1:
            return parts[0]
        nblk = np.asarray(blocks).size
        return torch.cat([p.view(nblk, -1, p.shape[1]) for p in parts], dim=1).view(-1, parts[0].shape[1])

    def nonzero_blocks(self) -> list[int]:
        """Blocks holding a non-zero byte in any layer's K or V, on any chip."""
        blocks = np.arange(self.spec.num_blocks)
        hit = np.zeros(blocks.size, dtype=bool)
        for c in self.chips:
            for layer in range(self.spec.num_layers):
                for kv in (0, 1):
                    hit |= (c.read_block_bytes(layer, kv, blocks).view(blocks.size, -1) != 0).any(dim=1).numpy()
        return np.nonzero(hit)[0].tolist()

    def read_blocks(self, layer: int | str, kv: int, blocks) -> torch.Tensor:
        """Values of whole blocks, all heads: float32 ``[len(blocks), H, block_size, head_dim]``."""
        parts = [self.chips[c].read_blocks(layer, kv, blocks) for c in self._distinct]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    # ---- teardown ------------------------------------------------------------------
    def close(self) -> None:
        """Free every chip's device buffers (idempotent)."""
        for c in self.chips:
            c.close()
