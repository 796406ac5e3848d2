"""Transfer plans: where every tile of a request's G' goes on the Tenstorrent device.

For a request whose KV lands in destination blocks ``dst_blocks`` of a Tenstorrent
paged cache (:class:`~vllm_hawk.layout.tt_kv_cache.TTKVCacheLayout`):

* request tile ``j`` (block-major over the request's blocks, ``tiles_per_block`` each)
  is destination tile ``t = dst_blocks[j // tpb] * tpb + j % tpb`` of every layer's K and
  V tensor, in bank ``t % nb`` at row ``t // nb``;
* G' (uint8) holds, for bank 0, 1, ..., nb-1 in turn, one contiguous segment with that
  bank's tiles for (layer 0 K, layer 0 V, layer 1 K, ...), tiles in request order;
* ``mode="staged"``: one RDMA op per bank moves its segment into the bank's receive
  buffer (dst offsets relative to that buffer), then ``intra_bank`` copies move runs of
  tiles to their KV pages (dst offsets absolute in the bank);
* ``mode="direct"``: RDMA ops target KV pages directly (dst offsets absolute in the bank).

Adjacent tiles whose destinations are adjacent are coalesced into one op. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout

MODES = ("staged", "direct")


@dataclass(frozen=True)
class OpList:
    """Contiguous byte copies: ``src_offset[i]`` in G' -> ``dst_offset[i]`` in ``bank[i]``,
    ``nbytes[i]`` bytes. All int64 arrays of equal length."""

    src_offset: np.ndarray
    bank: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return int(self.nbytes.size)

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())

    def for_bank(self, bank: int) -> OpList:
        sel = self.bank == bank
        return OpList(self.src_offset[sel], self.bank[sel], self.dst_offset[sel], self.nbytes[sel])

    @staticmethod
    def concat(parts: list[OpList]) -> OpList:
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            return OpList(z, z, z, z)
        return OpList(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("src_offset", "bank", "dst_offset", "nbytes"))
        )


@dataclass(frozen=True)
class TransferPlan:
    """How one request's G' is laid out and where it goes (see module docstring)."""

    mode: str
    layout: TTKVCacheLayout
    dst_blocks: np.ndarray  # int64 [n_blocks] destination block ids
    bank_order: np.ndarray  # int64 [T_req] request tile indices, grouped by bank (G' order)
    bank_counts: np.ndarray  # int64 [nb] tiles per bank per (layer, K|V)
    segment_offset: np.ndarray  # int64 [nb] byte offset of each bank's segment in G'
    segment_nbytes: np.ndarray  # int64 [nb] bytes of each bank's segment
    rdma: OpList  # the transfer's operations
    intra_bank: OpList | None  # staged mode only: receive buffer -> KV pages

    @property
    def total_nbytes(self) -> int:
        return int(self.segment_nbytes.sum())

    @property
    def tiles_per_tensor(self) -> int:
        """Tiles the request occupies in each layer's K (or V) tensor."""
        return int(self.bank_order.size)

    @property
    def recv_nbytes_per_bank(self) -> int:
        """Receive-buffer bytes needed per bank in staged mode (largest segment)."""
        return int(self.segment_nbytes.max())

    def per_tile_ops(self) -> OpList:
        """The design the paper rejects (section 4.3): one RDMA op per tile, direct to KV pages."""
        return _kv_page_ops(self, coalesce=False, relative_to_segment=False)


