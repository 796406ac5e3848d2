"""``hawk layout``: how one request's KV maps onto a Tenstorrent device's DRAM banks.

Pure arithmetic over the layout model (no device memory is touched): addresses come from
the lockstep allocator with the profile's real bank size. ``--prefill-tp P --decode-tp D``
(``--chips D``: a Tenstorrent decode's chips are its TP ranks) report, per decode chip,
the prefill ranks and heads it pulls (:func:`vllm_hawk.layout.tp.plan_pulls`) and each
pull's bytes, bytes per DRAM bank, segments and READs; every chip holds ``H/D`` of the
model's ``H`` KV heads, so the bank and plan tables describe any one chip.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from vllm_hawk.layout.device_profiles import available_profiles, load_profile
from vllm_hawk.layout.interleave import LockstepAllocator
from vllm_hawk.layout.model_shapes import available_models, load_model_shape
from vllm_hawk.layout.tp import consumers, plan_pulls, replicas, shard_heads
from vllm_hawk.layout.tt_kv_cache import KV_DTYPES, TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.transform.plan import make_plan


def build_layout(model: str, tp: int, device: str, dtype: str, block_size: int, cache_blocks: int) -> TTKVCacheLayout:
    shape, profile = load_model_shape(model), load_profile(device)
    spec = TTKVCacheSpec(shape.num_layers, cache_blocks, shape.kv_heads_per_rank(tp), block_size, shape.head_dim, dtype)
    alloc = LockstepAllocator.for_device(profile)
    addrs = tuple(
        (
            alloc.allocate(spec.tiles_per_tensor, spec.tile_nbytes).address,
            alloc.allocate(spec.tiles_per_tensor, spec.tile_nbytes).address,
        )
        for _ in range(spec.num_layers)
    )
    return TTKVCacheLayout(spec, profile.num_banks, profile.aligned_page(spec.tile_nbytes), addrs)


def pull_figures(layout: TTKVCacheLayout, blocks, dst_start: int, count: int) -> dict:
    """One pull's share of a request on a chip: the tiles of the chip's local heads
    ``[dst_start, dst_start + count)`` in destination ``blocks``. Returns target bytes (G'),
    bytes per DRAM bank (all layers, K and V), segments (one per bank that gets bytes, per
    layer group: one group here), READs staged (one per segment) and direct (coalesced runs
    of adjacent pages, per (layer, K|V)). For the whole chip (``count`` = its heads) these
    are :func:`~vllm_hawk.transform.plan.make_plan`'s figures."""
    spec, nb = layout.spec, layout.num_banks
    tph = spec.tiles_per_block // spec.num_kv_heads  # tiles of one head in one block
    tiles = layout.block_tiles(blocks).reshape(len(blocks), spec.tiles_per_block)
    tiles = tiles[:, dst_start * tph : (dst_start + count) * tph].reshape(-1)
    bank = tiles % nb
    counts = np.bincount(bank, minlength=nb)
    per_bank = counts * 2 * spec.num_layers * spec.tile_nbytes
    runs = 0
    for c in np.nonzero(counts)[0]:
        rows = tiles[bank == c] // nb
        runs += 1 + int(np.count_nonzero(np.diff(rows) != 1)) if layout.aligned_page == spec.tile_nbytes else rows.size
    return {
        "target_bytes": int(per_bank.sum()),
        "bytes_per_bank": [int(b) for b in per_bank],
        "segments": int(np.count_nonzero(counts)),
        "reads_staged": int(np.count_nonzero(counts)),
        "reads_direct": runs * 2 * spec.num_layers,
    }


def chip_plans(model: str, prefill_tp: int, decode_tp: int, layout: TTKVCacheLayout, blocks, block_size: int) -> list:
    """Per decode chip (or rank): its heads, its pulls (:func:`~vllm_hawk.layout.tp.plan_pulls`)
    with each pull's figures (:func:`pull_figures`), and the chip's totals."""
    shape = load_model_shape(model)
    chips = []
    for d in range(decode_tp):
        own = shard_heads(shape.num_kv_heads, decode_tp, d, "decode tensor_parallel_size (or chips)")
        pulls = []
        for p in plan_pulls(shape.num_kv_heads, prefill_tp, decode_tp, d):
            f = pull_figures(layout, blocks, p.dst_start, p.count)
            pulls.append(
                {
                    "prefill_rank": p.prefill_rank,
                    "heads": [p.head, p.head + p.count],
                    "src_heads": [p.src_start, p.src_start + p.count],
                    "source_bf16_bytes": len(blocks) * block_size * 2 * shape.num_layers * p.count * shape.head_dim * 2,
                    **f,
                }
            )
        per_bank = np.sum([p["bytes_per_bank"] for p in pulls], axis=0)
        chips.append(
            {
                "chip": d,
                "heads": [own.start, own.stop],
                "prefill_ranks": [p["prefill_rank"] for p in pulls],
                "pulls": pulls,
                "source_bf16_bytes": sum(p["source_bf16_bytes"] for p in pulls),
                "target_bytes": int(per_bank.sum()),
                "bytes_per_bank": [int(b) for b in per_bank],
                "max_bytes_per_bank": int(per_bank.max()),
                **{k: sum(p[k] for p in pulls) for k in ("segments", "reads_staged", "reads_direct")},
            }
        )
    return chips


def _plan_row(layout, placement: str, blocks: np.ndarray, mode: str) -> dict:
    """READs (count, mean bytes) and intra-bank copies of one placement of the request's blocks in ``mode``."""
    plan = make_plan(layout, blocks, mode)
    return {
        "placement": placement,
        "mode": mode,
        "rdma_ops_per_tile": len(plan.per_tile_ops()),
        "rdma_ops": len(plan.rdma),
        "intra_bank_copies": len(plan.intra_bank) if plan.intra_bank is not None else 0,
        "mean_rdma_op_bytes": plan.total_nbytes / max(1, len(plan.rdma)),
        "recv_buffer_bytes_per_bank": plan.recv_nbytes_per_bank if mode == "staged" else 0,
    }


def layout_report(
    model="llama-3.1-70b",
    prefill_tp=4,
    decode_tp=None,
    device="p150a",
    dtype="bfloat8_b",
    block_size=64,
    tokens=4096,
    cache_blocks=None,
) -> dict:
    """The request's layout on each decode chip (``decode_tp`` chips, default ``prefill_tp``)
    and the pulls that fill it from ``prefill_tp`` prefill ranks. Raises
    :class:`~vllm_hawk.layout.tp.TPMismatch` (naming both sizes) when they cannot split the
    model's KV heads."""
    decode_tp = prefill_tp if decode_tp is None else decode_tp
    shape = load_model_shape(model)
    plan_pulls(shape.num_kv_heads, prefill_tp, decode_tp, 0)  # TPMismatch before any allocation
    n_blocks = -(-tokens // block_size)
    cache_blocks = cache_blocks or max(1024, 2 * n_blocks + 1)
    layout = build_layout(model, decode_tp, device, dtype, block_size, cache_blocks)
    spec = layout.spec
    placements = {
        "contiguous blocks": np.arange(1, n_blocks + 1),
        "fragmented blocks": np.arange(1, 2 * n_blocks + 1, 2),
    }
    rows = [
        _plan_row(layout, pname, blocks, mode) for pname, blocks in placements.items() for mode in ("staged", "direct")
    ]
    plan = make_plan(layout, placements["contiguous blocks"], "staged")
    chips = chip_plans(model, prefill_tp, decode_tp, layout, placements["contiguous blocks"], block_size)
    return {
        "model": shape.name,
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
        "tp": decode_tp,
        "num_kv_heads": shape.num_kv_heads,
        "kv_heads_per_rank": spec.num_kv_heads,
        "kv_heads_per_prefill_rank": shape.kv_heads_per_rank(prefill_tp),
        "num_layers": spec.num_layers,
        "head_dim": spec.head_dim,
        "device": device,
        "num_banks": layout.num_banks,
        "dtype": dtype,
        "block_size": block_size,
        "tokens": tokens,
        "blocks": n_blocks,
        "tile_nbytes": spec.tile_nbytes,
        "tiles_per_block": spec.tiles_per_block,
        "source_bf16_bytes": int(n_blocks * block_size * shape.kv_bytes_per_token(decode_tp, 2)),
        "target_bytes": plan.total_nbytes,
        "banks": [
            {
                "bank": c,
                "tiles": int(plan.bank_counts[c]) * 2 * spec.num_layers,
                "bytes": int(plan.segment_nbytes[c]),
                "segment_offset": int(plan.segment_offset[c]),
            }
            for c in range(layout.num_banks)
        ],
        "plans": rows,
        "chips": chips,
        "prefill_ranks": [
            {"rank": r, "pulls_served": consumers(shape.num_kv_heads, prefill_tp, decode_tp, r)}
            for r in range(prefill_tp)
        ],
        "replicated_heads": replicas(shape.num_kv_heads, prefill_tp),
        "totals": {
            "target_bytes": sum(c["target_bytes"] for c in chips),
            "source_bf16_bytes": sum(c["source_bf16_bytes"] for c in chips),
            "pulls": sum(len(c["pulls"]) for c in chips),
            **{k: sum(c[k] for c in chips) for k in ("segments", "reads_staged", "reads_direct")},
        },
    }


def _mib(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def print_report(r: dict) -> None:
    print(
        f"HAWK layout: {r['model']} ({r['num_kv_heads']} KV heads, {r['num_layers']} layers, head_dim "
        f"{r['head_dim']}), prefill TP={r['prefill_tp']} ({r['kv_heads_per_prefill_rank']} KV heads/rank) -> "
        f"decode TP={r['decode_tp']}: {r['decode_tp']} x {r['device']} ({r['num_banks']} DRAM banks) with "
        f"{r['kv_heads_per_rank']} KV heads/chip, {r['dtype']}, block {r['block_size']}"
    )
    print(
        f"request: {r['tokens']} tokens = {r['blocks']} blocks; {r['tiles_per_block']} tiles of {r['tile_nbytes']} B "
        f"per block per tensor on each chip"
    )
    print(
        f"bytes per chip: source (vLLM bf16) {_mib(r['source_bf16_bytes'])} -> target G' {_mib(r['target_bytes'])} "
        f"({r['target_bytes'] / r['source_bf16_bytes']:.3f}x)\n"
    )
    print("each chip's DRAM banks:")
    print("bank".rjust(4), "tiles".rjust(9), "bytes".rjust(14), "G' offset".rjust(14))
    for b in r["banks"]:
        print(f"{b['bank']:>4} {b['tiles']:>9,} {b['bytes']:>14,} {b['segment_offset']:>14,}")
    print()
    hdr = (
        f"{'placement':<18} {'mode':<7} {'ops/tile':>9} {'RDMA ops':>9} {'mean op':>12} {'intra-bank':>10} "
        f"{'recv/bank':>12}"
    )
    print(hdr)
    print("-" * len(hdr))
    for p in r["plans"]:
        print(
            f"{p['placement']:<18} {p['mode']:<7} {p['rdma_ops_per_tile']:>9,} {p['rdma_ops']:>9,} "
            f"{_mib(p['mean_rdma_op_bytes']):>12} {p['intra_bank_copies']:>10,} "
            f"{_mib(p['recv_buffer_bytes_per_bank']) if p['recv_buffer_bytes_per_bank'] else '-':>12}"
        )
    print(
        "\nops/tile: one RDMA request per tile (the mapping the paper rejects, section 4.3); RDMA ops: after "
        "HAWK's grouping and coalescing.\n"
    )
    print("per chip (contiguous blocks; one layer group): the prefill ranks it pulls from (rank: global heads)")
    hdr = (
        f"{'chip':>4} {'heads':>7} {'from prefill ranks':<24} {'bytes':>12} {'bytes/bank':>12} {'segments':>8} "
        f"{'READs staged':>12} {'READs direct':>12}"
    )
    print(hdr)
    print("-" * len(hdr))
    for c in r["chips"]:
        src = ", ".join(f"{p['prefill_rank']}: {p['heads'][0]}-{p['heads'][1] - 1}" for p in c["pulls"])
        print(
            f"{c['chip']:>4} {c['heads'][0]:>3}-{c['heads'][1] - 1:<3} {src:<24} {_mib(c['target_bytes']):>12} "
            f"{_mib(c['max_bytes_per_bank']):>12} {c['segments']:>8,} {c['reads_staged']:>12,} "
            f"{c['reads_direct']:>12,}"
        )
    t = r["totals"]
    print(
        f"{'all':>4} {'':>7} {str(t['pulls']) + ' pulls':<24} {_mib(t['target_bytes']):>12} {'':>12} "
        f"{t['segments']:>8,} {t['reads_staged']:>12,} {t['reads_direct']:>12,}"
    )
    print(
        "prefill ranks hold a request's blocks until this many pulls are released: "
        + ", ".join(f"rank {p['rank']}: {p['pulls_served']}" for p in r["prefill_ranks"])
    )
    if r["replicated_heads"]:
        print(
            f"replicated KV heads (fewer heads than prefill ranks): {r['replicated_heads']}; a rank that serves "
            "no pull is released by the decode's first target at once"
        )


def tp_args(ap: argparse.ArgumentParser, a: argparse.Namespace, default: int = 4) -> tuple[int, int]:
    """(prefill TP, decode TP) from ``--prefill-tp``/``--decode-tp`` (alias ``--chips``) and
    the deprecated ``--tp N`` (both sides N); the decode side defaults to the prefill's."""
    if a.tp is not None:
        if a.prefill_tp is not None or a.decode_tp is not None:
            ap.error("--tp (deprecated) sets both sides: give it alone, or --prefill-tp/--decode-tp")
        print(f"{ap.prog}: --tp is deprecated; use --prefill-tp {a.tp} --decode-tp {a.tp}", file=sys.stderr)
        return a.tp, a.tp
    p = default if a.prefill_tp is None else a.prefill_tp
    d = p if a.decode_tp is None else a.decode_tp
    for name, v in (("--prefill-tp", p), ("--decode-tp", d)):
        if v <= 0:
            ap.error(f"{name} must be positive, got {v}")
    return p, d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hawk layout", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="llama-3.1-70b",
        help=f"model name ({', '.join(available_models())}; HAWK_CONFIG_DIR adds more) or a YAML path",
    )
    ap.add_argument("--prefill-tp", type=int, default=None, help="prefill tensor-parallel size (default 4)")
    ap.add_argument(
        "--decode-tp",
        "--chips",
        dest="decode_tp",
        type=int,
        default=None,
        help="decode tensor-parallel size, or the Tenstorrent decode's chips (default: --prefill-tp)",
    )
    ap.add_argument("--tp", type=int, default=None, help="deprecated: --prefill-tp N --decode-tp N")
    ap.add_argument(
        "--device",
        default="p150a",
        help=f"device profile ({', '.join(available_profiles())}; HAWK_CONFIG_DIR adds more) or a YAML path",
    )
    ap.add_argument("--dtype", default="bfloat8_b", choices=KV_DTYPES)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--cache-blocks", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    a = ap.parse_args(argv)
    if a.tokens <= 0:
        ap.error(f"--tokens must be positive, got {a.tokens}")
    prefill_tp, decode_tp = tp_args(ap, a)
    try:
        r = layout_report(a.model, prefill_tp, decode_tp, a.device, a.dtype, a.block_size, a.tokens, a.cache_blocks)
    except (ValueError, MemoryError) as e:  # TPMismatch is a ValueError
        print(f"hawk layout: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2)) if a.json else print_report(r)
    return 0
