"""CPU fast path of the transform: one fused pass per (layer, K|V) that reads each
destination tile's 32x32 elements straight from the source cache, converts or
block-float packs them, and writes the tile's bytes at its place in G'.

Compiled with numba (a vLLM dependency) and run in parallel over tiles. It computes
exactly what the torch path computes (tests compare both byte for byte, and the bf16
block-float arithmetic against every bf16 bit pattern); the torch path stays the
reference and the implementation used on CUDA devices.

What a source looks like to the kernel is a :class:`KernelViews`: per storage, the
storage as unsigned ints and, per view (slot s = 2*layer + K|V), its element offset,
block and head strides and two offset tables (token -> offset, dim -> offset). It is
built ONCE per cache (:meth:`KernelViews.of_views` from strided torch views,
:meth:`KernelViews.of_amx` straight from vLLM's packed CPU AMX layout) — a prefill's
views never change — so a request pays no per-view Python calls.

Source elements: bf16 (uint16 bits) or float32 (uint32 bits). Target codes: see TARGET.
The numba cache lives in ``$HAWK_CACHE/numba`` (``NUMBA_CACHE_DIR`` overrides;
:func:`vllm_hawk.envs.numba_cache_dir`), so the compiled kernels survive across processes
even when the package is installed read-only.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hawk import envs

# numba is imported on first use, not with this module: vLLM 0.32's CPU worker scans
# every loaded module when it registers its kernel overrides (model-runner init) and
# trips over an llvmlite object (vllm/triton_utils/dispatcher.py, _rebind_kernels). A
# transform only runs after the engine is up, so importing numba then is safe.
_HAVE_NUMBA = importlib.util.find_spec("numba") is not None

TARGET = {"bfloat16": 0, "bfloat8_b": 1, "bfloat4_b": 2, "float32": 3}
SOURCE_DTYPES = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
# numba's default "workqueue" threading layer must not be entered from two threads at
# once; the kernel already uses every core, so callers take turns.
_KERNEL_LOCK = threading.Lock()


def available(x: torch.Tensor) -> bool:
    return _HAVE_NUMBA and x.device.type == "cpu" and x.dtype in SOURCE_DTYPES


def _kernels():
    if "numba" not in __import__("sys").modules:
        envs.use_numba_cache()
    from vllm_hawk.transform import cpu_kernel_numba

    return cpu_kernel_numba


def storage_bits(x: torch.Tensor) -> np.ndarray:
    """The whole storage under ``x`` as an unsigned-int numpy array (no copy)."""
    n = x.untyped_storage().nbytes() // x.element_size()
    flat = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, (n,), (1,))
    a = flat.view(SOURCE_DTYPES[x.dtype]).numpy()
    return a.view(np.uint16 if x.dtype == torch.bfloat16 else np.uint32)


@dataclass
class _Group:
    """Views that share one storage: the storage bits and per-view metadata (uint64)."""

    src: np.ndarray  # uint16 (bf16) or uint32 (float32) over the whole storage
    src64: np.ndarray  # uint64 view of src (bf16 only; empty when not 8-byte sized)
    bf16: bool
    slots: np.ndarray
    bases: np.ndarray
    sbs: np.ndarray
    shs: np.ndarray
    kinds: np.ndarray  # uint8: 0 rows, 1 transposed, 2 tables
    sts: np.ndarray
    sds: np.ndarray
    tok_off: np.ndarray  # [views, tokens]
    dim_off: np.ndarray  # [views, head_dim]
    keep: object = None  # the storage owner, kept alive

    def subset(self, lo: int, hi: int) -> _Group | None:
        """The views whose slot is in [lo, hi), or None."""
        sel = (self.slots >= lo) & (self.slots < hi)
        if not sel.any():
            return None
        if sel.all():
            return self
        f = lambda a: np.ascontiguousarray(a[sel])  # noqa: E731
        return _Group(
            self.src,
            self.src64,
            self.bf16,
            f(self.slots),
            f(self.bases),
            f(self.sbs),
            f(self.shs),
            f(self.kinds),
            f(self.sts),
            f(self.sds),
            f(self.tok_off),
            f(self.dim_off),
            self.keep,
        )


def _kind(tok_off: np.ndarray, dim_off: np.ndarray) -> tuple[int, int, int]:
    """(kind, token stride, dim stride) of one view's offset tables."""
    n, d = tok_off.size, dim_off.size
    st = int(tok_off[1] - tok_off[0]) if n > 1 else 0
    sd = int(dim_off[1] - dim_off[0]) if d > 1 else 0
    if (dim_off == np.arange(d)).all() and (tok_off == np.arange(n) * st).all():
        return 0, st, 1
    if (tok_off == np.arange(n)).all() and (dim_off == np.arange(d) * sd).all():
        return 1, 1, sd
    return 2, st, sd


