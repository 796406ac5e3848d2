"""The Triton transform kernel under Triton's interpreter against the torch path and the
numba kernel, byte for byte: ``python triton_matrix.py [--jobs N] [--out FILE]``.

Run by ``test_triton_kernel.py`` in a process of its own with ``TRITON_INTERPRET=1`` and
Triton on ``PYTHONPATH`` (a side folder: Triton must not be importable in the vLLM venv).
The matrix: every source layout of vLLM 0.32's CUDA backends (``KV_CACHE_LAYOUTS``) x
source blocks of {16, 32, 64} tokens x destination blocks of {32, 64} x {bf16, bfp8, bfp4}
x {the whole request in one launch, layer groups (0, 1) and (1, 2), a head share}; every
case with scattered source blocks, a last block the request fills partly, and a span that
starts at a non-zero destination block (``src_block_span``: inside a source block when
those are larger). Shapes are tiny (the interpreter runs ~25 ms per program).

Prints one JSON line: ``{"cases", "failed": [...], "programs", "seconds"}``; exits 1 on
any difference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
SRC_BS = (16, 32, 64)
DST_BS = (32, 64)
DTYPES = ("bfloat16", "bfloat8_b", "bfloat4_b")
MODES = ("whole", "groups", "share")
LAYERS, HEADS, DIM, TOKENS, FIRST_BLOCK = 2, 2, 32, 100, 1


def _case(layout: str, sbs: int, dbs: int, dtype: str, mode: str) -> dict:
    from test_cpu_kernel import _plan, _source

    from vllm_hawk.kvflow.sources import src_block_span
    from vllm_hawk.transform import kv_transform as kt

    seed = hash((layout, sbs, dbs, dtype)) % 1000
    lo_blk, hi_blk, offset = src_block_span(FIRST_BLOCK, dbs, TOKENS, sbs)
    n_src = hi_blk - lo_blk
    blocks = n_src + 4
    src = _source(layout, LAYERS, blocks, HEADS, sbs, DIM, seed)
    heads = HEADS
    if mode == "share":
        src, heads = src.heads(1, 1), 1
    rng = np.random.default_rng(seed)
    ids = rng.permutation(blocks)[:n_src]  # scattered, in request order
    n_dst = -(-(TOKENS - FIRST_BLOCK * dbs) // dbs)  # the last one partly filled
    plan = _plan(LAYERS, heads, dbs, DIM, dtype, list(rng.permutation(n_dst + 3)[:n_dst]))
    views, sel = src.select(ids)

    want = kt.transform_kv(views, sel, sbs, plan, impl="torch", src_token_offset=offset)
    if kt.tile_aligned(sbs, offset):
        numba = kt.transform_kv(views, sel, sbs, plan, impl="cpu_kernel", src_token_offset=offset)
    else:  # the numba kernel reads tile-aligned blocks: the same tokens regrouped
        grouped, gids = kt.regroup_tokens(views, sel, sbs, offset, dbs, 0, LAYERS)
        numba = kt.transform_kv(grouped, gids, dbs, plan, impl="cpu_kernel")
    got = torch.full((plan.total_nbytes,), 0xAB, dtype=torch.uint8)
    memo: dict = {}
    ranges = [(0, 1), (1, 2)] if mode == "groups" else [None]
    for r in ranges:
        kt.transform_kv(views, sel, sbs, plan, got, "triton", layer_range=r, src_token_offset=offset, memo=memo)
    name = f"{layout}/src{sbs}/dst{dbs}/{dtype}/{mode}"
    out = {
        "case": name,
        "programs": int(memo["triton_table"].shape[0]) * 2 * LAYERS,
        "launches": memo["triton_launches"],
    }
    if not torch.equal(want, numba):
        out["error"] = "torch path != numba kernel"
    elif not torch.equal(got, want):
        diff = (got != want).nonzero().flatten()
        out["error"] = f"triton != torch at {diff.numel()} bytes, first {int(diff[0])}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--only", default="", help="run only cases whose name contains this")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("triton_matrix: set TRITON_INTERPRET=1 (CPU tensors run only in Triton's interpreter)", file=sys.stderr)
        return 2
    cases = [
        c
        for c in itertools.product(LAYOUTS, SRC_BS, DST_BS, DTYPES, MODES)
        if args.only in "/".join(map(str, c)) or not args.only
    ]
    t0 = time.monotonic()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_case, *zip(*cases, strict=True), chunksize=4))
    else:
        results = [_case(*c) for c in cases]
    failed = [r for r in results if "error" in r]
    print(
        json.dumps(
            {
                "cases": len(results),
                "failed": failed,
                "programs": sum(r["programs"] for r in results),
                "launches": sum(r["launches"] for r in results),
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
