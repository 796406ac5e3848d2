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
bf16), the per-request cost that makes 4 KiB transfers 20x slower than large ones over
Mooncake TCP (DESIGN.md section 6). Landing whole blocks and regrouping them is one
local copy per destination block instead.

The regroup, per layer, from the destination blocks' landed bytes in stream order
(their byte runs: :mod:`~vllm_hawk.kvflow.gather`): view them as ``ratio`` source
blocks per destination block in the same layout with ``N / ratio`` tokens (the
handshake makes both sides' layouts equal but for the block size: backend, kernel ISA
and dimension order, :func:`~vllm_hawk.layout.vllm_kv.dim_order`), read their logical
K/V with the layout's adapter, concatenate the tokens and write them with the
decode's adapter (:mod:`vllm_hawk.layout.vllm_kv`). Layouts whose blocks hold tokens
outermost with K and V per token (FlashAttention's NHD) need no regroup: ``ratio``
source blocks back to back ARE the destination block. The tokens of the last
destination block that no source block covered (past the request's last source block)
are zeroed, as NIXL does, rather than left as the regrouped remains of earlier requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hawk.kvflow.gather import BlockGather
from vllm_hawk.kvflow.streams import PerHeadRange
from vllm_hawk.layout.vllm_kv import block_byte_ranges, dim_order

__all__ = ["Regroup", "SubBlockPlan", "sub_block_plan"]


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
    through ``adapters`` (one :class:`~vllm_hawk.layout.vllm_kv.SourceKVLayout` per layer)."""

    def __init__(self, adapters: Sequence, caches: Sequence[torch.Tensor]) -> None:
        if len(adapters) != len(caches):
            raise ValueError(f"Regroup: {len(adapters)} adapters for {len(caches)} caches")
        self.adapters, self.caches = list(adapters), list(caches)
        # each block's dims in stream order (its bytes' order), e.g. "HNC" for CPU_ATTN
        self.orders = [dim_order(c).replace("B", "") for c in self.caches]
        self._gathers = [BlockGather([c], [block_byte_ranges(c, 0)]) for c in self.caches]
        self._heads = PerHeadRange(self._for_heads)

    def heads(self, start: int, count: int) -> Regroup:
        """The same for KV heads ``[start, start + count)`` only (built once per range)."""
        return self._heads(start, count)

    def _for_heads(self, start: int, count: int) -> Regroup:
        return Regroup(
            [dataclasses.replace(a, num_kv_heads=count) for a in self.adapters],
            [c[:, start : start + count] for c in self.caches],
        )

    def identity(self, layer: int) -> bool:
        """``ratio`` source blocks back to back are a destination block: tokens outermost
        in a block, K and V side by side per token (not CPU_ATTN's K/V halves)."""
        return self.orders[layer][0] == "N" and self.adapters[layer].name != "CPU_ATTN"

    def apply(self, plan: SubBlockPlan, streams: Sequence[torch.Tensor] | None = None) -> None:
        """Regroup ``plan``'s destination blocks. ``streams``: per layer, the landed bytes as
        uint8 ``[len(plan), block bytes]`` in stream order (a receive ring); None: they
        landed in the destination blocks themselves (read back from there)."""
        ids = torch.as_tensor(plan.blocks, dtype=torch.long).to(self.caches[0].device)
        for i in range(len(self.caches)):
            stream = None if streams is None else streams[i]
            if self.identity(i):
                if stream is not None:  # the bytes are the blocks' already: put them there
                    self._gathers[i].scatter(plan.blocks.tolist(), stream.reshape(-1))
                self._zero_tail(i, plan, ids, None, None)
                continue
            if stream is None:
                stream = torch.empty(len(plan), self._gathers[i].block_nbytes[0], dtype=torch.uint8, device=ids.device)
                self._gathers[i](plan.blocks.tolist(), stream.view(-1))
            k, v = self._regrouped(i, stream, plan)
            self._zero_tail(i, plan, ids, k, v)
            self.adapters[i].write_blocks(self.caches[i], ids, k, v)

    def _regrouped(self, i: int, stream: torch.Tensor, plan: SubBlockPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[n, H, N, D]`` of the ``n`` destination blocks from their landed bytes."""
        c, a, order = self.caches[i], self.adapters[i], self.orders[i]
        n, r = len(plan), plan.ratio
        H, N, C = c.shape[1:]
        sizes = {"H": H, "N": N // r, "C": C}
        sub = stream.view(c.dtype).reshape([n * r] + [sizes[d] for d in order])
        sub = sub.permute([0] + [1 + order.index(d) for d in "HNC"])  # logical [n*r, H, N/r, C]
        src = dataclasses.replace(a, block_size=N // r)
        k, v = src.read_blocks(sub, torch.arange(n * r, device=sub.device))
        D = k.shape[-1]
        return tuple(x.reshape(n, r, H, N // r, D).transpose(1, 2).reshape(n, H, N, D) for x in (k, v))

    def _zero_tail(self, i: int, plan: SubBlockPlan, ids: torch.Tensor, k, v) -> None:
        """Zero the tokens of the last destination block past its last source block."""
        N = self.caches[i].shape[2]
        first = plan.covered_last * (N // plan.ratio)
        if first >= N:
            return
        if k is not None:
            k[-1, :, first:] = 0
            v[-1, :, first:] = 0
        else:  # tokens outermost, K and V per token (identity layouts): zero them in place
            self.caches[i][int(ids[-1]), :, first:] = 0
