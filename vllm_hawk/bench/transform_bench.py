"""``hawk bench transform``: the prefill-side transform against a plain torch copy of the
same bytes on the same device, in one run.

Source: a synthetic vLLM 0.32 KV cache in bf16, all layers in one buffer as vLLM
allocates it, read through the source-layout adapters: FlashAttention (NHD, what a GPU
prefill holds), the CPU backend's ``vec`` layout (K transposed inside each block/head
slab; ``vec16`` stores the same order) and its ``amx`` layout (packed; read in place by
the CPU kernel). The request's source and destination blocks are scattered over the caches.

Two timings per row, each as a ratio to the copy (copy time / transform time, so 1.0 =
copy speed, higher is better; the median over repeats of the ratio within each repeat,
where the copy, the kernel and the end-to-end transform run back to back):

* ``kernel``: the transform kernel alone (plan, tile index and kernel views prepared);
* ``e2e``: what the prefill runs per request (:class:`~vllm_hawk.kvflow.TileTransformSource`:
  transfer plan, tile index, kernel) into a pre-faulted ring range.

Throughput counts SOURCE bytes (the request's bf16 KV) for both the transform and the
copy, so the ratio is independent of the target dtype's smaller size. The copy uses
torch's threads (``torch.get_num_threads()``), the kernel numba's; CPU time (user + sys)
of each is reported with its ratio to the copy's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import numpy as np
import torch

from vllm_hawk.bench.common import print_table, progress, write_json
from vllm_hawk.layout.model_shapes import load_model_shape
from vllm_hawk.layout.vllm_kv import CpuAttnKVLayout, FlashAttnKVLayout, TransformSource, make_layer_caches
from vllm_hawk.layout_report import build_layout
from vllm_hawk.transform import cpu_kernel, make_plan, transform_source
from vllm_hawk.transform.kv_transform import kernel_tile_args, kernel_transform

SOURCES = ("flash", "cpu", "amx")
TARGET_RATIO = 0.5  # the target: end to end at >= 40 MB, at least half the copy's speed ...
TARGET_SOURCES = ("flash", "cpu")  # ... for FlashAttention and CPU vec (AMX is reported, not targeted)
TARGET_DTYPES = ("bfloat16", "bfloat8_b")
TARGET_MIN_MB = 40


def random_transform_source(kind: str, num_layers: int, num_blocks: int, heads: int, bs: int, dim: int, device):
    """A random bf16 cache of ``kind`` as the prefill reads it (a TransformSource)."""
    if kind == "flash":
        adapter, order = FlashAttnKVLayout(heads, bs, dim), "LBNHC"
    else:
        adapter, order = CpuAttnKVLayout(heads, bs, dim, isa="vec" if kind == "cpu" else "amx"), "LBHNC"
    caches = make_layer_caches(num_layers, num_blocks, heads, bs, 2 * dim, layout=order, device=device)
    for c in caches:  # layer by layer, tensor operations only (any device)
        c.copy_(torch.randn(c.shape, device=device))
    return TransformSource([adapter] * num_layers, caches)


def _once(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return t1 - t0, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


def _interleaved(fns: dict, repeats: int) -> dict:
    """Each repeat runs every fn once, in turn (so load changes hit all of them alike).
    Returns per name: median wall and CPU seconds and the per-repeat wall times."""
    for f in fns.values():  # warm-up
        f()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            w, c = _once(f)
            wall[k].append(w)
            cpu[k].append(c)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k]), wall[k]) for k in fns}


def _ratio(base: list[float], x: list[float]) -> float:
    """Median over repeats of base/x (pairs from the same repeat)."""
    return statistics.median(b / t for b, t in zip(base, x, strict=False))


def run(model, tp, device_profile, block_size, sizes_mb, dtypes, sources, repeats, device, seed=0):
    shape = load_model_shape(model)
    heads = shape.kv_heads_per_rank(tp)
    per_token = shape.kv_bytes_per_token(tp, 2)
    rng = np.random.default_rng(seed)
    cases = [(s, d, m) for s in sources for m in sizes_mb for d in dtypes]
    rows = []
    cache = {}
    for i, (src_kind, dtype, mb) in enumerate(cases):
        progress(i, len(cases), f"{src_kind} {dtype} {mb} MB")
        n_blocks = max(1, round(mb * 1e6 / per_token / block_size))
        cache_blocks = 2 * n_blocks + 2
        key = (src_kind, mb)
        if key not in cache:
            cache.clear()
            cache[key] = random_transform_source(
                src_kind, shape.num_layers, cache_blocks, heads, block_size, shape.head_dim, device
            )
        source = cache[key]
        src_blocks = rng.permutation(cache_blocks)[:n_blocks]
        dst_blocks = rng.permutation(cache_blocks)[:n_blocks]
        layout = build_layout(model, tp, device_profile, dtype, block_size, cache_blocks)
        plan = make_plan(layout, dst_blocks, "staged")
        out = torch.zeros(plan.total_nbytes, dtype=torch.uint8, device=device)  # pre-faulted, like the ring
        nbytes = int(n_blocks * block_size * per_token)
        a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        b = torch.zeros_like(a)
        sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)

        def e2e():  # what TileTransformSource.prepare + fill do
            p = make_plan(layout, dst_blocks, "staged")
            transform_source(source, src_blocks, block_size, p, out)
            sync()

        fns = {"copy": lambda: (b.copy_(a), sync()), "e2e": e2e}
        kv = cpu_kernel.views_for(source) if device.type == "cpu" else None
        if kv is not None:
            args = kernel_tile_args(plan, src_blocks, block_size)
            fns["kernel"] = lambda: kernel_transform(kv, src_blocks, block_size, plan, out, None, args)
        reps = max(repeats, int(repeats * 40 / max(mb, 1)))  # small sizes: more repeats, same time
        t = _interleaved(fns, reps)
        if "kernel" not in t:
            t["kernel"] = t["e2e"]
        (t_copy, c_copy, w_copy), (t_k, _c, w_k), (t_e2e, c_e2e, w_e2e) = t["copy"], t["kernel"], t["e2e"]
        rows.append(
            {
                "source": src_kind,
                "dtype": dtype,
                "size_mb": nbytes / 1e6,
                "blocks": n_blocks,
                "gprime_mb": plan.total_nbytes / 1e6,
                "repeats": reps,
                "copy_ms": t_copy * 1e3,
                "kernel_ms": t_k * 1e3,
                "e2e_ms": t_e2e * 1e3,
                "copy_gbps": nbytes / t_copy / 1e9,
                "kernel_gbps": nbytes / t_k / 1e9,
                "kernel_ratio": _ratio(w_copy, w_k),
                "e2e_ratio": _ratio(w_copy, w_e2e),
                "copy_cpu_ms": c_copy * 1e3,
                "e2e_cpu_ms": c_e2e * 1e3,
                "cpu_ratio": c_e2e / max(c_copy, 1e-9),
            }
        )
    progress(len(cases), len(cases), "done")
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The end-to-end targets this run can judge: one entry per targeted row."""
    return [
        {
            "target": f"{r['source']} {r['dtype']} e2e >= {TARGET_RATIO} x copy",
            "size_mb": r["size_mb"],
            "ratio": r["e2e_ratio"],
            "met": r["e2e_ratio"] >= TARGET_RATIO,
        }
        for r in rows
        if r["source"] in TARGET_SOURCES and r["dtype"] in TARGET_DTYPES and r["size_mb"] >= TARGET_MIN_MB * 0.9
    ]  # rows are whole blocks: 40 MB may be 37


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hawk bench transform", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--device-profile", default="p150a")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 40, 160])
    ap.add_argument(
        "--dtypes", nargs="+", default=["bfloat16", "bfloat8_b"], choices=["bfloat16", "bfloat8_b", "bfloat4_b"]
    )
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="results/bench_transform.json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cpu":
        cpu_kernel.warm()
    rows = run(a.model, a.tp, a.device_profile, a.block_size, a.sizes_mb, a.dtypes, a.sources, a.repeats, dev)
    load = os.getloadavg()
    print(
        f"transform vs plain copy of the same bytes on {a.device} ({torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} cores, load average {load[0]:.2f}), {a.model} TP={a.tp}, {a.device_profile}, "
        f"block {a.block_size}; ratio = copy time / transform time (1 = copy speed), median over >= "
        f"{a.repeats} repeats of the ratio within each repeat"
    )
    print_table(
        rows,
        [
            ("source", "source", ""),
            ("dtype", "dtype", ""),
            ("size_mb", "MB", ".1f"),
            ("gprime_mb", "G' MB", ".1f"),
            ("copy_ms", "copy ms", ".2f"),
            ("kernel_ms", "kernel ms", ".2f"),
            ("e2e_ms", "e2e ms", ".2f"),
            ("copy_gbps", "copy GB/s", ".2f"),
            ("kernel_ratio", "kernel/copy", ".2f"),
            ("e2e_ratio", "e2e/copy", ".2f"),
            ("cpu_ratio", "CPU time/copy's", ".2f"),
        ],
    )
    goals = targets(rows)
    if goals:
        print(f"\ntargets (ratios within this run; e2e at >= {TARGET_MIN_MB} MB):")
        for t in goals:
            print(f"  [{'met ' if t['met'] else 'MISS'}] {t['target']} @ {t['size_mb']:.0f} MB: ratio {t['ratio']:.2f}")
    path = write_json(
        a.out,
        {
            "bench": "transform",
            "device": a.device,
            "threads": torch.get_num_threads(),
            "load_average": load,
            "args": vars(a),
            "rows": rows,
            "targets": goals,
        },
    )
    print(f"wrote {path}")
    return 0
