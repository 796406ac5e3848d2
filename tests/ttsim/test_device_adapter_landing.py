"""The Tenstorrent decode's device adapter (:class:`vllm_hawk.npu.ttnn_chip.TTNNChip`) on
simulated p150a / n150: the paged KV cache allocated through ttnn (tt_transformers'
per-layer K/V ``[num_blocks, n_kv_heads, block_size, head_dim]``, TILE, DRAM), a receive
buffer through ttnn exposed with the bank-buffer API, a request's G' landed staged (NIC ->
mapped receive buffer -> ``copy_in_banks``) or direct (straight into the KV pages at their
(bank, address); the adapter refuses to shadow the KV cache in host memory) with the host as
data mover, the page table on the device; the cache is
then read back through ttnn and must equal the prefill KV tilized/packed exactly, with
every untouched block still zero.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ttsim_harness import DEVICES, run_driver

from vllm_hawk.bench.paged_cache import PagedKVCache
from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.transform import make_plan, transform_kv

pytestmark = pytest.mark.ttsim

L, H, BS, D = 2, 2, 32, 64
SRC_BLOCKS, DST_BLOCKS = 16, 24
SRC_IDS, DST_IDS = [5, 2, 9, 11], [20, 3, 7, 12]
BLOCK_TABLE = [DST_IDS, [6, 1, 0, 0]]
CASES = [(dtype, mode) for dtype in ("bfloat16", "bfloat8_b") for mode in ("staged", "direct")]


def prepare(job, device: str, dtype: str, mode: str, views) -> dict:
    """G', the plan's op lists and the addresses our allocator predicts, for one case."""
    spec = TTKVCacheSpec(L, DST_BLOCKS, H, BS, D, dtype)
    emu = EmulatedDevice(device, bank_size_bytes=8 << 20)
    try:
        layout, _ = emu.allocate_kv_cache(spec)
        plan = make_plan(layout, DST_IDS, mode)
        g = transform_kv(views, SRC_IDS, BS, plan).numpy()
        recv = emu.allocate_bank_buffers(plan.recv_nbytes_per_bank).address if mode == "staged" else None
    finally:
        emu.close()
    stem = f"{dtype}.{mode}"
    np.save(job / f"{stem}.g.npy", g)
    arrays = {f"rdma_{f}": getattr(plan.rdma, f) for f in ("src_offset", "bank", "dst_offset", "nbytes")}
    if plan.intra_bank is not None:
        arrays.update(
            {f"intra_{f}": getattr(plan.intra_bank, f) for f in ("src_offset", "bank", "dst_offset", "nbytes")}
        )
    np.savez(job / f"{stem}.ops.npz", **arrays)
    return {
        "kind": "land",
        "spec": [L, DST_BLOCKS, H, BS, D, dtype],
        "mode": mode,
        "recv_size_per_bank": plan.recv_nbytes_per_bank,
        "gprime": f"{stem}.g.npy",
        "ops": f"{stem}.ops.npz",
        "out": stem,
        "block_table": BLOCK_TABLE,
        "expect_kv": [list(a) for a in layout.addresses],
        "expect_recv": recv,
    }


@pytest.fixture(scope="module", params=list(DEVICES))
def landed(request, ttsim_manifest, tmp_path_factory):
    device = request.param
    job = tmp_path_factory.mktemp(f"land_{device}")
    views = PagedKVCache(L, SRC_BLOCKS, H, BS, D).fill_random(7).kv_views()
    tasks = [prepare(job, device, dtype, mode, views) for dtype, mode in CASES]
    res = run_driver(ttsim_manifest, device, job, tasks)
    return device, job, views, dict(zip(CASES, zip(tasks, res, strict=False), strict=False))


@pytest.mark.parametrize("dtype,mode", CASES)
def test_cache_read_back_through_ttnn_equals_prefill_kv(landed, dtype, mode):
    device, job, views, by_case = landed
    task, res = by_case[(dtype, mode)]
    assert res["kv_addresses"] == task["expect_kv"]
    assert res["zero_before"]  # the cache was all zeros before G' landed
    spec = TTKVCacheSpec(L, DST_BLOCKS, H, BS, D, dtype)
    tpb, tb = spec.tiles_per_block, spec.tile_nbytes
    ids = torch.tensor(SRC_IDS)
    for layer, (k, v) in enumerate(views):
        for kv, x in ((0, k), (1, v)):
            got = np.load(job / f"{dtype}.{mode}.kv{2 * layer + kv}.npy")
            assert got.shape == (spec.tiles_per_tensor, tb)
            want = np.zeros_like(got)  # untouched blocks: zero tiles (bf16 and bfloat8_b)
            packed = tilize_pack(x.index_select(0, ids).to(torch.float32), dtype).numpy()
            for j, blk in enumerate(DST_IDS):
                want[blk * tpb : (blk + 1) * tpb] = packed[j * tpb : (j + 1) * tpb]
            bad = np.nonzero((got != want).any(axis=1))[0]
            assert bad.size == 0, (
                f"{device} {dtype} {mode} layer {layer} {'KV'[kv]}: {bad.size} tiles "
                f"differ, first tile {bad[0]} (block {bad[0] // tpb})"
            )


@pytest.mark.parametrize("dtype,mode", CASES)
def test_bank_buffer_api_page_table_and_honesty(landed, dtype, mode):
    device, _, _, by_case = landed
    task, res = by_case[(dtype, mode)]
    nb = {"p150a": 8, "n150": 12}[device]
    if mode == "staged":
        assert res["recv_address"] == task["expect_recv"]
        assert res["bank_addrs_distinct"] == nb  # one host region per bank
        assert res["bank_sizes"] == [task["recv_size_per_bank"]] * nb
        assert res["moved"]["rdma_bytes"] == np.load(task_path(landed, task["gprime"])).size
    else:  # the adapter never shadows the KV cache: a NIC writes it through tt-kmd windows only
        assert res["moved"]["direct_bytes"] == np.load(task_path(landed, task["gprime"])).size
        assert "never shadows the KV cache" in res["moved"]["map_refused"], res["moved"]
    assert res["page_table"] == BLOCK_TABLE
    assert res["live_after"] == 0
    print(f"[ttsim] {device} {dtype} {mode}: landed in {res['land_s']}s", end=" ")


def task_path(landed, name):
    return landed[1] / name
