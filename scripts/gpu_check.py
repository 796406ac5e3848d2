"""The prefill side on a CUDA GPU: its bytes against the CPU path's, its speed against a
plain device copy, CUDA graph capture next to its start-up, KVReady under load. One
prepared script for a lent GPU machine (nothing but torch, numpy, numba and triton is
needed there; the other wheels travel in ``--wheels``).

    bash scripts/gpu_wheels.sh            # here: msgspec, pyzmq, PyYAML wheels for the GPU machine's Python
    python scripts/gpu_check.py --suite full --device cuda --wheels build/gpu-wheels --out-dir gpu_check_out
    python scripts/gpu_check.py [--suite quick] [--size-mb 160] [--out gpu_check.json]

``--suite quick`` (the default), for Llama-3.1-70B at TP=4 onto a p150a chip (2 KV heads,
80 layers, block 64) over a random bf16 FlashAttention (NHD) cache on the device:

1. ``transform``: G' from the torch transform on the device equals, byte for byte, G'
   from the CPU kernel over a host copy of the cache (bf16 and bfloat8_b tiles); its
   speed against a device copy of the same source bytes (ratio copy time / transform
   time within each repeat, median; CUDA synchronised around each);
2. ``prefill``: a PrefillEndpoint per source (TileTransformSource into bf16 and
   bfloat8_b tiles, RingGatherSource) with its ring on the device, real KVRequests over
   its side channel (:mod:`vllm_hawk.bench.prefill_check`): the ring's bytes equal the
   same endpoint's over the host copy; where the ring is and under which location it is
   registered (``cuda:0``); produce GB/s against a device copy; KVRequest -> KVReady ms.

``--suite full``: five sections, each written to ``--out-dir/<section>.json`` as soon
as it finishes (then ``summary.json``), each with a table:

* ``matrix`` (:mod:`vllm_hawk.bench.gpu_matrix`): every source layout x source blocks
  {16, 32, 64} x destination {32, 64} x {bf16, bfp8, bfp4} x {whole, layer group, head
  share} against the CPU reference: the Triton kernel and the torch path on CUDA; on the
  CPU the torch path, and the Triton kernel on tiny shapes when ``TRITON_INTERPRET=1``;
* ``speed`` (:mod:`vllm_hawk.bench.gpu_speed`): GB/s against a device copy (CUDA events),
  kernels per request, host ms, peak-memory growth, for Llama-8B TP1 16 -> 64 at 4k
  tokens and 70B TP4 at 160 MB, contiguous and scattered blocks;
* ``checksum`` (:mod:`vllm_hawk.bench.gpu_checksum`): the integrity checksum on the device
  (the Triton kernel on CUDA) equal to the host kernel, and its GB/s against a device copy
  at 1, 20 and 160 MiB;
* ``capture`` and ``replay`` (:mod:`vllm_hawk.bench.gpu_capture`): 10 graph captures on
  a non-blocking stream right after the connector's ``make_prefill`` (its warm-up as
  the connector runs it); 20 KVRequests idle and while graphs that write KV replay.

``--device cpu`` runs the same at small sizes (CI: tests/transform/test_gpu_check_script.py);
CPU figures are CPU figures. ``--budget-s`` skips what would start past it (noted).
Exits 1 if any bytes differ or a capture fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import numpy as np  # noqa: E402
import torch  # noqa: E402

#: modules the suites import beyond torch, numpy, numba and triton (the side channel, the
#: device and model profiles); from ``--wheels`` where the machine lacks them
WHEEL_MODULES = ("msgspec", "zmq", "yaml")


def unpack_wheels(wheels: Path) -> list[str]:
    """Make :data:`WHEEL_MODULES` importable from the wheels in ``wheels`` where they are
    not installed (here and in child processes: PYTHONPATH); returns those still missing."""
    missing = [m for m in WHEEL_MODULES if importlib.util.find_spec(m) is None]
    if missing and wheels.is_dir():
        site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
        for whl in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
        for so in site.rglob("*.so*"):
            so.chmod(0o755)
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
        importlib.invalidate_caches()
        missing = [m for m in WHEEL_MODULES if importlib.util.find_spec(m) is None]
    return missing


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def cpu_reference(host, src_blocks, block_size, plan, out, notes: list) -> None:
    """G' from the CPU kernel (numba), or the torch path on the CPU where numba fails here
    (then for the rest of the run: HAWK_TRANSFORM_IMPL=torch)."""
    from vllm_hawk.transform import transform_source

    try:
        transform_source(host, src_blocks, block_size, plan, out)
    except Exception as e:  # noqa: BLE001 - another numba than ours: the torch path is the reference
        notes.append(f"CPU reference: torch path (the numba kernel failed: {type(e).__name__}: {str(e)[:200]})")
        os.environ["HAWK_TRANSFORM_IMPL"] = "torch"
        transform_source(host, src_blocks, block_size, plan, out, impl="torch")


def transform_rows(a, dev, sync, notes: list) -> list[dict]:
    from vllm_hawk.bench.transform_bench import random_transform_source
    from vllm_hawk.layout.model_shapes import load_model_shape
    from vllm_hawk.layout.vllm_kv import TransformSource
    from vllm_hawk.layout_report import build_layout
    from vllm_hawk.transform import make_plan, transform_source

    shape = load_model_shape(a.model)
    heads, per_token = shape.kv_heads_per_rank(a.tp), shape.kv_bytes_per_token(a.tp, 2)
    n_blocks = max(1, round(a.size_mb * 1e6 / per_token / a.block_size))
    cache_blocks = 2 * n_blocks + 2
    rng = np.random.default_rng(0)
    src_blocks, dst_blocks = rng.permutation(cache_blocks)[:n_blocks], rng.permutation(cache_blocks)[:n_blocks]
    source = random_transform_source("flash", shape.num_layers, cache_blocks, heads, a.block_size, shape.head_dim, dev)
    host = TransformSource(source.adapters, [c.cpu() for c in source.caches])  # the same bytes in host memory
    nbytes = int(n_blocks * a.block_size * per_token)
    src_copy = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst_copy = torch.zeros_like(src_copy)
    rows = []
    for dtype in ("bfloat16", "bfloat8_b"):
        layout = build_layout(a.model, a.tp, a.device_profile, dtype, a.block_size, cache_blocks)
        plan = make_plan(layout, dst_blocks, "staged")
        out = torch.zeros(plan.total_nbytes, dtype=torch.uint8, device=dev)
        transform_source(source, src_blocks, a.block_size, plan, out, impl="torch")
        sync()
        want = torch.zeros(plan.total_nbytes, dtype=torch.uint8)
        cpu_reference(host, src_blocks, a.block_size, plan, want, notes)
        copy_s, tr_s = [], []
        for _ in range(a.repeats):
            copy_s.append(_timed(lambda: dst_copy.copy_(src_copy), sync))
            tr_s.append(
                _timed(lambda: transform_source(source, src_blocks, a.block_size, plan, out, impl="torch"), sync)
            )
        rows.append(
            {
                "dtype": dtype,
                "source_mb": nbytes / 1e6,
                "gprime_mb": plan.total_nbytes / 1e6,
                "bytes_equal_cpu_kernel": bool(torch.equal(out.cpu(), want)),
                "copy_gbps": nbytes / statistics.median(copy_s) / 1e9,
                "transform_gbps": nbytes / statistics.median(tr_s) / 1e9,
                "ratio": statistics.median(c / t for c, t in zip(copy_s, tr_s, strict=False)),
            }
        )
    return rows


def print_transform(rows: list[dict]) -> None:
    print(f"{'dtype':<10} {'src MB':>8} {'Gp MB':>8} {'bytes':>6} {'copy GB/s':>10} {'xform GB/s':>10} {'ratio':>6}")
    for r in rows:
        same = "equal" if r["bytes_equal_cpu_kernel"] else "DIFF"
        print(
            f"{r['dtype']:<10} {r['source_mb']:8.1f} {r['gprime_mb']:8.1f} {same:>6} "
            f"{r['copy_gbps']:10.1f} {r['transform_gbps']:10.1f} {r['ratio']:6.2f}"
        )
    print("Gp: G' in the target dtype; ratio: copy time / transform time of the same source bytes (1 = copy speed)")


def print_prefill(rows: list[dict]) -> None:
    print(
        f"{'source':<15} {'dtype':<12} {'src MB':>8} {'bytes':>6} {'ring':>8} {'registered':>12} "
        f"{'copy GB/s':>10} {'prod GB/s':>10} {'ratio':>6} {'KVReady ms':>11}"
    )
    for r in rows:
        same = "equal" if r["bytes_equal_host"] else "DIFF"
        print(
            f"{r['source']:<15} {r['dtype']:<12} {r['source_mb']:8.1f} {same:>6} {r['ring']:>8} "
            f"{','.join(r['registered']):>12} {r['copy_gbps']:10.1f} {r['produce_gbps']:10.1f} {r['ratio']:6.2f} "
            f"{r['kvready_ms']:11.2f}"
        )
    print(
        "bytes: the device ring against the same endpoint over a host copy; prod: source bytes / the "
        "endpoint's produce time (stream synchronisation included); KVReady ms: KVRequest sent to "
        "KVReady received over the side channel, median"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--device-profile", default="p150a")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--size-mb", type=float, default=160.0, help="the request's bf16 KV (source bytes)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--wheels", default=str(ROOT / "build" / "gpu-wheels"), help="msgspec/pyzmq wheels to use")
    ap.add_argument("--out", default="gpu_check.json", help="quick suite: the JSON report")
    ap.add_argument("--suite", choices=("quick", "full"), default="quick")
    ap.add_argument("--out-dir", default="gpu_check_out", help="full suite: one JSON per section")
    ap.add_argument("--budget-s", type=float, default=420.0, help="full suite: start nothing heavy after this")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if a.suite == "full":
        missing = unpack_wheels(Path(a.wheels))
        if missing:
            print(f"full suite: {', '.join(missing)} not importable (run scripts/gpu_wheels.sh, pass --wheels)")
            return 2
        from vllm_hawk.bench.gpu_suite import run_full

        return 0 if run_full(dev, Path(a.out_dir), a.budget_s, a.repeats) else 1
    sync = (lambda: getattr(torch, dev.type).synchronize(dev)) if dev.type != "cpu" else (lambda: None)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    report = {"device": name, "torch": torch.__version__, "model": a.model, "tp": a.tp, "skipped": [], "notes": []}
    missing = unpack_wheels(Path(a.wheels))
    t0 = time.monotonic()
    report["transform"] = transform_rows(a, dev, sync, report["notes"])
    print(
        f"== transform (torch path) on {name} vs the CPU kernel, {a.model} TP={a.tp} -> {a.device_profile}, "
        f"block {a.block_size}, {a.repeats} repeats, {time.monotonic() - t0:.1f} s"
    )
    print_transform(report["transform"])
    ok = all(r["bytes_equal_cpu_kernel"] for r in report["transform"])
    if missing:
        report["skipped"].append(
            f"prefill: {', '.join(missing)} not importable (run scripts/gpu_wheels.sh, carry build/gpu-wheels)"
        )
    else:
        from vllm_hawk.bench.prefill_check import prefill_rows
        from vllm_hawk.layout.model_shapes import load_model_shape

        t1 = time.monotonic()
        shape = load_model_shape(a.model)
        report["prefill"] = prefill_rows(dev, shape, a.tp, a.device_profile, a.block_size, a.size_mb, a.repeats)
        print(f"== prefill endpoint on {name}: real KVRequests, ring on the device, {time.monotonic() - t1:.1f} s")
        print_prefill(report["prefill"])
        ok &= all(r["bytes_equal_host"] for r in report["prefill"])
    for line in report["skipped"] + report["notes"]:
        print(f"note: {line}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out} ({time.monotonic() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