def block_runs(blocks) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids in ``blocks``: (position in the list, first id, length)."""
    b = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if b.size == 0:
        return []
    brk = np.nonzero(np.diff(b) != 1)[0] + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [b.size]])
    return [(int(s), int(b[s]), int(e - s)) for s, e in zip(starts, ends, strict=False)]


def make_plan(layout: TTKVCacheLayout, dst_blocks, mode: str = "staged") -> TransferPlan:
    """Plan the transfer of whole destination blocks ``dst_blocks`` (ids into dim 0)."""
    if mode not in MODES:
        raise ValueError(f"transfer mode must be one of {MODES}, got {mode!r}")
    dst = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
    spec = layout.spec
    if dst.size == 0:
        raise ValueError("make_plan: a request needs at least one destination block")
    if dst.min() < 0 or dst.max() >= spec.num_blocks:
        raise ValueError(
            f"make_plan: destination block ids must be in [0, {spec.num_blocks}), got min {dst.min()} max {dst.max()}"
        )
    if np.unique(dst).size != dst.size:
        raise ValueError("make_plan: destination block ids must be distinct")
    nb, tb = layout.num_banks, spec.tile_nbytes
    tiles = layout.block_tiles(dst)
    bank = tiles % nb
    order = np.lexsort((np.arange(tiles.size), bank)).astype(np.int64)
    counts = np.bincount(bank, minlength=nb).astype(np.int64)
    seg_nbytes = 2 * spec.num_layers * counts * tb
    seg_off = np.concatenate([[0], np.cumsum(seg_nbytes)[:-1]]).astype(np.int64)
    plan = TransferPlan(mode, layout, dst, order, counts, seg_off, seg_nbytes, None, None)  # type: ignore[arg-type]
    if mode == "direct":
        rdma, intra = _kv_page_ops(plan, coalesce=True, relative_to_segment=False), None
    else:
        live = np.nonzero(seg_nbytes)[0]
        zeros = np.zeros(live.size, dtype=np.int64)
        rdma = OpList(seg_off[live], live.astype(np.int64), zeros, seg_nbytes[live])
        intra = _kv_page_ops(plan, coalesce=True, relative_to_segment=True)
    object.__setattr__(plan, "rdma", rdma)
    object.__setattr__(plan, "intra_bank", intra)
    return plan


def _kv_page_ops(plan: TransferPlan, *, coalesce: bool, relative_to_segment: bool) -> OpList:
    """Ops from G' (or from each bank's receive buffer) to the KV pages of every tensor:
    per bank with tiles, per (layer, K|V) slot, one op per run of the bank's tiles (runs of
    adjacent KV pages when coalescing, else single tiles). The runs of all banks are found
    at once; each bank's [2L, runs] block of ops is then written once, in place."""
    layout = plan.layout
    spec, nb, tb, ap = layout.spec, layout.num_banks, layout.spec.tile_nbytes, layout.aligned_page
    rows = layout.block_tiles(plan.dst_blocks)[plan.bank_order] // nb  # [T] page row, bank order
    counts = plan.bank_counts
    bank = np.repeat(np.arange(nb, dtype=np.int64), counts)  # [T] bank of each tile
    new_run = np.ones(rows.size, dtype=bool)
    if coalesce and ap == tb:
        new_run[1:] = (bank[1:] != bank[:-1]) | (rows[1:] != rows[:-1] + 1)
    rs = np.flatnonzero(new_run)  # [R] first tile of each run
    run_nbytes = np.diff(np.append(rs, rows.size)) * tb
    run_src = (rs - (np.cumsum(counts) - counts)[bank[rs]]) * tb  # run start in its bank's slot, bytes
    run_dst = rows[rs] * ap
    runs = np.bincount(bank[rs], minlength=nb)
    n2l = 2 * spec.num_layers
    slots = np.arange(n2l, dtype=np.int64)[:, None]  # (layer, kv) slot
    bases = np.asarray(layout.addresses, dtype=np.int64).reshape(-1, 1)  # [2L, 1]: K0, V0, K1, ...
    src, dst, nbytes = (np.empty(n2l * rs.size, dtype=np.int64) for _ in range(3))
    first = 0
    for c in np.flatnonzero(runs):
        r = slice(first, first + runs[c])
        grid = slice(n2l * first, n2l * r.stop)
        seg = 0 if relative_to_segment else plan.segment_offset[c]
        np.add(seg + slots * (counts[c] * tb), run_src[r], out=src[grid].reshape(n2l, -1))
        np.add(bases, run_dst[r], out=dst[grid].reshape(n2l, -1))
        nbytes[grid].reshape(n2l, -1)[:] = run_nbytes[r]
        first = r.stop
    return OpList(src, np.repeat(np.arange(nb, dtype=np.int64), n2l * runs), dst, nbytes)
