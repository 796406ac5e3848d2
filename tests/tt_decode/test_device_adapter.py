"""The decode's device adapter on a simulated p150a, on the KV cache a model allocates the
way tt_transformers does (``ttnn.as_tensor`` of zeros, ReplicateTensorToMesh, TILE, DRAM):
the cache is described by its own tensors' addresses, lockstep in every bank; a chip that
is not the profile's is refused naming the profile field; a cache the sink cannot land
(not one [K, V] pair per layer) is refused naming the layer."""

from __future__ import annotations

from tt_decode_helpers import run_on_sim

JOB = r"""
import json, torch, ttnn
from vllm_hawk.npu.bank_buffer import BankBufferAPI
from vllm_hawk.npu.ttnn_chip import TTNNChip
from vllm_hawk.tenstorrent.kv_cache import ChipKVCache, MeshKVCache
from vllm_hawk.tenstorrent.vllm_tt.kv_cache import TTNNMeshKVCache

out = {}
try:
    TTNNChip.open("n150")  # a Blackhole is not an n150
except ValueError as e:
    out["mismatch"] = str(e)
chip = TTNNChip.open("p150a")
host = ttnn.as_tensor(torch.zeros((24, 4, 32, 32)), mesh_mapper=ttnn.ReplicateTensorToMesh(chip.mesh),
                      layout=ttnn.TILE_LAYOUT, dtype=ttnn.bfloat8_b)
kv = [[ttnn.to_device(host, chip.mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG) for _ in "kv"] for _ in range(2)]
cache = TTNNMeshKVCache([chip], kv, num_kv_heads=4, block_size=32)
c0 = cache.chips[0]
out["protocols"] = [isinstance(chip, BankBufferAPI), isinstance(cache, MeshKVCache), isinstance(c0, ChipKVCache)]
out["addresses"] = [list(a) for a in c0.layout.addresses]
out["tensor_addresses"] = [[t.buffer_address() for t in pair] for pair in kv]
out["size_per_bank"] = [b.size_per_bank for b in c0.buffers]
out["dtype"] = cache.spec.dtype
out["nonzero"] = cache.nonzero_blocks()
try:
    TTNNMeshKVCache([chip], [[kv[0][0]]], num_kv_heads=4, block_size=32)
except ValueError as e:
    out["hybrid"] = str(e)
cache.close()
out["live_after"] = len(chip.live_buffers())
chip.close()
print("RESULT " + json.dumps(out))
"""


def test_adapter_describes_the_models_cache_and_refuses_mismatches(manifest):
    r = run_on_sim(manifest, "p150a", JOB)
    assert "field 'num_banks'" in r["mismatch"] and "n150" in r["mismatch"], r["mismatch"]
    assert r["protocols"] == [True, True, True]  # the chip and its caches implement their protocols
    assert r["addresses"] == r["tensor_addresses"]
    assert r["addresses"][0][0] == 0x100080  # tt-metal's first DRAM allocation on Blackhole
    # 24 blocks x 4 heads x 1 tile = 96 bfloat8_b tiles (1088 B, 1088 aligned to 64 B = 1088) over 8 banks
    assert r["size_per_bank"] == [12 * 1088] * 4
    flat = [a for pair in r["addresses"] for a in pair]
    assert all(b - a == 12 * 1088 for a, b in zip(flat, flat[1:], strict=False))  # lockstep, bottom-up
    assert r["dtype"] == "bfloat8_b" and r["nonzero"] == []
    assert "layer 0" in r["hybrid"] and "[K, V]" in r["hybrid"]
    assert r["live_after"] == 0
