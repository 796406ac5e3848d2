"""Decode side of a GG pull whose prefill blocks are smaller than the decode's (D6-D7).

A plain vLLM decode whose ``--block-size`` is ``ratio`` times the prefill's (e.g. 32 ->
64; the handshake allows exactly these pairs, :func:`vllm_hawk.protocol.compat.regroups`)
takes the prefill's blocks as they are, as vLLM's NIXL connector does
(``block_size_ratio``): each destination block receives ``ratio`` source blocks back to
back, then the decode regroups them into its own layout (NIXL:
``kv_postprocess_blksize_on_receive``). The prefill serves its blocks unchanged, so a
prefill needs nothing new, and the READs stay exactly as few and as large as with equal
block sizes: the layer stream of consecutive source blocks lands in consecutive
destination blocks as one READ per layer and run (:func:`~vllm_hawk.kvflow.streams.pair_stream`).

Why not READ each source token run straight to its final place: in vLLM 0.32's CPU
cache ``[B, H, N, 2D]`` every (block, head) slab holds K transposed ``[D, N]`` (vec) or
in 16-token groups (amx), so the tokens of one source block are D separate runs inside
a decode block: H*D pieces of 64 bytes per block and layer (head_dim 128, 32 tokens,
bf16), the per-request cost that makes 4 KiB transfers about 10x slower than large ones
over Mooncake TCP (docs/mooncake.md). Landing whole blocks and regrouping them is one
local copy per destination block instead.

The regroup of a layout: view a destination block's landed bytes (stream order, its
byte runs: :mod:`~vllm_hawk.kvflow.gather`) as ``ratio`` source blocks of the same
layout with ``N / ratio`` tokens (the handshake makes both sides' layouts equal but for
the block size: backend, kernel ISA and dimension order,
:func:`~vllm_hawk.layout.vllm_kv.dim_order`), read their logical K/V with the layout's
adapter, concatenate the tokens, write them with the decode's adapter
(:mod:`vllm_hawk.layout.vllm_kv`). That is done once per layout, on element indices
(:func:`block_map`); requests then move runs of elements (:class:`Regroup`). Layouts
whose blocks hold tokens outermost with K and V per token (FlashAttention's NHD) come
out as the identity: ``ratio`` source blocks back to back ARE the destination block.
The tokens of the last destination block past the request's last source block are
zeroed, as NIXL does, rather than left as the remains of earlier requests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hawk.kvflow.gather import BlockGather, byte_runs_view
from vllm_hawk.kvflow.streams import PerHeadRange
from vllm_hawk.layout.vllm_kv import block_byte_ranges, dim_order

__all__ = ["BlockMap", "Regroup", "SubBlockPlan", "block_map", "regroup_block", "sub_block_plan"]


@dataclass(frozen=True)
class SubBlockPlan:
    """A pull into a vLLM cache: destination ``blocks`` (in request order), each receiving
    ``ratio`` source blocks of ``src_block_size`` tokens (ratio 1: equal block sizes),
    ``num_src`` source blocks in all (the last destination block may get fewer)."""

    blocks: np.ndarray
    ratio: int = 1
    num_src: int = 0
    src_block_size: int = 0

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def covered_last(self) -> int:
        """Source blocks the last destination block receives (1 .. ratio)."""
        return self.num_src - (len(self.blocks) - 1) * self.ratio


def sub_block_plan(
    dst_blocks: np.ndarray, dst_block_size: int, src_block_size: int, num_tokens: int, first_block: int
) -> SubBlockPlan:
    """The plan of a pull of ``num_tokens`` tokens from destination block ``first_block``
    on (the decode holds the ones before) into ``dst_blocks``; raises ValueError naming
    both sizes unless ``dst_block_size`` is a multiple of ``src_block_size``."""
    if src_block_size <= 0 or dst_block_size % src_block_size:
        raise ValueError(
            f"the prefill's blocks hold {src_block_size} tokens, this decode's {dst_block_size}: a vLLM "
            "decode regroups the prefill's blocks only when its --block-size is a multiple of the prefill's"
        )
    ratio = dst_block_size // src_block_size
    num_src = -(-num_tokens // src_block_size) - first_block * ratio
    if not (len(dst_blocks) - 1) * ratio < num_src <= len(dst_blocks) * ratio:
        raise ValueError(f"{num_src} source blocks do not fill {len(dst_blocks)} blocks {ratio} times larger")
    return SubBlockPlan(np.asarray(dst_blocks, dtype=np.int64), ratio, num_src, src_block_size)


class Regroup:
    """Regroups landed source blocks into the destination blocks of per-layer caches
    ``caches`` (``[num_blocks, H, N, C]`` views, in layer order) read and written
    through ``adapters`` (one :class:`~vllm_hawk.layout.vllm_kv.SourceKVLayout` per layer).

    Per layer layout and ratio the adapters run once, over element indices
    (:func:`block_map`); a request's regroup is then one gather of element runs per layer
    from the landed blocks and one write back. Measured on a 2-core AMD EPYC (one torch
    thread; CPU_ATTN, 32 -> 64 tokens, 32 layers x 8 KV heads x 128 head_dim, a 1,024-token
    request = 128 MiB in 16 scattered blocks, median of 5): 76 ms (vec) and 78 ms (amx),
    against 67 ms to read those blocks and write them back unchanged, and 227 / 556 ms
    when K and V are decoded and encoded through the adapters (a gather element by
    element: 446 ms). Mooncake over TCP moves those 128 MiB in 130-430 ms here."""

    def __init__(self, adapters: Sequence, caches: Sequence[torch.Tensor]) -> None:
        if len(adapters) != len(caches):
            raise ValueError(f"Regroup: {len(adapters)} adapters for {len(caches)} caches")
        self.adapters, self.caches = list(adapters), list(caches)
        # each block's dims in stream order (its bytes' order), e.g. "HNC" for CPU_ATTN
        self.orders = [dim_order(c).replace("B", "") for c in self.caches]
        self._gathers = [BlockGather([c], [block_byte_ranges(c, 0)]) for c in self.caches]
        self._blocks = [_block_elements(c) for c in self.caches]
        self._heads = PerHeadRange(self._for_heads)
        self._maps: dict[tuple, BlockMap] = {}

    def heads(self, start: int, count: int) -> Regroup:
        """The same for KV heads ``[start, start + count)`` only (built once per range)."""
        return self._heads(start, count)

    def _for_heads(self, start: int, count: int) -> Regroup:
        return Regroup(
            [dataclasses.replace(a, num_kv_heads=count) for a in self.adapters],
            [c[:, start : start + count] for c in self.caches],
        )

    def block_map(self, layer: int, ratio: int) -> BlockMap:
        """:func:`block_map` of ``layer``'s layout (kept per layout and ratio)."""
        a, c, order = self.adapters[layer], self.caches[layer], self.orders[layer]
        key = (type(a).__name__, a.isa, a.dtype, order, tuple(c.shape[1:]), ratio)
        if key not in self._maps:
            self._maps[key] = block_map(a, order, tuple(c.shape[1:]), ratio, c.device)
        return self._maps[key]

    def apply(self, plan: SubBlockPlan, streams: Sequence[torch.Tensor] | None = None) -> None:
        """Regroup ``plan``'s destination blocks. ``streams``: per layer, the landed bytes as
        uint8 ``[len(plan), block bytes]`` in stream order (a receive ring); None: they
        landed in the destination blocks themselves (read back from there)."""
        for i, c in enumerate(self.caches):
            m = self.block_map(i, plan.ratio)
            stream = None if streams is None else streams[i].to(c.device).view(c.dtype).view(len(plan), -1)
            out = self._regrouped(i, m, plan, stream)
            first = plan.covered_last * (c.shape[2] // plan.ratio)  # the last block's first token not sent
            if out is None:  # landed in place and already in order: zero the last block's tail there
                if first < c.shape[2]:
                    self._write(i, plan.blocks[-1:], self._read(i, plan.blocks[-1:]).masked_fill_(m.token >= first, 0))
                continue
            if first < c.shape[2]:
                out[-1].masked_fill_(m.token >= first, 0)
            self._write(i, plan.blocks, out)

    def _regrouped(self, i: int, m: BlockMap, plan: SubBlockPlan, stream: torch.Tensor | None) -> torch.Tensor | None:
        """The destination blocks' elements ``[n, block elements]`` in stream order (None:
        they landed in place, already in order)."""
        n = len(plan)
        if m.runs is None:
            return stream
        if stream is not None:
            return stream.view(n, -1, m.unit).index_select(1, m.runs).view(n, -1)
        view = self._blocks[i]
        if view is None:  # a block is several byte runs: read them, then gather
            return self._read(i, plan.blocks).view(n, -1, m.unit).index_select(1, m.runs).view(n, -1)
        stride = view.stride(0)
        if stride % m.unit:
            return view.index_select(0, _ids(plan.blocks, view)).view(n, -1, m.unit).index_select(1, m.runs).view(n, -1)
        n_rows = ((view.shape[0] - 1) * stride + view.shape[1]) // m.unit
        rows = view.as_strided((n_rows, m.unit), (m.unit, 1))  # every block's element runs, block 0 first
        ids = _ids(plan.blocks, view)[:, None] * (stride // m.unit) + m.runs[None, :]
        return rows.index_select(0, ids.view(-1)).view(n, -1)  # read and gather in one pass

    def _read(self, i: int, blocks: np.ndarray) -> torch.Tensor:
        """``[len(blocks), block elements]``: those blocks' elements in stream order (a copy)."""
        view = self._blocks[i]
        if view is not None:
            return view.index_select(0, _ids(blocks, view))
        g, c = self._gathers[i], self.caches[i]
        out = torch.empty(len(blocks), g.block_nbytes[0], dtype=torch.uint8, device=g.device)
        g(blocks.tolist(), out.view(-1))
        return out.view(c.dtype)

    def _write(self, i: int, blocks: np.ndarray, elements: torch.Tensor) -> None:
        """Store ``elements`` (``[len(blocks), block elements]``, stream order) in ``blocks``."""
        view = self._blocks[i]
        if view is not None:
            view.index_copy_(0, _ids(blocks, view), elements)
        else:
            self._gathers[i].scatter(blocks.tolist(), elements.contiguous().view(torch.uint8).view(-1))


def _ids(blocks: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.asarray(blocks, dtype=np.int64)).to(like.device)


def _block_elements(cache: torch.Tensor) -> torch.Tensor | None:
    """``[num_blocks, block elements]`` view of a layer cache whose blocks are one run each
    (stream order = memory order), else None."""
    runs = block_byte_ranges(cache, 0)
    if len(runs) != 1 or cache.stride(-1) != 1:
        return None
    return byte_runs_view(cache, *runs[0]).view(cache.dtype)


@dataclass(frozen=True)
class BlockMap:
    """One destination block of a layout, elements in stream order, as runs of ``unit``
    elements: destination run ``j`` is run ``runs[j]`` of the landed block (``ratio``
    source blocks back to back, stream order; None: the identity, e.g. FlashAttention
    NHD); ``token[e]`` is the token element ``e`` belongs to."""

    runs: torch.Tensor | None
    unit: int
    token: torch.Tensor


DIGIT_BITS = 8  # integers 0..255 are exact in bf16, fp16 and fp32 alike


def block_map(adapter, order: str, shape: tuple[int, int, int], ratio: int, device=None) -> BlockMap:
    """The :class:`BlockMap` of ``adapter``'s blocks ``shape`` ``(H, N, C)`` whose dims lie
    in ``order`` (e.g. ``"HNC"``), filled from source blocks of ``N / ratio`` tokens.

    Found by running the adapters on element indices instead of K/V values, 8 bits at a
    time (every KV dtype holds 0..255 exactly; the adapters only move elements): what
    :func:`regroup_block` makes of a landed block holding the indices is where each
    element comes from, and what the decode's adapter writes for K and V holding the
    token indices is each element's token."""
    H, N, C = shape
    n_el = H * N * C
    idx = torch.arange(n_el)
    tok = torch.arange(N).view(1, 1, N, 1).expand(1, H, N, C // 2)
    src = torch.zeros(n_el, dtype=torch.int64)
    token = torch.zeros(n_el, dtype=torch.int64)
    for shift in range(0, max(n_el - 1, 1).bit_length(), DIGIT_BITS):
        digit = ((idx >> shift) & 255).to(adapter.dtype)
        src |= regroup_block(adapter, order, shape, ratio, digit).to(torch.int64) << shift
        if (N - 1) >> shift:
            t = ((tok >> shift) & 255).to(adapter.dtype)
            token |= _write_block(adapter, order, shape, t, t).to(torch.int64) << shift
    if torch.equal(src, idx):
        return BlockMap(None, n_el, token.to(device))
    starts = torch.nonzero(torch.diff(src) != 1).view(-1) + 1  # where a run of consecutive sources breaks
    unit = math.gcd(*torch.cat([starts, src[starts], torch.tensor([n_el, int(src[0])])]).tolist())
    return BlockMap((src[::unit] // unit).to(device), unit, token.to(device))


def regroup_block(adapter, order: str, shape: tuple[int, int, int], ratio: int, landed: torch.Tensor) -> torch.Tensor:
    """One destination block (flat, stream order) from its ``landed`` elements (flat, stream
    order: ``ratio`` source blocks of ``N / ratio`` tokens back to back), through the
    layout's adapter: read the source blocks' K/V, concatenate their tokens, write."""
    H, N, C = shape
    sizes = {"H": H, "N": N // ratio, "C": C}
    sub = landed.reshape([ratio] + [sizes[d] for d in order]).permute([0] + [1 + order.index(d) for d in "HNC"])
    k, v = dataclasses.replace(adapter, block_size=N // ratio).read_blocks(sub, torch.arange(ratio))
    k, v = (x.transpose(0, 1).reshape(1, H, N, x.shape[-1]) for x in (k, v))  # [ratio, H, N/r, D] -> [1, H, N, D]
    return _write_block(adapter, order, shape, k, v)


def _write_block(adapter, order: str, shape: tuple[int, int, int], k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K, V ``[1, H, N, D]`` written by ``adapter`` into one block; its elements, flat, in
    stream order."""
    sizes = dict(zip("HNC", shape, strict=True))
    out = torch.zeros([1] + [sizes[d] for d in order], dtype=adapter.dtype)
    adapter.write_blocks(out.permute([0] + [1 + order.index(d) for d in "HNC"]), torch.tensor([0]), k, v)
    return out.reshape(-1)
