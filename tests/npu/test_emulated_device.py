"""The emulated Tenstorrent device: per-bank host regions, the bank-buffer API, and the
paper's negative result on one contiguous receive buffer (section 5.1.3)."""

import ctypes

import pytest

from vllm_hawk.layout.interleave import OutOfDeviceMemory
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.bank_buffer import BankBufferAPI, BankBufferError
from vllm_hawk.npu.emulated import EmulatedDevice


def test_banks_are_separate_host_regions():
    dev = EmulatedDevice("p150a", 1 << 20)
    addrs = [dev.bank_address(b) for b in range(8)]
    assert len(set(addrs)) == 8
    for a, b in zip(sorted(addrs), sorted(addrs)[1:], strict=False):
        assert b - a >= 1 << 20  # no overlap


def test_bank_buffer_api_roundtrip():
    dev = EmulatedDevice("n150", 1 << 20)
    assert isinstance(dev, BankBufferAPI) and dev.get_device_num_bank() == 12
    buf = dev.allocate_bank_buffers(1000)
    with pytest.raises(BankBufferError, match="not mapped"):
        dev.get_buffer_address_bank(buf, 0)
    dev.map_buffer_dma(buf)
    with pytest.raises(BankBufferError, match="already mapped"):
        dev.map_buffer_dma(buf)
    for bank in range(12):
        addr, size = dev.get_buffer_address_bank(buf, bank), dev.get_buffer_size_bank(buf, bank)
        assert size == 1024  # 1000 rounded to 32 B
        ctypes.memset(addr, bank + 1, size)  # the address really is this bank's region
        assert dev.read_page(buf, bank)[0] == bank + 1
    with pytest.raises(BankBufferError, match="out of range"):
        dev.get_buffer_size_bank(buf, 12)
    dev.unmap_buffer_dma(buf)
    dev.free_buffer(buf)
    with pytest.raises(BankBufferError, match="unknown or freed"):
        dev.map_buffer_dma(buf)


def test_failed_kv_allocation_leaks_nothing():
    dev = EmulatedDevice("p150a", 1 << 20)
    with pytest.raises(OutOfDeviceMemory):
        dev.allocate_kv_cache(TTKVCacheSpec(8, 64, 8, 64, 128, "bfloat16"))
    assert dev.allocator.used_bytes() == 0 and not dev.live_buffers()


def test_contiguous_receive_buffer_starves_kv_cache_but_per_bank_buffers_do_not():
    """Section 5.1.3: a receive buffer that is one contiguous region lands in one bank,
    but the lockstep allocator reserves its size in EVERY bank; per-bank buffers of the
    same total size take 1/8 of it per bank, and the KV cache still fits."""
    bank_bytes = 4 << 20
    recv_total = 3 << 20  # receive capacity, bytes
    # 4 tensors x 2048 tiles x 1088 B / 8 banks = 1088 KiB per bank: more than the 1 MiB
    # the contiguous buffer leaves, far less than the 3.6 MiB per-bank buffers leave.
    spec = TTKVCacheSpec(num_layers=2, num_blocks=128, num_kv_heads=2, block_size=64, head_dim=128, dtype="bfloat8_b")
    contiguous = EmulatedDevice("p150a", bank_bytes)
    contiguous.allocate_buffer(num_pages=1, page_nbytes=recv_total)  # one page = one bank
    with pytest.raises(OutOfDeviceMemory):
        contiguous.allocate_kv_cache(spec)
    per_bank = EmulatedDevice("p150a", bank_bytes)
    per_bank.allocate_bank_buffers(recv_total // 8)
    layout, bufs = per_bank.allocate_kv_cache(spec)
    assert len(bufs) == 4
