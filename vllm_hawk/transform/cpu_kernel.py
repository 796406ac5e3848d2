"""CPU fast path of the transform: one fused pass per (layer, K|V) that reads each
destination tile's 32x32 elements straight from the strided source cache, converts or
block-float packs them, and writes the tile's bytes at its place in G'.

Compiled with numba (a vLLM dependency) and run in parallel over tiles. It computes
exactly what the torch path computes (tests compare both byte for byte); the torch path
stays the reference and the implementation used on CUDA devices.

Source elements: bf16 (uint16 bits) or float32 (uint32 bits). Target codes: see TARGET.
"""
from __future__ import annotations

import importlib.util
import threading

import numpy as np
import torch

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


def storage_bits(x: torch.Tensor) -> np.ndarray:
    """The whole storage under ``x`` as an unsigned-int numpy array (no copy)."""
    n = x.untyped_storage().nbytes() // x.element_size()
    flat = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, (n,), (1,))
    a = flat.view(SOURCE_DTYPES[x.dtype]).numpy()
    return a.view(np.uint16 if x.dtype == torch.bfloat16 else np.uint32)


def gather_pack(views: list[torch.Tensor], idx: tuple[np.ndarray, ...], out: torch.Tensor,
                first: np.ndarray, step: np.ndarray, dtype: str) -> None:
    """Write, for every view ``views[s]`` (logical [blocks, H, bs, D], slot s = 2*layer+kv)
    and every tile k, tile ``x[blk, head, tr*32:+32, tc*32:+32]`` packed as ``dtype`` at
    byte ``first[k] + s * step[k]`` of ``out`` (uint8, CPU). Views that share one storage
    (vLLM keeps all layers in one buffer) are done in a single parallel kernel call."""
    blk, head, tr, tc, valid = idx
    valid = valid.astype(np.bool_)
    groups: dict[tuple[int, torch.dtype], list[int]] = {}
    for s, x in enumerate(views):
        if not available(x):
            raise ValueError(f"cpu_kernel transform: unsupported source {x.dtype} on {x.device}")
        groups.setdefault((x.untyped_storage().data_ptr(), x.dtype), []).append(s)
    out_np = out.numpy()
    with _KERNEL_LOCK:
        _run_groups(views, groups, blk, head, tr, tc, valid, out_np, first, step, dtype)


def _run_groups(views, groups, blk, head, tr, tc, valid, out_np, first, step, dtype) -> None:
    from vllm_hawk.transform.cpu_kernel_numba import gather_copy16, gather_copy64, gather_pack
    for slot_ids in groups.values():
        x0 = views[slot_ids[0]]
        src = storage_bits(x0)
        bases = np.array([views[s].storage_offset() for s in slot_ids], dtype=np.int64)
        strides = np.array([views[s].stride() for s in slot_ids], dtype=np.int64).reshape(-1, 4)
        slots = np.asarray(slot_ids, dtype=np.int64)
        if dtype == "bfloat16" and x0.dtype == torch.bfloat16:
            if (strides[:, 3] == 1).all() and not (bases % 4).any() and not (strides[:, :3] % 4).any() \
                    and src.size % 4 == 0:  # whole face rows are aligned uint64 words
                gather_copy64(src.view(np.uint64), bases // 4, strides // 4, slots, blk, head, tr, tc, valid,
                              out_np.view(np.uint64), first, step)
            else:
                gather_copy16(src, bases, strides, slots, blk, head, tr, tc, valid, out_np.view(np.uint16),
                              first, step)
        else:
            gather_pack(src, x0.dtype == torch.bfloat16, bases, strides, slots, blk, head, tr, tc, valid,
                         out_np, first, step, TARGET[dtype])
