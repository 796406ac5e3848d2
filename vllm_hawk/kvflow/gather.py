"""Staged mode, prefill side (P6): a request's layer streams gathered into a ring range.

The bytes are the request's layer streams (layer after layer, the request's blocks in
order, each block's template runs in template order:
:func:`~vllm_hawk.kvflow.streams.stream_runs`), copied with torch operations on the
caches' own device: one ``index_select`` per layer and template run from a strided uint8
view of the cache. No address is dereferenced by host code, so the same code gathers
from a CUDA cache into a ring in GPU memory as from a CPU cache into host memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_hawk.kvflow.device import synchronize
from vllm_hawk.layout.vllm_kv import block_byte_ranges
from vllm_hawk.transform.uploads import to_device

__all__ = ["BlockGather", "byte_runs_view"]


def byte_runs_view(cache: torch.Tensor, offset_bytes: int, nbytes: int) -> torch.Tensor:
    """uint8 ``[num_blocks, nbytes]`` view of bytes ``[offset_bytes, offset_bytes + nbytes)``
    of every block of ``cache`` (``[num_blocks, ...]``, last dimension dense; offsets from
    the start of block 0, as :func:`~vllm_hawk.layout.vllm_kv.block_byte_ranges` gives)."""
    if cache.stride(-1) != 1:
        raise ValueError("gather: the cache's last dimension must be dense (stride 1)")
    b = cache.view(torch.uint8)  # the last dimension in bytes; storage offset in bytes
    return b.as_strided(
        (cache.shape[0], nbytes), (cache.stride(0) * cache.element_size(), 1), b.storage_offset() + offset_bytes
    )


class BlockGather:
    """The layer streams of per-layer caches ``[num_blocks, ...]``: per layer, the template
    runs of one block (``(offset_bytes, nbytes)``) as strided byte views."""

    def __init__(self, caches: Sequence[torch.Tensor], templates: Sequence[Sequence[tuple[int, int]]]) -> None:
        self.layers = [
            [(int(o), int(n), byte_runs_view(c, int(o), int(n))) for o, n in tmpl]
            for c, tmpl in zip(caches, templates, strict=True)
        ]
        self.block_nbytes = [sum(n for _o, n, _v in runs) for runs in self.layers]
        self.device = caches[0].device

    @classmethod
    def of_caches(cls, caches: Sequence[torch.Tensor]) -> BlockGather:
        """From the caches alone: each block's byte runs from the caches' strides."""
        return cls(caches, [block_byte_ranges(c, 0) for c in caches])

    def nbytes(self, num_blocks: int) -> int:
        return num_blocks * sum(self.block_nbytes)

    def __call__(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Write the streams of ``block_ids`` into uint8 ``out`` (``nbytes(len(block_ids))``
        bytes), layer after layer. ``out`` on the caches' device: gathered in place (queued;
        the caller synchronises). In host memory (a ring a host-only transport reads):
        gathered on the device, then one device -> host copy per layer, queued
        (``non_blocking``: asynchronous into a pinned ring, a CUDA DMA; synchronous into
        pageable memory), and one synchronisation of the caches' device at the end, so the
        bytes are in ``out`` when this returns."""
        n = len(block_ids)
        if out.dtype != torch.uint8 or out.numel() != self.nbytes(n):
            raise ValueError(f"gather: out must be uint8 [{self.nbytes(n)}], got {out.dtype} [{out.numel()}]")
        ids = to_device(np.asarray(list(block_ids), dtype=np.int64), self.device)
        here = out.device == self.device
        pos = 0
        for runs, bn in zip(self.layers, self.block_nbytes, strict=True):
            dst = out[pos : pos + n * bn].view(n, bn)
            stage = dst if here else torch.empty((n, bn), dtype=torch.uint8, device=self.device)
            col = 0
            for _o, nb, src in runs:
                if len(runs) == 1:
                    torch.index_select(src, 0, ids, out=stage)
                else:
                    stage[:, col : col + nb] = src.index_select(0, ids)
                col += nb
            if not here:
                dst.copy_(stage, non_blocking=True)  # stage's reuse is queued after this copy (one stream)
            pos += n * bn
        if not here:
            synchronize(self.device)

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """The inverse of a call: write uint8 ``src`` (layer streams of ``block_ids``, as a
        call lays them out, on the caches' device) back into those blocks' byte runs."""
        n = len(block_ids)
        if src.dtype != torch.uint8 or src.numel() != self.nbytes(n) or src.device != self.device:
            raise ValueError(f"scatter: src must be uint8 [{self.nbytes(n)}] on {self.device}")
        ids = to_device(np.asarray(list(block_ids), dtype=np.int64), self.device)
        pos = 0
        for runs, bn in zip(self.layers, self.block_nbytes, strict=True):
            rows = src[pos : pos + n * bn].view(n, bn)
            col = 0
            for _o, nb, dst in runs:
                dst.index_copy_(0, ids, rows[:, col : col + nb])
                col += nb
            pos += n * bn
