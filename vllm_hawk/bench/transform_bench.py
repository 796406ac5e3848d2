"""``hawk bench transform``: throughput of the prefill-side transform versus a plain torch
copy of the same bytes on the same device, in one run.

Source: a synthetic vLLM 0.32 KV cache in bf16, all layers in one buffer as vLLM
allocates it, read through the source-layout adapters: FlashAttention (NHD, what a GPU
prefill holds) or the CPU backend (K transposed inside each block/head slab). The
request's source and destination blocks are scattered over the caches.
Throughput counts SOURCE bytes (the request's bf16 KV) for both the transform and the
copy, so the ratio is independent of the target dtype's smaller size.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from vllm_hawk.bench.common import median_seconds, print_table, progress, write_json
from vllm_hawk.layout.model_shapes import load_model_shape
from vllm_hawk.layout.vllm_kv import CpuAttnKVLayout, FlashAttnKVLayout, make_layer_caches
from vllm_hawk.layout_report import build_layout
from vllm_hawk.transform import make_plan, transform_kv

SOURCES = ("flash", "cpu")


def source_views(kind: str, num_layers: int, num_blocks: int, heads: int, bs: int, dim: int, device):
    """Per layer (K, V) logical views [num_blocks, heads, bs, dim] of a random bf16 cache."""
    if kind == "flash":
        adapter, order = FlashAttnKVLayout(heads, bs, dim), "LBNHC"
    else:
        adapter, order = CpuAttnKVLayout(heads, bs, dim, isa="vec"), "LBHNC"
    caches = make_layer_caches(num_layers, num_blocks, heads, bs, 2 * dim, layout=order, device=device)
    flat = torch.empty(0, dtype=torch.bfloat16, device=device).set_(
        caches[0].untyped_storage(), 0, (caches[0].untyped_storage().nbytes() // 2,))
    flat.copy_(torch.randn(flat.numel(), device=device))
    return [adapter.kv_views(c) for c in caches]


def run(model, tp, device_profile, block_size, sizes_mb, dtypes, sources, repeats, device, seed=0):
    shape = load_model_shape(model)
    heads = shape.kv_heads_per_rank(tp)
    per_token = shape.kv_bytes_per_token(tp, 2)
    rng = np.random.default_rng(seed)
    cases = [(s, d, m) for s in sources for d in dtypes for m in sizes_mb]
    rows = []
    for i, (src_kind, dtype, mb) in enumerate(cases):
        progress(i, len(cases), f"{src_kind} {dtype} {mb} MB")
        n_blocks = max(1, round(mb * 1e6 / per_token / block_size))
        cache_blocks = 2 * n_blocks + 2
        views = source_views(src_kind, shape.num_layers, cache_blocks, heads, block_size, shape.head_dim, device)
        src_blocks = rng.permutation(cache_blocks)[:n_blocks]
        layout = build_layout(model, tp, device_profile, dtype, block_size, cache_blocks)
        plan = make_plan(layout, rng.permutation(cache_blocks)[:n_blocks], "staged")
        out = torch.empty(plan.total_nbytes, dtype=torch.uint8, device=device)
        nbytes = int(n_blocks * block_size * per_token)
        a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        b = torch.empty_like(a)
        sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
        t_copy = median_seconds(lambda: (b.copy_(a), sync()), repeats)
        t_tf = median_seconds(lambda: (transform_kv(views, src_blocks, block_size, plan, out), sync()), repeats)
        rows.append({"source": src_kind, "dtype": dtype, "size_mb": nbytes / 1e6, "blocks": n_blocks,
                     "gprime_mb": plan.total_nbytes / 1e6, "transform_ms": t_tf * 1e3, "copy_ms": t_copy * 1e3,
                     "transform_gbps": nbytes / t_tf / 1e9, "copy_gbps": nbytes / t_copy / 1e9,
                     "ratio": t_copy / t_tf})
    progress(len(cases), len(cases), "done")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hawk bench transform", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--device-profile", default="p150a")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 40, 160])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "bfloat8_b"])
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="results/bench_transform.json")
    a = ap.parse_args(argv)
    rows = run(a.model, a.tp, a.device_profile, a.block_size, a.sizes_mb, a.dtypes, a.sources, a.repeats,
               torch.device(a.device))
    print(f"transform vs plain copy on {a.device} ({torch.get_num_threads()} threads), {a.model} TP={a.tp}, "
          f"{a.device_profile}, block {a.block_size}; throughput in source (bf16) bytes")
    print_table(rows, [("source", "source", ""), ("dtype", "dtype", ""), ("size_mb", "MB", ".1f"),
                       ("gprime_mb", "G' MB", ".1f"), ("transform_ms", "transform ms", ".2f"),
                       ("copy_ms", "copy ms", ".2f"), ("transform_gbps", "transform GB/s", ".2f"),
                       ("copy_gbps", "copy GB/s", ".2f"), ("ratio", "ratio", ".3f")])
    path = write_json(a.out, {"bench": "transform", "device": a.device, "threads": torch.get_num_threads(),
                              "args": vars(a), "rows": rows})
    print(f"wrote {path}")
    return 0
