"""The lockstep DRAM allocator vs tt-metal's, on simulated Blackhole (p150a) and Wormhole
(n150): one allocation sequence, run by tt-metal (ttnn 0.81.1 on ttsim) and by the
emulated device at full bank size, must give every address, the OOM points, the reuse of
freed blocks and the final block table equal.

The sequence: a tt_transformers-style KV cache (per layer K and V ``[num_blocks,
n_kv_heads, block_size, head_dim]``) in bf16, then in bfloat8_b, receive buffers, odd page
sizes, a padded tensor, frees that leave holes of different size classes, re-allocations
(one where a tighter hole sits above a bigger one: tt-metal takes the lower, first fit),
allocations up to Out of Memory, and reuse after it.
"""

from __future__ import annotations

import pytest
from ttsim_harness import DEVICES, run_driver

from vllm_hawk.layout.device_profiles import load_profile
from vllm_hawk.layout.interleave import OutOfDeviceMemory
from vllm_hawk.layout.tt_kv_cache import TILE, TILE_NBYTES
from vllm_hawk.npu.emulated import EmulatedDevice

pytestmark = pytest.mark.ttsim

MIB = 1 << 20
KV = [1024, 8, 64, 128]  # [num_blocks, n_kv_heads, block_size, head_dim] per K or V tensor


def sequence() -> list[dict]:
    ops: list[dict] = []
    for dtype, tag in (("bfloat16", ""), ("bfloat8_b", "8")):
        for layer in range(4):
            ops += [
                {"op": "kv", "id": f"k{tag}{layer}", "shape": KV, "dtype": dtype},
                {"op": "kv", "id": f"v{tag}{layer}", "shape": KV, "dtype": dtype},
            ]
    ops += [
        {"op": "recv", "id": "r0", "size_per_bank": 3 * MIB},
        {"op": "rm", "id": "odd", "num_pages": 37, "page_nbytes": 80},  # page aligned up
        {"op": "recv", "id": "r1", "size_per_bank": 5 * MIB + 100},
        {"op": "kv", "id": "pad", "shape": [3, 1, 50, 70], "dtype": "bfloat16"},  # padded tiles
        {"op": "free", "id": "k1"},
        {"op": "free", "id": "r0"},
        {"op": "recv", "id": "r2", "size_per_bank": 2 * MIB},  # into k1's hole, not the tighter r0 one
        {"op": "recv", "id": "r3", "size_per_bank": MIB + 64},
        {"op": "free", "id": "v0"},
        {"op": "free", "id": "k82"},
        {"op": "kv", "id": "half", "shape": [512, 8, 64, 128], "dtype": "bfloat8_b"},
        {"op": "until_oom", "id": "big", "size_per_bank": 448 * MIB, "max": 64},
        {"op": "recv", "id": "toobig", "size_per_bank": 600 * MIB},
        {"op": "free", "id": "big0"},
        {"op": "recv", "id": "after", "size_per_bank": 100 * MIB},
        {"op": "rm", "id": "tiny", "num_pages": 1, "page_nbytes": 16},
        {"op": "free", "id": "odd"},
        {"op": "free", "id": "r2"},
        {"op": "until_oom", "id": "fill", "size_per_bank": 64 * MIB, "max": 64},
        {"op": "kv", "id": "last", "shape": [64, 8, 64, 128], "dtype": "bfloat16"},
    ]
    return ops


def run_emulated(device: str, ops: list[dict]) -> dict:
    profile = load_profile(device)
    dev = EmulatedDevice(profile, bank_size_bytes=profile.usable_bank_bytes)
    out, live = [], {}
    try:
        for op in ops:
            kind = op["op"]
            if kind == "free":
                dev.free_buffer(live.pop(op["id"]))
                out.append(None)
                continue
            if kind == "until_oom":
                addrs = []
                for i in range(op["max"]):
                    try:
                        b = dev.allocate_bank_buffers(op["size_per_bank"])
                    except OutOfDeviceMemory:
                        break
                    live[f"{op['id']}{i}"] = b
                    addrs.append(b.address)
                out.append(addrs)
                continue
            try:
                if kind == "kv":
                    *lead, h, w = op["shape"]
                    n = 1
                    for d in lead:
                        n *= d
                    buf = dev.allocate_buffer(n * -(-h // TILE) * -(-w // TILE), TILE_NBYTES[op["dtype"]])
                elif kind == "rm":
                    buf = dev.allocate_buffer(op["num_pages"], op["page_nbytes"])
                else:
                    buf = dev.allocate_bank_buffers(op["size_per_bank"])
            except OutOfDeviceMemory:
                out.append("OOM")
                continue
            live[op["id"]] = buf
            out.append(buf.address)
        a = dev.allocator
        base = profile.dram_unreserved_base
        return {
            "results": out,
            "blocks": [[x - base, z, u] for x, z, u in a.blocks()],
            "total_bytes_per_bank": a.capacity,
            "free_bytes_per_bank": a.free_bytes(),
            "largest_free_per_bank": a.largest_free(),
        }
    finally:
        dev.close()


@pytest.mark.parametrize("device", list(DEVICES))
def test_allocation_sequence_equals_tt_metal(ttsim_manifest, tmp_path, device):
    ops = sequence()
    sim = run_driver(ttsim_manifest, device, tmp_path, [{"kind": "alloc", "ops": ops}])[0]
    emu = run_emulated(device, ops)
    profile = load_profile(device)
    res = sim["results"]
    assert res[0] == profile.dram_unreserved_base  # the first DRAM buffer, measured
    for i, (op, s, e) in enumerate(zip(ops, res, emu["results"], strict=False)):
        assert s == e, f"op {i} {op}: tt-metal {s}, emulated {e}"
    assert len(res) == len(emu["results"]) == len(ops)
    assert "OOM" in res and any(isinstance(r, list) and len(r) < 64 for r in res)  # reached OOM
    i = {op["id"]: k for k, op in enumerate(ops) if op["op"] != "free"}
    assert res[i["r2"]] == res[i["k1"]] != res[i["r0"]]  # first fit: the lower, bigger hole
    for key in ("total_bytes_per_bank", "free_bytes_per_bank", "largest_free_per_bank"):
        assert sim[key] == emu[key], key
    assert sim["total_bytes_per_bank"] == profile.usable_bank_bytes
    assert [list(b) for b in sim["blocks"]] == emu["blocks"]
