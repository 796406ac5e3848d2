"""The prefill transform on a CUDA GPU: its bytes against the CPU kernel's, its speed
against a plain ``torch.cuda`` copy. One prepared script for a lent GPU machine (< 3 min).

    python scripts/gpu_check.py [--device cuda] [--size-mb 160] [--out gpu_check.json]

The torch path of :func:`vllm_hawk.transform.transform_source` is what a GPU prefill
runs (the numba kernel is CPU-only). For each target dtype (bfloat16, bfloat8_b):

1. bytes: a random bf16 FlashAttention (NHD) cache on the device, the request's blocks
   scattered; G' from the torch path on the device equals, byte for byte, G' from the
   CPU kernel over a copy of the same cache in host memory;
2. speed: the transform (end to end, as ``TileTransformSource`` runs it) against a copy
   of the same source bytes on the same device, as a ratio within each repeat (copy time /
   transform time, median; CUDA synchronised around each), plus GB/s of source bytes.

Prints a table, writes JSON, exits 1 if any bytes differ. ``--device cpu`` runs the same
comparison with the torch path on the CPU (what a machine without a GPU can check).
Llama-3.1-70B at TP=4 onto a p150a chip (2 KV heads, 80 layers, block 64) by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_hawk.bench.transform_bench import make_source  # noqa: E402
from vllm_hawk.layout.model_shapes import load_model_shape  # noqa: E402
from vllm_hawk.layout.vllm_kv import TransformSource  # noqa: E402
from vllm_hawk.layout_report import build_layout  # noqa: E402
from vllm_hawk.transform import make_plan, transform_source  # noqa: E402


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--device-profile", default="p150a")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--size-mb", type=float, default=160.0, help="the request's bf16 KV (source bytes)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="gpu_check.json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shape = load_model_shape(a.model)
    heads, per_token = shape.kv_heads_per_rank(a.tp), shape.kv_bytes_per_token(a.tp, 2)
    n_blocks = max(1, round(a.size_mb * 1e6 / per_token / a.block_size))
    cache_blocks = 2 * n_blocks + 2
    rng = np.random.default_rng(0)
    src_blocks = rng.permutation(cache_blocks)[:n_blocks]
    dst_blocks = rng.permutation(cache_blocks)[:n_blocks]
    t0 = time.monotonic()
    source = make_source("flash", shape.num_layers, cache_blocks, heads, a.block_size, shape.head_dim, dev)
    host = TransformSource(source.adapters, [c.cpu() for c in source.caches])  # the same bytes in host memory
    nbytes = int(n_blocks * a.block_size * per_token)
    src_copy = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst_copy = torch.zeros_like(src_copy)
    rows, ok = [], True
    for dtype in ("bfloat16", "bfloat8_b"):
        layout = build_layout(a.model, a.tp, a.device_profile, dtype, a.block_size, cache_blocks)
        plan = make_plan(layout, dst_blocks, "staged")
        out = torch.zeros(plan.total_nbytes, dtype=torch.uint8, device=dev)
        transform_source(source, src_blocks, a.block_size, plan, out, impl="torch")
        sync()
        want = torch.zeros(plan.total_nbytes, dtype=torch.uint8)
        transform_source(host, src_blocks, a.block_size, plan, want)  # the CPU kernel (numba) where it runs
        same = bool(torch.equal(out.cpu(), want))
        ok &= same
        copy_s, tr_s = [], []
        for _ in range(a.repeats):
            copy_s.append(_timed(lambda: dst_copy.copy_(src_copy), sync))
            tr_s.append(
                _timed(
                    lambda: transform_source(
                        source, src_blocks, a.block_size, make_plan(layout, dst_blocks, "staged"), out, impl="torch"
                    ),
                    sync,
                )
            )
        rows.append(
            {
                "dtype": dtype,
                "source_mb": nbytes / 1e6,
                "gprime_mb": plan.total_nbytes / 1e6,
                "bytes_equal_cpu_kernel": same,
                "copy_gbps": nbytes / statistics.median(copy_s) / 1e9,
                "transform_gbps": nbytes / statistics.median(tr_s) / 1e9,
                "ratio": statistics.median(c / t for c, t in zip(copy_s, tr_s, strict=False)),
            }
        )
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(
        f"transform (torch path) on {name} vs the CPU kernel's bytes, {a.model} TP={a.tp} -> {a.device_profile}, "
        f"{n_blocks} blocks of {a.block_size} tokens, {a.repeats} repeats, {time.monotonic() - t0:.1f} s"
    )
    print(f"{'dtype':<10} {'src MB':>8} {'Gp MB':>8} {'bytes':>6} {'copy GB/s':>10} {'xform GB/s':>10} {'ratio':>6}")
    for r in rows:
        same = "equal" if r["bytes_equal_cpu_kernel"] else "DIFF"
        print(
            f"{r['dtype']:<10} {r['source_mb']:8.1f} {r['gprime_mb']:8.1f} {same:>6} "
            f"{r['copy_gbps']:10.1f} {r['transform_gbps']:10.1f} {r['ratio']:6.2f}"
        )
    print(
        "Gp: the transformed G' in the target dtype; ratio: copy time / transform time of the same source "
        "bytes, median within repeats (1 = copy speed)"
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"device": name, "model": a.model, "tp": a.tp, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
