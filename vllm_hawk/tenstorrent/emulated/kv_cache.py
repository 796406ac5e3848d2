"""A vLLM engine's KV cache held in an emulated Tenstorrent device, in the device's layout.

Per layer two interleaved DRAM buffers, K and V, each ``[num_blocks, num_kv_heads,
block_size, head_dim]`` in TILE layout (bf16, bfloat8_b or bfloat4_b tiles, one tile per page), as
:class:`~vllm_hawk.layout.tt_kv_cache.TTKVCacheLayout` describes. vLLM block ids index
dim 0. Tile ``t`` of a tensor lives in bank ``t % num_banks``, page row ``t // num_banks``
of that tensor's region in the bank; so a vLLM block is NOT one contiguous byte range:
everything that touches "block i" goes through :meth:`TTPagedKVCache.block_tiles`.

What the attention does with it (the emulation of an NPU kernel consuming tiles):

* :meth:`write_tokens` packs each new token's K/V face rows (16 values of one token, one
  head: the unit that owns a shared exponent) with the byte-exact packer of
  :mod:`vllm_hawk.layout.formats` and stores them at their byte offsets in the banks;
* :meth:`read_blocks` fetches only the tiles of the blocks asked for, bank by bank, and
  unpacks/untilizes them. The whole cache is never converted back to vLLM's layout.

Units: bytes for offsets and sizes, tokens for ``block_size``, elements elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_hawk.layout.formats import BFP_EXP_NBYTES, pack_tiles, unpack_tiles
from vllm_hawk.layout.tiles import FACE, FACE_ROWS_PER_TILE, TILE, TILE_ELEMS, untilize
from vllm_hawk.layout.tt_kv_cache import K, TTKVCacheSpec, V
from vllm_hawk.npu.bank_buffer import DeviceBuffer

__all__ = ["TTPagedKVCache", "face_row_bytes", "kv_budget_blocks", "paged_attention"]


def face_row_bytes(dtype: str) -> tuple[int, int]:
    """(data bytes of one 16-value face row, byte offset of the data area in a tile)."""
    if dtype == "bfloat16":
        return 2 * FACE, 0
    if dtype == "bfloat8_b":
        return FACE, BFP_EXP_NBYTES
    if dtype == "bfloat4_b":
        return FACE // 2, BFP_EXP_NBYTES
    raise ValueError(f"no face-row packing for tile dtype {dtype!r}")


def kv_budget_blocks(
    spec_per_block_tiles: int, num_layers: int, num_banks: int, aligned_tile: int, budget_per_bank: int
) -> int:
    """Largest block count whose K and V tensors (2 per layer, lockstep) fit in
    ``budget_per_bank`` bytes of every bank, counting the lockstep rounding up to whole
    pages per bank (``ceil(tiles / num_banks)``)."""
    per_tensor_pages = budget_per_bank // (2 * num_layers * aligned_tile)
    # ceil(n * tpb / nb) <= per_tensor_pages  <=>  n * tpb <= per_tensor_pages * nb
    return (per_tensor_pages * num_banks) // spec_per_block_tiles


class TTPagedKVCache:
    """K/V of ``spec.num_layers`` layers in ``device``'s banks (see module docstring);
    implements :class:`~vllm_hawk.tenstorrent.kv_cache.ChipKVCache`.

    ``device`` implements the emulated device API (``allocate_kv_cache``,
    ``bank_tensor``, the bank-buffer calls); ``layer_names`` maps vLLM layer names to
    layer indices in the order given. The cache owns its device buffers: :meth:`close`
    frees them.
    """

    def __init__(self, device, spec: TTKVCacheSpec, layer_names: Sequence[str] = ()) -> None:
        if layer_names and len(layer_names) != spec.num_layers:
            raise ValueError(f"{len(layer_names)} layer names for {spec.num_layers} layers")
        self.device = device
        self.spec = spec
        self.layer_names = list(layer_names)
        self._layer_index = {n: i for i, n in enumerate(self.layer_names)}
        self.layout, self.buffers = device.allocate_kv_cache(spec)
        self.row_nbytes, self.data_offset = face_row_bytes(spec.dtype)
        nb, ap = self.layout.num_banks, self.layout.aligned_page
        pages = self.layout.size_per_bank // ap
        # views[layer][kv][bank]: uint8 [pages, aligned_page] of that tensor in that bank
        self._views: list[list[list[torch.Tensor]]] = []
        for layer in range(spec.num_layers):
            per_kv = []
            for kv in (K, V):
                base = self.layout.addresses[layer][kv]
                per_kv.append([device.bank_tensor(b)[base : base + pages * ap].view(pages, ap) for b in range(nb)])
            self._views.append(per_kv)
        self._closed = False

    # ---- identity -----------------------------------------------------------------
    @property
    def chips(self) -> list[TTPagedKVCache]:
        """The chips this cache spans: itself (a mesh cache lists one cache per chip)."""
        return [self]

    @property
    def num_banks(self) -> int:
        return self.layout.num_banks

    def layer_index(self, layer: int | str) -> int:
        """Layer index of a vLLM layer name (or an index, checked)."""
        if isinstance(layer, str):
            try:
                return self._layer_index[layer]
            except KeyError:
                raise KeyError(f"unknown layer {layer!r}; known: {self.layer_names}") from None
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.spec.num_layers})")
        return layer

    def buffer(self, layer: int | str, kv: int) -> DeviceBuffer:
        """The interleaved device buffer of tensor (layer, K=0|V=1)."""
        return self.buffers[2 * self.layer_index(layer) + kv]

    def block_tiles(self, blocks) -> np.ndarray:
        """Tile (page) indices of whole blocks, block-major (same in every tensor)."""
        return self.layout.block_tiles(blocks)

    # ---- whole tiles --------------------------------------------------------------
    def read_tiles(self, layer: int | str, kv: int, tiles) -> torch.Tensor:
        """Bytes of tiles of tensor (layer, kv): uint8 [len(tiles), tile_nbytes]."""
        t = torch.as_tensor(np.asarray(tiles, dtype=np.int64))
        views = self._views[self.layer_index(layer)][kv]
        nb, tb = self.num_banks, self.spec.tile_nbytes
        out = torch.empty((t.numel(), tb), dtype=torch.uint8)
        bank, row = t % nb, t // nb
        for b in range(nb):
            sel = (bank == b).nonzero().view(-1)
            if sel.numel():
                out[sel] = views[b][row[sel], :tb]
        return out

    def write_tiles(self, layer: int | str, kv: int, tiles, data: torch.Tensor) -> None:
        """Store whole tiles: ``data`` uint8 [len(tiles), tile_nbytes]."""
        t = torch.as_tensor(np.asarray(tiles, dtype=np.int64))
        tb = self.spec.tile_nbytes
        if tuple(data.shape) != (t.numel(), tb):
            raise ValueError(f"write_tiles: data {tuple(data.shape)} != ({t.numel()}, {tb})")
        views = self._views[self.layer_index(layer)][kv]
        nb = self.num_banks
        bank, row = t % nb, t // nb
        for b in range(nb):
            sel = (bank == b).nonzero().view(-1)
            if sel.numel():
                views[b][row[sel], :tb] = data[sel]

    def read_block_bytes(self, layer: int | str, kv: int, blocks) -> torch.Tensor:
        """Bytes of whole blocks, tile order of ``[len(blocks), H, block_size, head_dim]``:
        equal to ``tilize_pack`` of that tensor when the blocks hold it."""
        return self.read_tiles(layer, kv, self.block_tiles(blocks))

    def zero_blocks(self, blocks) -> None:
        """Zero every tile of the blocks in all layers (zero bytes decode to 0.0 in all formats)."""
        tiles = torch.as_tensor(self.block_tiles(blocks))
        if tiles.numel() == 0:
            return
        nb = self.num_banks
        bank, row = tiles % nb, tiles // nb
        for per_kv in self._views:
            for views in per_kv:
                for b in range(nb):
                    sel = row[bank == b]
                    if sel.numel():
                        views[b][sel] = 0

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` in all layers (vLLM's copy-on-write of a shared block).

        Tile ``k`` of block ``src`` and tile ``k`` of ``dst`` are in different banks unless
        ``(dst - src) * tiles_per_block`` divides by the bank count, so this reads and
        writes whole tiles through the layout instead of moving one byte range."""
        if not pairs:
            return
        src = self.block_tiles([s for s, _ in pairs])
        dst = self.block_tiles([d for _, d in pairs])
        for layer in range(self.spec.num_layers):
            for kv in (K, V):
                self.write_tiles(layer, kv, dst, self.read_tiles(layer, kv, src))

    # ---- tokens (the attention's write and read) ----------------------------------
    def write_tokens(self, layer: int | str, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store K and V of tokens ``[T, H, head_dim]`` at vLLM slots ``block * block_size +
        offset`` (slots < 0 are padding and skipped).

        Each (token, head, 16-dim group) is one face row of one tile; it is packed on its
        own (its shared exponent covers exactly those 16 values) and its bytes are written
        where the layout puts them. Other tokens in the same tiles are untouched."""
        li = self.layer_index(layer)
        s = self.spec
        slots = slots.reshape(-1).to(torch.int64)
        valid = slots >= 0
        if not bool(valid.all()):
            key, value, slots = key[valid], value[valid], slots[valid]
        n_tok = slots.numel()
        if n_tok == 0:
            return
        H, D, bs = s.num_kv_heads, s.head_dim, s.block_size
        groups = D // FACE
        block = (slots // bs).view(-1, 1, 1)
        tok = (slots % bs).view(-1, 1, 1)
        head = torch.arange(H).view(1, -1, 1)
        dim0 = (torch.arange(groups) * FACE).view(1, 1, -1)
        tile = ((block * H + head) * (bs // TILE) + tok // TILE) * (D // TILE) + dim0 // TILE
        r, c = tok % TILE, dim0 % TILE
        face_row = ((r // FACE) * 2 + c // FACE) * FACE + r % FACE  # 0..63 inside the tile
        tile, face_row = tile.reshape(-1), face_row.expand(n_tok, H, groups).reshape(-1)
        nb = self.num_banks
        bank, page_row = tile % nb, tile // nb
        w, d0 = self.row_nbytes, self.data_offset
        cols = torch.arange(w).view(1, -1)
        for kv, x in ((K, key), (V, value)):
            exps, data = self._pack_rows(x.reshape(n_tok, H, D))
            views = self._views[li][kv]
            for b in range(nb):
                sel = (bank == b).nonzero().view(-1)
                if not sel.numel():
                    continue
                rows, fr = page_row[sel], face_row[sel]
                views[b][rows.view(-1, 1), d0 + fr.view(-1, 1) * w + cols] = data[sel]
                if exps is not None:
                    views[b][rows, fr] = exps[sel]

    def _pack_rows(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Face rows of ``x`` [T, H, D] -> (shared exponent bytes [n] or None, data [n, w])."""
        rows = x.reshape(-1, FACE).to(torch.float32)
        n = rows.shape[0]
        pad = (-n) % FACE_ROWS_PER_TILE
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, FACE)])
        packed = pack_tiles(rows.reshape(-1, TILE_ELEMS), self.spec.dtype)  # rows are independent
        if self.spec.dtype == "bfloat16":
            return None, packed.reshape(-1, self.row_nbytes)[:n]
        exps = packed[:, :BFP_EXP_NBYTES].reshape(-1)[:n]
        data = packed[:, BFP_EXP_NBYTES:].reshape(-1, self.row_nbytes)[:n]
        return exps, data

    def read_blocks(self, layer: int | str, kv: int, blocks) -> torch.Tensor:
        """Values of whole blocks: float32 ``[len(blocks), H, block_size, head_dim]``.

        Reads only those blocks' tiles (bank by bank) and unpacks them."""
        s = self.spec
        blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
        data = self.read_tiles(layer, kv, self.block_tiles(blocks))
        shape = (blocks.size, s.num_kv_heads, s.block_size, s.head_dim)
        return untilize(unpack_tiles(data, s.dtype), shape)

    # ---- teardown ------------------------------------------------------------------
    def close(self) -> None:
        """Free the device buffers (idempotent). The views must not be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._views = []
        for buf in self.buffers:
            self.device.free_buffer(buf)


def paged_attention(
    cache: TTPagedKVCache,
    layer: int,
    query: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of each request's queries over its cached tokens.

    query/out: ``[num_tokens, num_heads, head_dim]``; request ``r`` owns query rows
    ``query_start_loc[r]:query_start_loc[r+1]``, which are its LAST tokens, so query row
    ``i`` of a request with ``q`` queries sits at position ``seq_lens[r] - q + i`` and sees
    cache positions ``<= `` that. K/V come from the request's blocks in the tiled cache
    (only the tiles of ``ceil(seq_len / block_size)`` blocks are read)."""
    s = cache.spec
    bs, hkv = s.block_size, s.num_kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    nblk = [-(-ln // bs) for ln in lens]
    blocks = np.concatenate([block_table[r, : nblk[r]].numpy() for r in range(len(lens))] or [np.zeros(0)])
    if blocks.size == 0:
        return out
    k_all = cache.read_blocks(layer, 0, blocks)  # [sum(nblk), H, bs, D] float32
    v_all = cache.read_blocks(layer, 1, blocks)
    first = 0
    for r, ln in enumerate(lens):
        q0, q1 = qsl[r], qsl[r + 1]
        nq = q1 - q0
        if nq == 0:
            first += nblk[r]
            continue
        k = k_all[first : first + nblk[r]].transpose(0, 1).reshape(hkv, -1, s.head_dim)[:, :ln]
        v = v_all[first : first + nblk[r]].transpose(0, 1).reshape(hkv, -1, s.head_dim)[:, :ln]
        first += nblk[r]
        q = query[q0:q1].to(torch.float32).transpose(0, 1)  # [Hq, nq, D]
        group = q.shape[0] // hkv
        q = q.reshape(hkv, group * nq, s.head_dim)
        scores = torch.bmm(q, k.transpose(1, 2)) * scale  # [H, group*nq, ln]
        qpos = torch.arange(ln - nq, ln).repeat(group)
        mask = torch.arange(ln).view(1, -1) > qpos.view(-1, 1)
        scores.masked_fill_(mask.unsqueeze(0), float("-inf"))
        o = torch.bmm(torch.softmax(scores, dim=-1), v)  # [H, group*nq, D]
        out[q0:q1] = o.reshape(hkv * group, nq, s.head_dim).transpose(0, 1).to(out.dtype)
    return out
