"""Bank placement on tt-metal: a KV tensor written through ttnn to simulated p150a / n150
has, in every DRAM bank at the buffer's address, exactly the bytes the emulated device
puts there for the same tensor (bf16 and bfloat8_b). Raw bank bytes come from tt-metal's
own read API (``ttnn._ttnn.cluster.read_from_core`` at the bank's NOC0 coordinates from
``get_dram_bank_table``). The converse too: our bank bytes written at (bank, address) read
back through ttnn as the same tilized/packed tensor.

n150 has 12 banks and the tensor 64 tiles: banks 0-3 hold 6 tiles, the others 5, with
the same per-bank size (lockstep). Bytes of a bank's region that hold no page of the
tensor (the 6th slot of banks 4-11) are not compared: the simulator's DRAM keeps what an
earlier task wrote there, as real DRAM does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ttsim_harness import DEVICES, run_driver

from vllm_hawk.layout.formats import tilize_pack
from vllm_hawk.npu.emulated import EmulatedDevice

pytestmark = pytest.mark.ttsim

DTYPES = ("bfloat16", "bfloat8_b")


def kv_tensor(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 2, 64, 128)).astype(np.float32)  # [blocks, heads, block_size, head_dim]
    x[:, :, :, 7] *= 300.0  # outlier channel, as in real K caches
    x[:, 1, :, 64:] *= 1e-3
    return x


def emulated_banks(device: str, x: np.ndarray, dtype: str) -> tuple[int, np.ndarray]:
    """(address, uint8 [num_banks, size_per_bank]) of x written on a fresh emulated device."""
    dev = EmulatedDevice(device, bank_size_bytes=8 << 20)
    try:
        packed = tilize_pack(torch.from_numpy(x), dtype).numpy()
        buf = dev.allocate_buffer(packed.shape[0], packed.shape[1])
        for page in range(packed.shape[0]):
            dev.write_page(buf, page, packed[page])
        banks = np.stack([dev.banks[b][buf.address : buf.address + buf.size_per_bank] for b in range(dev.num_banks)])
        return buf.address, banks.copy()
    finally:
        dev.close()


@pytest.fixture(scope="module", params=list(DEVICES))
def placed(request, ttsim_manifest, tmp_path_factory):
    device = request.param
    job = tmp_path_factory.mktemp(f"banks_{device}")
    tasks, ours = [], {}
    for i, dtype in enumerate(DTYPES):
        x = kv_tensor(i)
        np.save(job / f"{dtype}.x.npy", x)
        ours[dtype] = emulated_banks(device, x, dtype)
        np.save(job / f"{dtype}.in.npy", ours[dtype][1])
        tasks.append({"kind": "banks", "dtype": dtype, "input": f"{dtype}.x.npy", "out": dtype})
    res = run_driver(ttsim_manifest, device, job, tasks)
    return device, job, dict(zip(DTYPES, res, strict=False)), ours


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_bank_holds_our_bytes(placed, dtype):
    device, job, res, ours = placed
    addr, banks = ours[dtype]
    sim = np.load(job / f"{dtype}.banks.npy")
    assert res[dtype]["address"] == addr
    assert sim.shape == banks.shape
    nb, tb = sim.shape[0], {"bfloat16": 2048, "bfloat8_b": 1088}[dtype]
    pages = np.load(job / f"{dtype}.x.npy").size // 1024
    for b in range(nb):
        held = np.zeros(sim.shape[1], dtype=bool)
        for slot in range(len(range(b, pages, nb))):
            held[slot * tb : (slot + 1) * tb] = True  # tb is already DRAM-aligned here
        diff = np.nonzero((sim[b] != banks[b]) & held)[0]
        assert diff.size == 0, (
            f"{device} {dtype} bank {b}: {diff.size} bytes differ, first at "
            f"{addr:#x}+{diff[0]} (tt-metal {sim[b, diff[0]]:#04x}, ours {banks[b, diff[0]]:#04x})"
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_written_at_bank_addresses_read_back_as_the_tensor(placed, dtype):
    device, job, res, _ = placed
    x = np.load(job / f"{dtype}.x.npy")
    want = tilize_pack(torch.from_numpy(x), dtype).numpy()
    got = np.load(job / f"{dtype}.readback.npy")
    assert res[dtype]["converse_address"] == res[dtype]["address"]  # the freed block, reused
    assert np.array_equal(got, want), f"{device} {dtype}: ttnn read back other bytes than written"
