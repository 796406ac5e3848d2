"""``hawk layout``: how one request's KV maps onto a Tenstorrent device's DRAM banks.

Pure arithmetic over the layout model (no device memory is touched): addresses come from
the lockstep allocator with the profile's real bank size.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from vllm_hawk.layout.device_profiles import available_profiles, load_profile
from vllm_hawk.layout.interleave import LockstepAllocator
from vllm_hawk.layout.model_shapes import available_models, load_model_shape
from vllm_hawk.layout.tt_kv_cache import KV_DTYPES, TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.transform.plan import make_plan


def build_layout(model: str, tp: int, device: str, dtype: str, block_size: int, cache_blocks: int) -> TTKVCacheLayout:
    shape, profile = load_model_shape(model), load_profile(device)
    spec = TTKVCacheSpec(shape.num_layers, cache_blocks, shape.kv_heads_per_rank(tp), block_size, shape.head_dim, dtype)
    alloc = LockstepAllocator.for_device(profile)
    addrs = tuple((alloc.allocate(spec.tiles_per_tensor, spec.tile_nbytes).address,
                   alloc.allocate(spec.tiles_per_tensor, spec.tile_nbytes).address) for _ in range(spec.num_layers))
    return TTKVCacheLayout(spec, profile.num_banks, profile.aligned_page(spec.tile_nbytes), addrs)


def layout_report(model="llama-3.1-70b", tp=4, device="p150a", dtype="bfloat8_b", block_size=64,
                  tokens=4096, cache_blocks=None) -> dict:
    n_blocks = -(-tokens // block_size)
    cache_blocks = cache_blocks or max(1024, 2 * n_blocks + 1)
    layout = build_layout(model, tp, device, dtype, block_size, cache_blocks)
    spec, shape = layout.spec, load_model_shape(model)
    placements = {"contiguous blocks": np.arange(1, n_blocks + 1),
                  "fragmented blocks": np.arange(1, 2 * n_blocks + 1, 2)}
    rows = []
    for pname, blocks in placements.items():
        for mode in ("staged", "direct"):
            plan = make_plan(layout, blocks, mode)
            rows.append({"placement": pname, "mode": mode,
                         "rdma_ops_per_tile": len(plan.per_tile_ops()),
                         "rdma_ops": len(plan.rdma),
                         "intra_bank_copies": len(plan.intra_bank) if plan.intra_bank is not None else 0,
                         "mean_rdma_op_bytes": plan.total_nbytes / max(1, len(plan.rdma)),
                         "recv_buffer_bytes_per_bank": plan.recv_nbytes_per_bank if mode == "staged" else 0})
    plan = make_plan(layout, placements["contiguous blocks"], "staged")
    return {
        "model": shape.name, "tp": tp, "kv_heads_per_rank": spec.num_kv_heads, "num_layers": spec.num_layers,
        "head_dim": spec.head_dim, "device": device, "num_banks": layout.num_banks, "dtype": dtype,
        "block_size": block_size, "tokens": tokens, "blocks": n_blocks, "tile_nbytes": spec.tile_nbytes,
        "tiles_per_block": spec.tiles_per_block,
        "source_bf16_bytes": int(n_blocks * block_size * shape.kv_bytes_per_token(tp, 2)),
        "target_bytes": plan.total_nbytes,
        "banks": [{"bank": c, "tiles": int(plan.bank_counts[c]) * 2 * spec.num_layers,
                   "bytes": int(plan.segment_nbytes[c]), "segment_offset": int(plan.segment_offset[c])}
                  for c in range(layout.num_banks)],
        "plans": rows,
    }


def _mib(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def print_report(r: dict) -> None:
    print(f"HAWK layout: {r['model']} TP={r['tp']} ({r['kv_heads_per_rank']} KV heads/rank, {r['num_layers']} layers, "
          f"head_dim {r['head_dim']}) -> {r['device']} ({r['num_banks']} DRAM banks), {r['dtype']}, "
          f"block {r['block_size']}")
    print(f"request: {r['tokens']} tokens = {r['blocks']} blocks; {r['tiles_per_block']} tiles of {r['tile_nbytes']} B "
          f"per block per tensor")
    print(f"bytes: source (vLLM bf16) {_mib(r['source_bf16_bytes'])} -> target G' {_mib(r['target_bytes'])} "
          f"({r['target_bytes'] / r['source_bf16_bytes']:.3f}x)\n")
    print("bank".rjust(4), "tiles".rjust(9), "bytes".rjust(14), "G' offset".rjust(14))
    for b in r["banks"]:
        print(f"{b['bank']:>4} {b['tiles']:>9,} {b['bytes']:>14,} {b['segment_offset']:>14,}")
    print()
    hdr = (f"{'placement':<18} {'mode':<7} {'ops/tile':>9} {'RDMA ops':>9} {'mean op':>12} {'intra-bank':>10} "
           f"{'recv/bank':>12}")
    print(hdr)
    print("-" * len(hdr))
    for p in r["plans"]:
        print(f"{p['placement']:<18} {p['mode']:<7} {p['rdma_ops_per_tile']:>9,} {p['rdma_ops']:>9,} "
              f"{_mib(p['mean_rdma_op_bytes']):>12} {p['intra_bank_copies']:>10,} "
              f"{_mib(p['recv_buffer_bytes_per_bank']) if p['recv_buffer_bytes_per_bank'] else '-':>12}")
    print("\nops/tile: one RDMA request per tile (the mapping the paper rejects, section 4.3); RDMA ops: after "
          "HAWK's grouping and coalescing.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hawk layout", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b",
                    help=f"model name ({', '.join(available_models())}; HAWK_CONFIG_DIR adds more) or a YAML path")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--device", default="p150a",
                    help=f"device profile ({', '.join(available_profiles())}; HAWK_CONFIG_DIR adds more) "
                         "or a YAML path")
    ap.add_argument("--dtype", default="bfloat8_b", choices=KV_DTYPES)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--cache-blocks", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    a = ap.parse_args(argv)
    if a.tokens <= 0:
        ap.error(f"--tokens must be positive, got {a.tokens}")
    try:
        r = layout_report(a.model, a.tp, a.device, a.dtype, a.block_size, a.tokens, a.cache_blocks)
    except (ValueError, MemoryError) as e:
        print(f"hawk layout: {e}")
        return 2
    print(json.dumps(r, indent=2)) if a.json else print_report(r)
    return 0
