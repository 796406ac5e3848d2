"""The Triton transform kernel under Triton's interpreter over the whole matrix of
:mod:`vllm_hawk.bench.gpu_matrix` (what ``scripts/gpu_check.py --suite full`` runs on a
GPU), on CPU tensors at tiny shapes: ``python triton_matrix.py [--jobs N] [--only TEXT]``.

Run by ``test_triton_kernel.py`` in a process of its own with ``TRITON_INTERPRET=1`` and
Triton on ``PYTHONPATH`` (a side folder: Triton must not be importable in the vLLM venv).
The interpreter runs ~20 ms per program, so the geometry is 2 layers x 2 KV heads x 32
dims, 100 tokens from destination block 1, and the cases are split over ``--jobs``
processes. Prints one JSON line: ``{"cases", "failed": [rows], "launches", "seconds"}``;
exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from vllm_hawk.bench.gpu_matrix import MatrixGeo, cases, matrix_rows

GEO = MatrixGeo(layers=2, heads=2, head_dim=32, tokens=100, first_block=1)


def _rows(chunk: list) -> list[dict]:
    return matrix_rows("cpu", "triton", GEO, chunk)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--only", default="", help="only the cases whose name (layout/src/dst/dtype/share) has this")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("triton_matrix: set TRITON_INTERPRET=1 (CPU tensors run only in Triton's interpreter)", file=sys.stderr)
        return 2
    todo = [c for c in cases() if args.only in "/".join(map(str, c))]
    t0 = time.monotonic()
    chunks = [todo[i :: args.jobs] for i in range(args.jobs)]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = [r for part in pool.map(_rows, chunks) for r in part]
    failed = [r for r in rows if not (r["bytes_equal"] and r["torch_equal"])]
    summary = {
        "cases": len(rows),
        "failed": failed,
        "launches": sum(r["triton_launches"] for r in rows),
        "refs": sorted({r["ref"] for r in rows}),
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
