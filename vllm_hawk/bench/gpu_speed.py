"""The transform's speed on a device against a plain device copy of the same source
bytes: what ``scripts/gpu_check.py --suite full`` measures after the matrix.

Per workload (:data:`WORKLOADS`: Llama-3.1-8B TP1 16-token source blocks -> 64-token
destination blocks at 4,096 tokens; Llama-3.1-70B TP4 64 -> 64 at 160 MB of bf16 KV), block
order (contiguous or scattered source blocks), destination dtype and ``impl``
(``auto``: the Triton kernel on CUDA, numba on the CPU; ``torch``), one request's G' by
:func:`~vllm_hawk.transform.transform_source`, repeated:

* ``transform_gbps`` / ``copy_gbps``: source bytes / median time (CUDA events on the
  current stream on a GPU; ``time.perf_counter`` around the call on the CPU, ``timer``
  says which); ``ratio``: copy time / transform time within each repeat, median;
* ``host_ms``: wall time the Python call holds the calling thread (before the device
  has run the work on a GPU), median;
* ``kernels``, ``copies``: device kernels and memcpy/memset operations of one request,
  counted by ``torch.profiler`` on CUDA (None on the CPU);
* ``peak_mb``: growth of ``torch.cuda.max_memory_allocated`` over one request (None on
  the CPU);
* ``bytes_equal_torch``: G' equals the torch path's on the same device.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hawk.bench.gpu_matrix import random_sources, tt_plan
from vllm_hawk.layout.model_shapes import load_model_shape
from vllm_hawk.transform import transform_source

__all__ = ["WORKLOADS", "Workload", "cpu_workloads", "speed_rows"]


@dataclass(frozen=True)
class Workload:
    """One request's geometry on one rank: layers, KV heads, head_dim, source and
    destination block sizes (tokens) and the request's tokens."""

    name: str
    layers: int
    heads: int
    head_dim: int
    src_block_size: int
    dst_block_size: int
    tokens: int

    @property
    def source_nbytes(self) -> int:
        """bf16 K+V bytes of the request's source blocks."""
        n = -(-self.tokens // self.src_block_size) * self.src_block_size
        return n * self.layers * 2 * self.heads * self.head_dim * 2


def _model(name: str, model: str, tp: int, sbs: int, dbs: int, tokens: int = 0, source_mb: float = 0) -> Workload:
    s = load_model_shape(model)
    heads = s.kv_heads_per_rank(tp)
    if not tokens:  # whole source blocks of about source_mb MB
        tokens = max(1, round(source_mb * 1e6 / s.kv_bytes_per_token(tp, 2) / sbs)) * sbs
    return Workload(name, s.num_layers, heads, s.head_dim, sbs, dbs, tokens)


def gpu_workloads() -> list[Workload]:
    return [
        _model("llama-8b-tp1-16to64-4k", "llama-3.1-8b", 1, 16, 64, tokens=4096),
        _model("llama-70b-tp4-64to64-160mb", "llama-3.1-70b", 4, 64, 64, source_mb=160),
    ]


def cpu_workloads() -> list[Workload]:
    """The same two shapes, small (CI): 2 layers, 2 heads, head_dim 64, about 100 tokens."""
    return [Workload("small-16to64", 2, 2, 64, 16, 64, 100), Workload("small-64to64", 2, 2, 64, 64, 64, 128)]


WORKLOADS = gpu_workloads


class _Clock:
    """Device time of a callable: CUDA events on the current stream, else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.name = "cuda-events" if self.cuda else "cpu-perf-counter"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn) -> tuple[float, float]:
        """(device seconds, host seconds the call held this thread)."""
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            return dt, dt
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, host


def count_device_ops(fn, device: torch.device) -> tuple[int | None, int | None, str]:
    """(kernels, memcpy/memset operations, note) of one call, from ``torch.profiler``'s
    CUDA activities; (None, None, why) on the CPU or where the profiler fails."""
    if device.type != "cuda":
        return None, None, "no device kernels on the CPU"
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - no CUPTI here: report it, keep measuring
        return None, None, f"torch.profiler failed: {type(e).__name__}: {str(e)[:160]}"
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(1 for n in names if n.startswith(("Memcpy", "Memset")))
    return len(names) - copies, copies, ""


def _peak_mb(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def _one(w: Workload, order: str, dtype: str, impl: str, src, device, repeats: int, copy) -> dict:
    dev, n, cache_blocks = src
    rng = np.random.default_rng(2)
    ids = rng.permutation(cache_blocks)[:n] if order == "scattered" else np.arange(1, n + 1)
    n_dst = -(-w.tokens // w.dst_block_size)
    plan = tt_plan(w.layers, w.heads, w.dst_block_size, w.head_dim, dtype, rng.permutation(n_dst + 2)[:n_dst])
    out = torch.empty(plan.total_nbytes, dtype=torch.uint8, device=device)
    ref = torch.empty_like(out)

    def run(impl_=impl, out_=out):
        transform_source(dev, ids, w.src_block_size, plan, out_, impl=impl_, memo={})

    clock = _Clock(device)
    run()  # compile / warm
    run(impl_="torch", out_=ref)
    clock.sync()
    kernels, copies, note = count_device_ops(run, device)
    peak = _peak_mb(run, device)
    tr, host, cp = [], [], []
    for _ in range(max(1, repeats)):
        cp.append(clock(copy)[0])
        d, h = clock(run)
        tr.append(d)
        host.append(h)
    nbytes = w.source_nbytes
    row = {"workload": w.name, "order": order, "dtype": dtype, "impl": impl, "timer": clock.name}
    row.update(source_mb=nbytes / 1e6, gprime_mb=plan.total_nbytes / 1e6, bytes_equal_torch=bool(torch.equal(out, ref)))
    row.update(copy_gbps=nbytes / statistics.median(cp) / 1e9, transform_gbps=nbytes / statistics.median(tr) / 1e9)
    row.update(
        ratio=statistics.median(c / t for c, t in zip(cp, tr, strict=True)), host_ms=1e3 * statistics.median(host)
    )
    row.update(kernels=kernels, copies=copies, peak_mb=peak)
    if note:
        row["note"] = note
    return row


def _workload_rows(w: Workload, device, dtypes, impls, repeats: int, deadline, skipped: list) -> list:
    n = -(-w.tokens // w.src_block_size)
    cache_blocks = 2 * n + 2
    dev, _host = random_sources("LBNHC", w.layers, cache_blocks, w.heads, w.src_block_size, w.head_dim, device)
    a = torch.empty(w.source_nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    rows = []
    for order in ("contiguous", "scattered"):
        for dtype in dtypes:
            for impl in impls:
                if deadline is not None and time.monotonic() > deadline:
                    skipped.append(f"{w.name} {order} {dtype} {impl}: over the time budget")
                    continue
                rows.append(_one(w, order, dtype, impl, (dev, n, cache_blocks), device, repeats, lambda: b.copy_(a)))
    return rows


def speed_rows(device, workloads, dtypes, impls, repeats: int, deadline: float | None = None) -> tuple[list, list]:
    """One row per (workload, block order, dtype, impl) (see the module doc); stops at
    ``deadline`` (``time.monotonic``). Returns (rows, what was skipped)."""
    device = torch.device(device)
    rows, skipped = [], []
    for w in workloads:  # one workload's caches at a time
        rows += _workload_rows(w, device, dtypes, impls, repeats, deadline, skipped)
    return rows, skipped