def _group(src_tensor: torch.Tensor, slots, bases, sbs, shs, tok, dim) -> _Group:
    src = storage_bits(src_tensor)
    bf16 = src_tensor.dtype == torch.bfloat16
    src64 = (
        src.view(np.uint64) if bf16 and src.size % 4 == 0 and src.ctypes.data % 8 == 0 else np.zeros(0, dtype=np.uint64)
    )
    tok, dim = np.asarray(tok, dtype=np.int64), np.asarray(dim, dtype=np.int64)
    kinds = [_kind(t, d) for t, d in zip(tok, dim, strict=False)]
    u = lambda a: np.ascontiguousarray(a, dtype=np.uint64)  # noqa: E731
    return _Group(
        src,
        src64,
        bf16,
        u(slots),
        u(bases),
        u(sbs),
        u(shs),
        np.array([k[0] for k in kinds], np.uint8),
        u([k[1] for k in kinds]),
        u([k[2] for k in kinds]),
        u(tok),
        u(dim),
        src_tensor,
    )


class KernelViews:
    """A source cache as the kernel reads it (see module doc). Built once per cache."""

    def __init__(self, groups: list[_Group], num_slots: int, tokens: int, head_dim: int) -> None:
        self.groups, self.num_slots, self.tokens, self.head_dim = groups, num_slots, tokens, head_dim

    @classmethod
    def of_views(cls, views) -> KernelViews:
        """From per-layer (K, V) logical strided views ``[blocks, H, N, D]`` (CPU tensors,
        bf16 or float32); raises ValueError for anything else."""
        flat = [x for pair in views for x in pair]
        by_storage: dict[tuple[int, torch.dtype], list[int]] = {}
        for s, x in enumerate(flat):
            if not available(x):
                raise ValueError(f"cpu_kernel transform: unsupported source {x.dtype} on {x.device}")
            if x.dim() != 4 or min(x.stride()) < 0:
                raise ValueError("cpu_kernel transform: views must be 4-D with non-negative strides")
            by_storage.setdefault((x.untyped_storage().data_ptr(), x.dtype), []).append(s)
        n, d = flat[0].shape[2], flat[0].shape[3]
        groups = []
        for ids in by_storage.values():
            xs = [flat[s] for s in ids]
            groups.append(
                _group(
                    xs[0],
                    ids,
                    [x.storage_offset() for x in xs],
                    [x.stride(0) for x in xs],
                    [x.stride(1) for x in xs],
                    [np.arange(n) * x.stride(2) for x in xs],
                    [np.arange(d) * x.stride(3) for x in xs],
                )
            )
        return cls(groups, len(flat), n, d)

    @classmethod
    def of_amx(cls, caches, block_size: int, head_dim: int) -> KernelViews:
        """vLLM 0.32's CPU ``amx`` layout read in place (bf16 layer caches ``[B, H, N, 2D]``,
        LBHNC; see :class:`~vllm_hawk.layout.vllm_kv.CpuAttnKVLayout`): K ``[N/16, D/2, 16, 2]``
        and V ``[D/16, N/2, 16, 2]`` per (block, head) half."""
        N, D = block_size, head_dim
        t, d = np.arange(N), np.arange(D)
        k_tok, k_dim = (t // 16) * (D // 2) * 32 + (t % 16) * 2, (d // 2) * 32 + d % 2
        v_tok, v_dim = (t // 2) * 32 + t % 2, (d // 16) * (N // 2) * 32 + (d % 16) * 2
        by_storage: dict[int, list] = {}
        for layer, c in enumerate(caches):
            if (
                c.dtype != torch.bfloat16
                or c.device.type != "cpu"
                or c.dim() != 4
                or c.stride(3) != 1
                or c.stride(2) != 2 * D
                or c.stride(1) != 2 * N * D
            ):
                raise ValueError(
                    "cpu_kernel amx source: bf16 CPU caches [B, H, N, 2D] with dense (block, head) slabs expected"
                )
            by_storage.setdefault(c.untyped_storage().data_ptr(), []).append((layer, c))
        groups = []
        for items in by_storage.values():
            slots, bases, sbs, shs, tok, dim = [], [], [], [], [], []
            for layer, c in items:
                for kv, (to, do) in enumerate(((k_tok, k_dim), (v_tok, v_dim))):
                    slots.append(2 * layer + kv)
                    bases.append(c.storage_offset() + kv * N * D)
                    sbs.append(c.stride(0))
                    shs.append(c.stride(1))
                    tok.append(to)
                    dim.append(do)
            groups.append(_group(items[0][1], slots, bases, sbs, shs, tok, dim))
        return cls(groups, 2 * len(caches), N, D)


def views_for(source) -> KernelViews | None:
    """The kernel views of a :class:`~vllm_hawk.layout.vllm_kv.TransformSource`, built on
    first use and kept in ``source.derived``; None where the kernel cannot read it
    (no numba, CUDA tensors, other dtypes)."""
    d = source.derived
    if "kernel_views" not in d:
        kv = None
        if _HAVE_NUMBA:
            try:
                if source.views is not None:
                    kv = KernelViews.of_views(source.views)
                elif source.adapters and all(getattr(a, "isa", None) == "amx" for a in source.adapters):
                    a = source.adapters[0]
                    kv = KernelViews.of_amx(source.caches, a.block_size, a.head_dim)
            except ValueError:
                kv = None
        d["kernel_views"] = kv
    return d["kernel_views"]


def tile_args(idx: tuple[np.ndarray, ...], first: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-tile kernel arguments in source order (sorted by block, head, token, dim tile):
    uint64 ``blk, head, tr, tc, first, step`` and uint8 ``valid``."""
    blk, head, tr, tc, valid = idx
    order = np.lexsort((tc, tr, head, blk))
    u = lambda a: np.ascontiguousarray(np.asarray(a)[order], dtype=np.uint64)  # noqa: E731
    return (
        u(blk),
        u(head),
        u(tr),
        u(tc),
        np.ascontiguousarray(np.asarray(valid)[order], dtype=np.uint8),
        u(first),
        u(step),
    )


def launch(
    kv: KernelViews, args: tuple[np.ndarray, ...], out: torch.Tensor, dtype: str, layers: tuple[int, int] | None = None
) -> None:
    """Run the kernels for tile arguments ``args`` (:func:`tile_args`) into ``out``."""
    blk, head, tr, tc, valid, first, step = args
    lo, hi = (0, kv.num_slots) if layers is None else (2 * layers[0], 2 * layers[1])
    out_np = out.numpy()
    out16 = out_np.view(np.uint16) if out_np.size % 2 == 0 else np.zeros(0, np.uint16)
    out64 = out_np.view(np.uint64) if out_np.size % 8 == 0 and out_np.ctypes.data % 8 == 0 else np.zeros(0, np.uint64)
    k = _kernels()
    target = TARGET[dtype]
    with _KERNEL_LOCK:
        for g0 in kv.groups:
            g = g0.subset(lo, hi)
            if g is None:
                continue
            if g.bf16 and target != 3:
                if target == 0 and out16.size == 0:
                    raise ValueError("bfloat16 G' must have an even size")
                k.transform_bf16(
                    g.src,
                    g.src64,
                    g.bases,
                    g.sbs,
                    g.shs,
                    g.kinds,
                    g.sts,
                    g.sds,
                    g.tok_off,
                    g.dim_off,
                    g.slots,
                    blk,
                    head,
                    tr,
                    tc,
                    valid,
                    out_np,
                    out16,
                    out64,
                    first,
                    step,
                    target,
                )
            else:  # float32 sources (and the float32 target, which no KV cache uses)
                src = g.src if not g.bf16 else g.src.astype(np.uint32) << np.uint32(16)
                k.transform_f32(
                    src,
                    g.bases,
                    g.sbs,
                    g.shs,
                    g.kinds,
                    g.sts,
                    g.sds,
                    g.tok_off,
                    g.dim_off,
                    g.slots,
                    blk,
                    head,
                    tr,
                    tc,
                    valid,
                    out_np,
                    first,
                    step,
                    target,
                )


def run(
    kv: KernelViews,
    idx: tuple[np.ndarray, ...],
    out: torch.Tensor,
    first: np.ndarray,
    step: np.ndarray,
    dtype: str,
    layers: tuple[int, int] | None = None,
) -> None:
    """Write, for every view (slot s) and every tile k, source tile ``(blk, head, tr, tc)``
    of ``idx`` packed as ``dtype`` at byte ``first[k] + s * step[k]`` of ``out`` (uint8,
    CPU); ``valid[k] == 0`` writes a zero tile. ``layers=(a, b)``: only layers a..b-1.
    Tiles are processed in source order."""
    launch(kv, tile_args(idx, first, step), out, dtype, layers)


def pack_tiles_bf16(tiles: torch.Tensor, dtype: str) -> torch.Tensor:
    """Face-ordered bf16 tiles ``[n, 1024]`` -> block-float bytes with the kernel's
    arithmetic (tests compare it with :func:`~vllm_hawk.layout.formats.pack_tiles`)."""
    from vllm_hawk.layout.formats import tile_format

    fmt = tile_format(dtype)
    bits = tiles.contiguous().view(torch.int16).numpy().view(np.uint16)
    out = np.zeros((bits.shape[0], fmt.tile_nbytes), dtype=np.uint8)
    _kernels().pack_tiles_bf16(bits, out, fmt.mantissa_bits)
    return torch.from_numpy(out)


def warm_in_child(modules: tuple[str, ...] = (__name__,), timeout_s: float = 900.0) -> bool:
    """Compile every kernel signature the ``warm()`` of each of ``modules`` covers (default:
    this module's :func:`warm`) in a child process, into the shared numba cache (True when
    the child succeeded). numba compiles holding the GIL: in the process that serves a
    side channel, a cold compile (50 s on a loaded 2-core host) starved the side channel's
    thread; loading the cached kernels afterwards took 2.6 s there."""
    if not _HAVE_NUMBA:
        return False
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=envs.numba_cache_dir())
    code = f"import importlib\nfor m in {list(modules)!r}:\n    importlib.import_module(m).warm()"
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, timeout=timeout_s, capture_output=True)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def warm() -> None:
    """Compile (or load) every kernel signature the transform uses."""
    if not _HAVE_NUMBA:
        return
    x = torch.zeros(2, 1, 32, 64, dtype=torch.bfloat16)
    for views in ([(x[..., :32], x[..., 32:])], [(x[..., :32].float(), x[..., 32:].float())]):
        kv = KernelViews.of_views(views)
        z = np.zeros(1, dtype=np.int64)
        for dtype in ("bfloat16", "bfloat8_b", "bfloat4_b"):
            tb = {"bfloat16": 2048, "bfloat8_b": 1088, "bfloat4_b": 576}[dtype]
            out = torch.empty(2 * tb, dtype=torch.uint8)
            run(kv, (z, z, z, z, np.ones(1, np.bool_)), out, z, np.full(1, tb), dtype)
