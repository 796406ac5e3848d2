"""Source (prefill-side) KV cache layouts of vLLM 0.32, one adapter per attention backend.

In vLLM 0.32 every attention layer's cache is a 4-D view ``[num_blocks, num_kv_heads,
block_size, C]`` (logical ``[B, H, N, C]``) of one flat int8 buffer, ``.view(dtype)``-ed
(``vllm/v1/kv_cache_interface.py: create_kv_cache_views``); the physical order of B, H, N
(and of the layers) is a ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``). What C holds
depends on the backend:

* ``CPU_ATTN`` (``CpuAttnKVLayout``): C = 2*head_dim, but a (block, head) slab of
  ``block_size * 2*head_dim`` elements is opaque: its first half is K, its second half V,
  each in an ISA-specific order written by the C++ ``reshape_and_cache``. Layout is
  always LBHNC (``CPUAttentionBackend.supported_kv_cache_layouts``).
* ``FLASH_ATTN`` (``FlashAttnKVLayout``): C = [K | V] per (block, head, token):
  ``kv_cache.transpose(1, 2).split(head_size, -1)`` in ``FlashAttentionImpl.forward``.
  FlashAttention declares no layout, so vLLM picks LBNHC ("NHD") unless
  ``VLLM_KV_CACHE_LAYOUT`` or a connector asks for another of the six.
* ``FLASHINFER`` (``FlashInferKVLayout``): the same C = [K | V] (``flashinfer.py``:
  ``kv_cache.transpose(1, 2).split(self.head_size, dim=-1)`` before
  ``reshape_and_cache_flash``; ``forward`` permutes the view by
  ``kv_cache_layout.layer_view_order`` and splits C the same way). On Blackwell (SM 10.x)
  it asks for LBHNC or BLHNC ("HND": its trtllm-gen kernels read head-major blocks),
  elsewhere it takes the resolved layout. NVFP4 caches (uint8, K and V as separate head
  groups) are refused.
* ``TRITON_ATTN`` (``TritonAttnKVLayout``): the same C = [K | V] for ``auto``/bf16/fp16
  caches (``triton_attn.py``: ``kv_cache.transpose(1, 2).split(hs, dim=-1)``), any
  layout (it declares none). Its per-token-head quantized caches (int8/fp8/int4 with a
  float32 scale padded into each half) are refused.

Every adapter exposes the same interface (``SourceKVLayout``): ``read_blocks`` /
``write_blocks`` give K and V as ``[n_blocks, num_kv_heads, block_size, head_dim]`` in
logical token order; ``block_byte_ranges`` gives the byte runs of one block inside a
layer's cache for block-run copies; ``kv_views`` gives the whole layer as zero-copy
logical views where the layout is strided (``strided``). :class:`TransformSource` is
what the prefill transform reads for a request, for every layout: those views, or — for
the packed CPU_ATTN ``amx`` layout, which no strided view expresses — the request's
blocks gathered into logical tensors. Offsets and sizes called ``*_bytes``/byte ranges
are in bytes; everything else is in elements.

Pure torch; vLLM is imported only by :func:`detect_cpu_attn_isa` and
:func:`source_layout_from_layer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = [
    "SourceKVLayout",
    "TransformSource",
    "as_transform_source",
    "CpuAttnKVLayout",
    "FlashAttnKVLayout",
    "FlashInferKVLayout",
    "TritonAttnKVLayout",
    "CPU_ATTN_ISAS",
    "KV_CACHE_LAYOUTS",
    "block_byte_ranges",
    "detect_cpu_attn_isa",
    "dim_order",
    "make_layer_caches",
    "source_layout_for",
    "source_layout_from_layer",
]


@runtime_checkable
class SourceKVLayout(Protocol):
    """How one attention backend stores K/V in a layer cache ``[num_blocks, H, N, C]``."""

    name: str
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    strided: bool  # kv_views works (the layout is a strided view of the cache)
    isa: str | None  # the CPU kernel ISA whose layout this is (CPU_ATTN), else None

    def read_blocks(self, layer_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V, each [len(block_ids), num_kv_heads, block_size, head_dim], logical token order."""
        ...

    def write_blocks(
        self, layer_cache: torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K, V ([len(block_ids), num_kv_heads, block_size, head_dim]) into the blocks."""
        ...

    def kv_views(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the whole layer as logical [num_blocks, H, N, D] strided views (no copy)."""
        ...

    def block_byte_ranges(self, layer_cache: torch.Tensor, block_id: int) -> list[tuple[int, int]]:
        """(byte offset from layer_cache.data_ptr(), nbytes) runs holding block_id's K and V."""
        ...


# --------------------------------------------------------------------------- helpers


def block_byte_ranges(layer_cache: torch.Tensor, block_id: int) -> list[tuple[int, int]]:
    """Byte runs covering ``layer_cache[block_id]`` (all heads, tokens, channels).

    Computed from the view's strides, so it holds for every ``KVCacheLayout``: one run
    when the block's ``[H, N, C]`` is dense (LBHNC, LBNHC, BL*), ``H`` runs for the
    head-outer layouts (LHBNC, BHLNC). Offsets are bytes from ``layer_cache.data_ptr()``,
    sorted ascending; adjacent runs are merged.
    """
    if not 0 <= block_id < layer_cache.shape[0]:
        raise IndexError(f"block {block_id} outside [0, {layer_cache.shape[0]})")
    es = layer_cache.element_size()
    base = block_id * layer_cache.stride(0)  # elements
    dims = sorted(
        ((s, st) for s, st in zip(layer_cache.shape[1:], layer_cache.stride()[1:], strict=False) if s > 1),
        key=lambda d: d[1],
        reverse=True,
    )
    if any(st == 0 for _, st in dims):
        raise ValueError("layer cache has a broadcast (stride 0) dimension")
    # Fold dims from the innermost outward while they stay dense.
    run_elems = 1
    while dims and dims[-1][1] == run_elems:
        size, _ = dims.pop()
        run_elems *= size
    outer = dims  # remaining (size, stride), outermost first
    offsets = [base]
    for size, st in outer:
        offsets = [o + i * st for o in offsets for i in range(size)]
    offsets.sort()
    runs: list[tuple[int, int]] = []
    for o in offsets:
        if runs and runs[-1][0] + runs[-1][1] == o * es:
            runs[-1] = (runs[-1][0], runs[-1][1] + run_elems * es)
        else:
            runs.append((o * es, run_elems * es))
    return runs


def dim_order(layer_cache: torch.Tensor) -> str:
    """The physical order of a layer cache's logical dims ``[B, H, N, C]``, outermost
    first, from its strides: ``"BHNC"`` (LBHNC, CPU_ATTN, HND), ``"BNHC"`` (LBNHC, NHD),
    ``"HBNC"`` (LHBNC, BHLNC). Independent of the block size and of how many heads a TP
    rank holds: a dimension of size 1 whose stride ties another's is the inner of the two
    (its stride is the product of the dims inside it)."""
    dims = sorted(range(4), key=lambda i: (-layer_cache.stride(i), layer_cache.shape[i] == 1, i))
    return "".join("BHNC"[i] for i in dims)


def _as_index(block_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids.to(device)


@dataclass
class _Base:
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    isa: str | None = None  # a class default, not a dataclass field (CpuAttnKVLayout's is)

    def _check_cache(self, layer_cache: torch.Tensor) -> None:
        want = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if layer_cache.dim() != 4 or tuple(layer_cache.shape[1:]) != want:
            raise ValueError(
                f"{self.name}: layer cache shape {tuple(layer_cache.shape)} is not "
                f"[num_blocks, {want[0]}, {want[1]}, {want[2]}]"
            )
        if layer_cache.dtype != self.dtype:
            raise ValueError(f"{self.name}: layer cache dtype {layer_cache.dtype} != {self.dtype}")
        if layer_cache.stride(-1) != 1:
            raise ValueError(f"{self.name}: channels must be contiguous (stride 1)")

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        want = (n, self.num_kv_heads, self.block_size, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise ValueError(f"{self.name}: {name} shape {tuple(t.shape)} != {want}")

    def block_byte_ranges(self, layer_cache: torch.Tensor, block_id: int) -> list[tuple[int, int]]:
        """(byte offset from layer_cache.data_ptr(), nbytes) runs holding block_id's K and V."""
        self._check_cache(layer_cache)
        return block_byte_ranges(layer_cache, block_id)

    strided: ClassVar[bool] = True

    @property
    def block_nbytes(self) -> int:
        """Bytes of K+V of one block of one layer (dense, no padding)."""
        dt = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * self.block_size * 2 * self.head_dim * dt


# --------------------------------------------------------------------------- CPU_ATTN

#: CPU attention kernels whose cache layout this module knows (vLLM 0.32
#: ``cpu_attn._get_attn_isa`` returns one of amx, neon, rvv, vxe, vsx, vec, vec16).
CPU_ATTN_ISAS = ("vec", "vec16", "amx")


def detect_cpu_attn_isa(dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's CPU attention will use here (imports vLLM; same rule as the engine).

    Prefer the ``isa`` attribute the engine sets on its ``Attention`` layers when you
    have them (:func:`source_layout_from_layer`).
    """
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)


@dataclass
class CpuAttnKVLayout(_Base):
    """vLLM 0.32 ``CPU_ATTN`` layout; layer cache ``[num_blocks, H, N, 2*D]`` (LBHNC).

    The ``2*N*D`` elements of a (block, head) slab are K (first ``N*D``) then V (next
    ``N*D``) — ``cpu_attn.py`` views the cache as ``[B, H, 2N, D]`` and ``chunk(2, dim=2)``.
    Inside each half the order depends on the kernel ISA (C++ ``reshape_and_cache``):

    * ``vec`` / ``vec16`` (x86 AVX2/AVX-512 without AMX; ``vec16`` when head_dim % 32 != 0
      or block_size % 32 != 0): K transposed ``[D, N]`` (column-major per token),
      V row-major ``[N, D]``.
    * ``amx`` (bf16 with AMX): K ``[N/16, D/2, 16, 2]`` (token groups of 16, dim pairs
      packed as 32-bit words), V ``[D/16, N/2, 16, 2]`` (16-dim groups, token pairs packed).
      Derived from vLLM 0.32 ``csrc/cpu/cpu_attn_amx.hpp``,
      ``AttentionImpl<ISA::AMX>::reshape_and_cache``: K is written as 32-bit words
      (``quadword_num = head_dim / 2``) at word ``group_idx * 16 * quadword_num +
      group_offset + j * 16`` (``token_num_per_group = AMX_TILE_ROW_BYTES / 4 = 16``); V
      token pairs (``token_num_per_sub_group = 2``) at element ``sub_group_idx * 2 * 16 +
      sub_group_offset + i * block_size * 16 + 2 * j`` for head-dim group i (16 dims, j
      in it). No strided view expresses this order (a token or a dim is split over two
      axes), so ``kv_views`` refuses it and :class:`TransformSource` gathers instead.

    ``isa=None`` asks vLLM which ISA it would pick (:func:`detect_cpu_attn_isa`).
    fp8 KV caches and the neon/vsx/vxe/rvv kernels are refused.
    """

    isa: str | None = None
    name: ClassVar[str] = "CPU_ATTN"

    @property
    def strided(self) -> bool:  # type: ignore[override]
        """True for vec/vec16 (``kv_views`` works), False for the packed amx layout."""
        return self.isa in ("vec", "vec16")

    def __post_init__(self) -> None:
        if self.isa is None:
            self.isa = detect_cpu_attn_isa(self.dtype, self.block_size, self.head_dim)
        if self.isa not in CPU_ATTN_ISAS:
            raise NotImplementedError(
                f"CPU_ATTN kernel ISA {self.isa!r} has a cache layout vllm_hawk does not "
                f"model (supported: {', '.join(CPU_ATTN_ISAS)})"
            )
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise NotImplementedError(f"CPU_ATTN KV cache dtype {self.dtype} (fp8 caches are not supported)")
        if self.isa == "amx" and (
            self.dtype != torch.bfloat16 or self.block_size % 32 or self.head_dim % 16
        ):  # vLLM picks amx only for bf16; the packing below is bf16's (2 per 32-bit word)
            raise ValueError("amx layout needs bf16, block_size % 32 == 0, head_dim % 16 == 0")

    # element order of one K or V half, as views of the half's N*D elements
    def _halves_to_kv(self, kh: torch.Tensor, vh: torch.Tensor):
        n, h, N, D = kh.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        if self.isa in ("vec", "vec16"):
            k = kh.view(n, h, D, N).transpose(-1, -2)
            v = vh.view(n, h, N, D)
        else:  # amx
            k = kh.view(n, h, N // 16, D // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)
            v = vh.view(n, h, D // 16, N // 2, 16, 2).permute(0, 1, 3, 5, 2, 4)
        return k.reshape(n, h, N, D), v.reshape(n, h, N, D)

    def _kv_to_halves(self, k: torch.Tensor, v: torch.Tensor):
        n, h, N, D = k.shape
        if self.isa in ("vec", "vec16"):
            kh = k.transpose(-1, -2)
            vh = v
        else:  # amx
            kh = k.reshape(n, h, N // 16, 16, D // 2, 2).permute(0, 1, 2, 4, 3, 5)
            vh = v.reshape(n, h, N // 2, 2, D // 16, 16).permute(0, 1, 4, 2, 5, 3)
        return kh.reshape(n, h, N * D), vh.reshape(n, h, N * D)

    def read_blocks(self, layer_cache, block_ids):
        """K, V, each [len(block_ids), num_kv_heads, block_size, head_dim] (new tensors)."""
        self._check_cache(layer_cache)
        ids = _as_index(block_ids, layer_cache.device)
        n, ND = ids.numel(), self.block_size * self.head_dim
        slabs = layer_cache.index_select(0, ids).reshape(n, self.num_kv_heads, 2 * ND)
        return self._halves_to_kv(slabs[..., :ND], slabs[..., ND:])

    def kv_views(self, layer_cache):
        """K, V of the WHOLE layer as logical [num_blocks, H, N, D] views (no copy): the
        transform's input. Only ``vec``/``vec16``: the amx packing is not a strided view
        (use :class:`TransformSource`, which gathers the requested blocks instead)."""
        self._check_cache(layer_cache)
        if not self.strided:
            raise NotImplementedError(
                f"kv_views: CPU_ATTN isa={self.isa!r} is not expressible as a strided view; "
                "read it through TransformSource (gathers the requested blocks)"
            )
        nb, h, N, D = layer_cache.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        slabs = layer_cache.reshape(nb, h, 2 * N * D)
        return slabs[..., : N * D].view(nb, h, D, N).transpose(-1, -2), slabs[..., N * D :].view(nb, h, N, D)

    def write_blocks(self, layer_cache, block_ids, k, v) -> None:
        """Store K, V [len(block_ids), num_kv_heads, block_size, head_dim] as the kernel would."""
        self._check_cache(layer_cache)
        ids = _as_index(block_ids, layer_cache.device)
        self._check_kv(k, v, ids.numel())
        kh, vh = self._kv_to_halves(k.to(self.dtype), v.to(self.dtype))
        slabs = torch.cat([kh, vh], dim=-1).view(ids.numel(), self.num_kv_heads, self.block_size, 2 * self.head_dim)
        layer_cache[ids] = slabs


# --------------------------------------------------------------------------- transform input


class TransformSource:
    """What the prefill transform reads for one request, whatever the source layout.

    ``select(block_ids)`` returns ``(layers, ids)``: per layer logical ``(K, V)``
    ``[*, num_kv_heads, block_size, head_dim]`` and the block ids to index them with
    (``transform_kv(layers, ids, ...)``). When every layer's layout is strided (vec,
    vec16, FLASH_ATTN) these are the whole layers' zero-copy ``kv_views`` and the ids
    unchanged; otherwise (CPU_ATTN amx) K and V of just those blocks, gathered into new
    tensors by ``read_blocks`` (one copy of ``len(block_ids)`` blocks per layer), and ids
    ``0..n-1``. ``TransformSource.of_views(views)`` wraps ready-made strided views.
    """

    def __init__(
        self,
        adapters: Sequence[SourceKVLayout] = (),
        caches: Sequence[torch.Tensor] = (),
        views: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        if len(adapters) != len(caches):
            raise ValueError(f"TransformSource: {len(adapters)} adapters for {len(caches)} caches")
        self.adapters, self.caches = list(adapters), list(caches)
        if views is None and all(a.strided for a in self.adapters):
            views = [a.kv_views(c) for a, c in zip(self.adapters, self.caches, strict=False)]
        self.views = None if views is None else list(views)
        self.derived: dict = {}  # caches of data derived once from the views (the transform's kernel views)

    @classmethod
    def of_views(cls, views: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> TransformSource:
        return cls(views=views)

    @property
    def zero_copy(self) -> bool:
        """True when ``select`` returns views of the caches (no gather)."""
        return self.views is not None

    @property
    def num_layers(self) -> int:
        return len(self.views) if self.views is not None else len(self.caches)

    @property
    def device(self) -> torch.device:
        """Where the caches are (every layer on one device)."""
        return (self.views[0][0] if self.views is not None else self.caches[0]).device

    @property
    def num_blocks(self) -> int:
        return int(self.views[0][0].shape[0] if self.views is not None else self.caches[0].shape[0])

    def heads(self, start: int, count: int) -> TransformSource:
        """The same caches restricted to KV heads ``[start, start + count)`` (no copy: head
        slices of the views, or of the caches for gathered layouts; dim 1 is heads in
        every vLLM 0.32 layer cache ``[num_blocks, H, N, C]``)."""
        if self.views is not None:
            return TransformSource.of_views(
                [(k[:, start : start + count], v[:, start : start + count]) for k, v in self.views]
            )
        from dataclasses import replace

        return TransformSource(
            [replace(a, num_kv_heads=count) for a in self.adapters], [c[:, start : start + count] for c in self.caches]
        )

    def select(self, block_ids) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], np.ndarray]:
        """(per-layer logical (K, V), ids into them) for the blocks ``block_ids`` (1-D)."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if self.views is not None:
            return self.views, ids
        idx = torch.from_numpy(ids)
        layers = [a.read_blocks(c, idx) for a, c in zip(self.adapters, self.caches, strict=False)]
        return layers, np.arange(ids.size, dtype=np.int64)


def as_transform_source(x) -> TransformSource:
    """A :class:`TransformSource` as is; a list of per-layer (K, V) strided views wrapped."""
    return x if isinstance(x, TransformSource) else TransformSource.of_views(x)


# --------------------------------------------------------------------------- FLASH_ATTN

#: vLLM 0.32 ``KVCacheLayout`` names: physical order of [L, B, H, N, C].
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),  # "HND"
    "LBNHC": (0, 1, 3, 2, 4),  # "NHD" (FlashAttention's default)
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass
class FlashAttnKVLayout(_Base):
    """vLLM 0.32 ``FLASH_ATTN`` layout: layer cache ``[num_blocks, H, N, 2*D]`` where
    channels ``[:D]`` are K and ``[D:]`` are V of that (block, head, token).

    Read through the logical view, so any ``KVCacheLayout`` (physical order of B, H, N:
    NHD = LBNHC is the default, HND = LBHNC, and the cross-layer BL*/head-outer variants)
    works; ``block_byte_ranges`` follows the view's strides. K and V of a token are
    interleaved at head_dim granularity, so a block's byte runs hold both.
    """

    name: ClassVar[str] = "FLASH_ATTN"

    def read_blocks(self, layer_cache, block_ids):
        """K, V, each [len(block_ids), num_kv_heads, block_size, head_dim] (new tensors)."""
        self._check_cache(layer_cache)
        sel = layer_cache.index_select(0, _as_index(block_ids, layer_cache.device))
        D = self.head_dim
        return sel[..., :D].contiguous(), sel[..., D:].contiguous()

    def kv_views(self, layer_cache):
        """K, V of the WHOLE layer as logical [num_blocks, H, N, D] views (no copy)."""
        self._check_cache(layer_cache)
        return layer_cache[..., : self.head_dim], layer_cache[..., self.head_dim :]

    def write_blocks(self, layer_cache, block_ids, k, v) -> None:
        """Store K, V [len(block_ids), num_kv_heads, block_size, head_dim]."""
        self._check_cache(layer_cache)
        ids = _as_index(block_ids, layer_cache.device)
        self._check_kv(k, v, ids.numel())
        layer_cache[ids] = torch.cat([k.to(self.dtype), v.to(self.dtype)], dim=-1)


@dataclass
class FlashInferKVLayout(FlashAttnKVLayout):
    """vLLM 0.32 ``FLASHINFER`` layout: logically the same ``[num_blocks, H, N, 2*D]`` with
    K in channels ``[:D]`` and V in ``[D:]`` (see the module doc), any ``KVCacheLayout``:
    HND (LBHNC/BLHNC) on Blackwell, the resolved default elsewhere."""

    name: ClassVar[str] = "FLASHINFER"

    def __post_init__(self) -> None:
        if self.dtype == torch.uint8:  # FlashInfer's NVFP4 cache: K and V heads, not channels
            raise NotImplementedError(
                "FLASHINFER NVFP4 KV cache (uint8) is not a source layout; serve with --kv-cache-dtype auto"
            )


@dataclass
class TritonAttnKVLayout(FlashAttnKVLayout):
    """vLLM 0.32 ``TRITON_ATTN`` layout: logically the same ``[num_blocks, H, N, 2*D]`` with
    K in channels ``[:D]`` and V in ``[D:]`` (see the module doc), any ``KVCacheLayout``.
    A per-token-head quantized cache (C = 2 * (D + scale padding)) fails the shape check."""

    name: ClassVar[str] = "TRITON_ATTN"


def make_layer_caches(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    channels: int,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "LBNHC",
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """Per-layer ``[num_blocks, H, N, C]`` views of one zeroed buffer, strided like vLLM
    0.32 lays out ``layout`` (dense, no page padding). For tests and emulation."""
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"unknown KV cache layout {layout!r}; known: {', '.join(KV_CACHE_LAYOUTS)}")
    shape = (num_layers, num_blocks, num_kv_heads, block_size, channels)
    order = KV_CACHE_LAYOUTS[layout]
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    buf = torch.zeros(step, dtype=dtype, device=device)
    view = buf.as_strided(shape, strides)
    return [view[i] for i in range(num_layers)]


# --------------------------------------------------------------------------- factory

_BACKENDS = {
    "CPU_ATTN": CpuAttnKVLayout,
    "FLASH_ATTN": FlashAttnKVLayout,
    "FLASHINFER": FlashInferKVLayout,
    "TRITON_ATTN": TritonAttnKVLayout,
}


def source_layout_for(
    backend_name: str,
    *,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    **kwargs,
) -> SourceKVLayout:
    """The adapter for vLLM attention backend ``backend_name`` (``AttentionBackend.get_name()``:
    ``"CPU_ATTN"``, ``"FLASH_ATTN"``, ``"FLASHINFER"``, ``"TRITON_ATTN"``). Extra kwargs go to the adapter (``isa=`` for
    CPU_ATTN). Raises ``NotImplementedError`` naming the supported backends otherwise."""
    cls = _BACKENDS.get(backend_name.upper())
    if cls is None:
        raise NotImplementedError(
            f"no source KV layout for vLLM attention backend {backend_name!r}; supported: {', '.join(_BACKENDS)}"
        )
    return cls(num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim, dtype=dtype, **kwargs)


def source_layout_from_layer(layer, layer_cache: torch.Tensor | None = None) -> SourceKVLayout:
    """Adapter for a live vLLM ``Attention`` layer (worker side, after KV cache init).

    Uses the layer's backend name, ``num_kv_heads``, ``head_size``, its bound cache
    (block size, dtype) and, for CPU_ATTN, the ``isa`` the metadata builder stored on it.
    """
    cache = layer.kv_cache if layer_cache is None else layer_cache
    if isinstance(cache, (list, tuple)):  # older vLLMs: one entry per virtual engine
        cache = cache[0]
    name = layer.attn_backend.get_name()
    kwargs = {}
    if name == "CPU_ATTN" and getattr(layer, "isa", None) is not None:
        kwargs["isa"] = layer.isa
    return source_layout_for(
        name,
        num_kv_heads=layer.num_kv_heads,
        block_size=cache.shape[2],
        head_dim=layer.head_size,
        dtype=cache.dtype,
        **kwargs,
    )
