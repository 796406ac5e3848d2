"""TtKmdBankBuffers' bookkeeping against FakeTlbDevice, a fake ONLY at the hardware
boundary (the tt-kmd ioctls + mmap of the BARs; ``tests/tt_kmd_fakes.py`` lists the tt-kmd
rules it enforces). Nothing here proves the real driver behaves so: that needs a Blackhole."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from tt_kmd_fakes import (
    FakeMooncakeEngine,
    FakeTlbDevice,
    FakeTlbPool,
    FakeTtPeermem,
    fd_is_open,
    hold_like_tt_metal,
    make_buffer,
)

from vllm_hawk.npu import tt_kmd
from vllm_hawk.npu.bank_buffer import BankBufferAPI, BankBufferError
from vllm_hawk.npu.tt_kmd import bank_buffers as bank_buffers_module
from vllm_hawk.npu.tt_kmd.bank_buffers import TtKmdBankBuffers
from vllm_hawk.npu.tt_kmd.device import TlbDevice, TlbWindow, TtKmdError
from vllm_hawk.npu.tt_kmd.registration import register_bank_with_mooncake, unregister_bank_from_mooncake
from vllm_hawk.npu.tt_kmd.sysfs import device_holders
from vllm_hawk.npu.tt_kmd.topology import Arch, UnsupportedArchError

MiB = 1 << 20
GiB = 1 << 30
MAP_BYTES = 64 << 20  # map only the first 64 MiB of each fake window


def test_fake_satisfies_the_device_protocol_and_backend_the_api() -> None:
    dev = FakeTlbDevice()
    assert isinstance(dev, TlbDevice)
    assert isinstance(TtKmdBankBuffers(dev, window_map_bytes=MAP_BYTES), BankBufferAPI)


def test_map_aims_one_window_per_bank_and_addresses_are_window_plus_offset() -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_map_bytes=MAP_BYTES)
    buf = make_buffer()
    bb.map_buffer_dma(buf)
    assert bb.get_device_num_bank() == 8 and bb.live_windows == 8
    endpoints = sorted((ep.x, ep.y, base) for ep, base in dev.config.values())
    assert endpoints == sorted([(17, 12 + 3 * b, 0) for b in range(4)] + [(18, 12 + 3 * b, 0) for b in range(4)])
    for bank in range(8):
        m = bb.bank_mapping(buf, bank)
        addr = bb.get_buffer_address_bank(buf, bank)
        assert addr == m.window_va + buf.address
        assert bb.get_buffer_size_bank(buf, bank) == buf.size_per_bank == m.nbytes
        assert m.dmabuf_offset == buf.address % mmap.PAGESIZE
        # the address is real host memory inside that bank's window mapping
        ctypes.memset(addr, bank + 1, buf.size_per_bank)
        assert ctypes.string_at(addr + buf.size_per_bank - 1, 1) == bytes([bank + 1])
    bb.unmap_buffer_dma(buf)
    assert bb.live_windows == 0 and not dev.mapped and not dev.config and len(dev.free_ids) == 8
    assert not any(fd_is_open(fd) for fd in dev.exports)
    # teardown order per window: munmap before FREE_TLB (tt-kmd answers EBUSY otherwise)
    assert dev.calls.count("unmap") == dev.calls.count("free") == 8


def test_second_buffer_shares_the_bank_windows() -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_map_bytes=MAP_BYTES)
    a, b = make_buffer(1, address=0x1000), make_buffer(2, address=0x20_0000)
    bb.map_buffer_dma(a)
    bb.map_buffer_dma(b)
    assert bb.live_windows == 8 and dev.calls.count("allocate") == 8 and len(dev.exports) == 16
    assert bb.get_buffer_address_bank(b, 3) - bb.get_buffer_address_bank(a, 3) == 0x20_0000 - 0x1000
    bb.unmap_buffer_dma(a)
    assert bb.live_windows == 8  # b still uses them
    bb.get_buffer_address_bank(b, 0)
    bb.close()
    assert bb.live_windows == 0 and not dev.mapped


def test_double_map_unknown_buffer_and_bad_bank_are_bank_buffer_errors() -> None:
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_map_bytes=MAP_BYTES)
    buf = make_buffer()
    with pytest.raises(BankBufferError, match="not mapped"):
        bb.get_buffer_address_bank(buf, 0)
    bb.map_buffer_dma(buf)
    with pytest.raises(BankBufferError, match="already mapped"):
        bb.map_buffer_dma(buf)
    with pytest.raises(BankBufferError, match="bank 8 out of range"):
        bb.get_buffer_address_bank(buf, 8)
    with pytest.raises(BankBufferError, match="12 banks; this device has 8"):
        bb.map_buffer_dma(make_buffer(7, banks=12))
    with pytest.raises(BankBufferError, match="exceeds a Blackhole DRAM bank"):
        bb.map_buffer_dma(make_buffer(8, address=0xFF00_0000 - 64))
    with pytest.raises(BankBufferError, match="window_map_bytes"):
        bb.map_buffer_dma(make_buffer(9, address=MAP_BYTES))
    bb.unmap_buffer_dma(buf)
    with pytest.raises(BankBufferError, match="not mapped"):
        bb.unmap_buffer_dma(buf)


def test_failed_export_rolls_back_every_bank() -> None:
    dev = FakeTlbDevice(fail_export_at=5)
    bb = TtKmdBankBuffers(dev, window_map_bytes=MAP_BYTES)
    with pytest.raises(TtKmdError, match="export refused"):
        bb.map_buffer_dma(make_buffer())
    assert bb.live_windows == 0 and not dev.mapped and not dev.config and len(dev.free_ids) == 8
    assert len(dev.exports) == 5 and not any(fd_is_open(fd) for fd in dev.exports)
    assert bb.mapped_buffers() == []


def test_too_few_bar4_windows_rolls_back() -> None:
    dev = FakeTlbDevice(windows=3)  # e.g. a BAR4 of 12 GiB
    bb = TtKmdBankBuffers(dev, window_map_bytes=MAP_BYTES)
    with pytest.raises(TtKmdError) as info:
        bb.map_buffer_dma(make_buffer())
    assert info.value.errno == errno.ENOMEM
    assert bb.live_windows == 0 and len(dev.free_ids) == 3


def test_harvested_p100_has_seven_banks() -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, harvest_mask=1 << 2, window_map_bytes=MAP_BYTES)
    assert bb.get_device_num_bank() == 7
    bb.map_buffer_dma(make_buffer(banks=7))
    assert bb.live_windows == 7
    bb.close()


def test_wormhole_backend_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedArchError, match="Wormhole"):
        TtKmdBankBuffers(FakeTlbDevice(arch=Arch.WORMHOLE))


def test_mooncake_path_announces_range_to_peermem_first() -> None:
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_map_bytes=MAP_BYTES)
    buf = make_buffer()
    bb.map_buffer_dma(buf)
    m = bb.bank_mapping(buf, 2)
    engine, peermem = FakeMooncakeEngine(), FakeTtPeermem()
    [handle] = register_bank_with_mooncake(engine, m, peermem)
    assert engine.registered == [(m.host_address, buf.size_per_bank)]
    # tt_peermem gets the page-rounded exported range (dma-buf offset 0) that contains the region
    va, nbytes, fd, off = peermem.ranges[handle]
    assert (fd, off) == (m.dmabuf_fd, 0) and va % 4096 == 0 and nbytes % 4096 == 0
    assert va <= m.host_address and m.host_address + m.nbytes <= va + nbytes
    assert m.host_address - va == m.dmabuf_offset
    unregister_bank_from_mooncake(engine, m, peermem, [handle])
    assert not engine.registered and not peermem.ranges
    failing = FakeMooncakeEngine(rc=-1)
    with pytest.raises(RuntimeError, match="tt_peermem module must be loaded"):
        register_bank_with_mooncake(failing, m, peermem)
    assert not peermem.ranges  # rolled back
    bb.close()


def test_dmabuf_mr_path_without_pyverbs_says_how_to_install() -> None:
    from vllm_hawk.npu.tt_kmd.registration import pyverbs_available, register_bank_dmabuf_mr

    if pyverbs_available():
        pytest.skip("pyverbs installed; the MR itself needs an RDMA device and a Blackhole")
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_map_bytes=MAP_BYTES)
    buf = make_buffer()
    bb.map_buffer_dma(buf)
    with pytest.raises(RuntimeError, match="apt-get install python3-pyverbs"):
        register_bank_dmabuf_mr(object(), bb.bank_mapping(buf, 0))
    bb.close()


def test_receive_buffers_allocate_copy_and_free_through_the_windows() -> None:
    """What the sinks call beyond Table 6: allocate_bank_buffers from the backend's own
    lockstep allocator, copy_in_banks by memmove inside a bank's mapped window, free_buffer
    (unmapping first), live_buffers, and a dma_written with nothing to move."""
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_map_bytes=MAP_BYTES)
    assert bb.num_banks == bb.get_device_num_bank() == 8 and bb.profile.name == "p150a"
    buf = bb.allocate_bank_buffers(8192)
    assert buf.address >= bb.profile.dram_unreserved_base and buf.size_per_bank >= 8192
    bb.map_buffer_dma(buf)
    assert bb.live_buffers() == [buf] and bb.dma_written([0], [buf.address], [16]) == 0
    for bank in (0, 7):
        a = bb.get_buffer_address_bank(buf, bank)
        ctypes.memmove(a, bytes(range(bank, bank + 64)), 64)
    src, dst, n = np.array([buf.address]), np.array([buf.address + 4096]), np.array([64])
    assert bb.copy_in_banks([(0, src, dst, n), (7, src, dst, n)]) == 2
    for bank in (0, 7):
        a = bb.get_buffer_address_bank(buf, bank)
        assert ctypes.string_at(a + 4096, 64) == bytes(range(bank, bank + 64))
    with pytest.raises(BankBufferError, match="no mapped TLB window"):
        bb.copy_in_banks([(1, np.array([MAP_BYTES]), dst, n)])
    bb.free_buffer(buf)
    assert bb.live_buffers() == [] and bb.live_windows == 0 and not dev.mapped
    with pytest.raises(BankBufferError, match="unknown or freed"):
        bb.free_buffer(buf)


def test_profile_must_have_the_devices_bank_count() -> None:
    assert TtKmdBankBuffers(FakeTlbDevice(), harvest_mask=1 << 2, window_map_bytes=MAP_BYTES).profile.name == "p100"
    with pytest.raises(ValueError, match="'p150a' has 8 banks; this device has 7"):
        TtKmdBankBuffers(FakeTlbDevice(), harvest_mask=1 << 2, window_map_bytes=MAP_BYTES, profile="p150a")


def test_2m_windows_are_aimed_at_each_buffers_own_window() -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_bytes=2 * MiB)
    a = make_buffer(1, address=0x20_0040, pages=16)
    bb.map_buffer_dma(a)
    assert bb.live_windows == 8 and dev.pool.free(2 * MiB) == 201 - 8 and len(dev.free_ids) == 8
    assert {base for _, base in dev.config.values()} == {0x20_0000}
    m = bb.bank_mapping(a, 3)
    assert m.plan.window_size == 2 * MiB and m.host_address == m.window_va + 0x40
    b = make_buffer(2, address=0x40_0000, pages=16)
    bb.map_buffer_dma(b)
    assert bb.live_windows == 16  # another 2 MiB window per bank
    bb.close()
    assert bb.live_windows == 0 and dev.pool.free(2 * MiB) == 201 and not dev.mapped


def test_window_sizes_are_a_blackholes() -> None:
    with pytest.raises(ValueError, match="window_bytes 0x1000000: a Blackhole's TLB windows are 2 MiB or 4 GiB"):
        TtKmdBankBuffers(FakeTlbDevice(), window_bytes=16 * MiB)
    with pytest.raises(ValueError, match="<= the 2 MiB window"):
        TtKmdBankBuffers(FakeTlbDevice(), window_bytes=2 * MiB, window_map_bytes=4 * MiB)


def test_receive_buffers_with_2m_windows_take_whole_aligned_windows() -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_bytes=2 * MiB)
    bufs = [bb.allocate_bank_buffers(size) for size in (8192, 2 * MiB, 1 * MiB, 2 * MiB + 64)]
    assert all(b.address % (2 * MiB) == 0 for b in bufs)
    assert [b.size_per_bank for b in bufs] == [2 * MiB] * 3 + [4 * MiB]
    assert bufs[0].address >= bb.profile.dram_unreserved_base
    for buf in bufs:
        bb.map_buffer_dma(buf)
    assert bb.live_windows == 8 * 5
    for buf in bufs:
        bb.free_buffer(buf)
    assert bb.live_windows == 0 and bb.live_buffers() == []


def test_adopt_maps_a_buffer_tt_metal_allocated_and_release_leaves_its_dram() -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_bytes=2 * MiB)
    ttnn_buffer = make_buffer(77, address=0x30_0000, pages=64)
    assert bb.adopt(ttnn_buffer) is ttnn_buffer
    assert bb.adopted_buffers() == [ttnn_buffer] and bb.live_buffers() == [ttnn_buffer]
    assert bb.get_buffer_address_bank(ttnn_buffer, 0) == bb.bank_mapping(ttnn_buffer, 0).window_va + 0x10_0000
    with pytest.raises(BankBufferError, match="already adopted"):
        bb.adopt(ttnn_buffer)
    with pytest.raises(BankBufferError, match="tt-metal's \\(adopted\\): release\\(\\) it here"):
        bb.free_buffer(ttnn_buffer)
    with pytest.raises(BankBufferError, match="DRAM is tt-metal's.*adopt\\(\\) them"):
        bb.allocate_bank_buffers(4096)
    with pytest.raises(BankBufferError, match="outside the \\[0x100080, 0xff000000\\)"):
        bb.adopt(make_buffer(78, address=0x40))
    bb.release(ttnn_buffer)
    assert bb.adopted_buffers() == [] and bb.live_windows == 0
    with pytest.raises(BankBufferError, match="unknown or freed"):
        bb.release(ttnn_buffer)
    own = TtKmdBankBuffers(FakeTlbDevice(), window_bytes=2 * MiB)
    own.allocate_bank_buffers(4096)
    with pytest.raises(BankBufferError, match="two allocators would hand out the same DRAM"):
        own.adopt(make_buffer(79, address=0x30_0000))


def test_export_is_refused_to_an_fd_that_does_not_own_the_window() -> None:
    pool = FakeTlbPool()
    tt_metal = hold_like_tt_metal(pool)
    ours = FakeTlbDevice(pool=pool)
    theirs = TlbWindow(id=202, size=4 * GiB, mmap_offset_uc=0, mmap_offset_wc=0)
    assert pool.owner[202] is tt_metal
    with pytest.raises(TtKmdError) as info:
        ours.export_dmabuf(theirs, 0, mmap.PAGESIZE)
    assert info.value.errno == errno.EPERM


def test_enomem_names_the_window_size_tt_metal_and_the_processes_holding_the_device(tmp_path: Path) -> None:
    node = (tmp_path / "tenstorrent-0").resolve()
    node.write_bytes(b"")
    pool = FakeTlbPool()
    tt_metal = hold_like_tt_metal(pool, path=node)  # the same process, as ttnn in the decode worker
    ours = FakeTlbDevice(pool=pool, path=node)
    bb = TtKmdBankBuffers(ours, window_map_bytes=MAP_BYTES)
    with pytest.raises(TtKmdError) as info:
        bb.map_buffer_dma(make_buffer())
    text = str(info.value)
    assert info.value.errno == errno.ENOMEM
    assert "ALLOCATE_TLB(4 GiB) for bank 0: no window of 4 GiB is free" in text
    assert "tt-metal's configure_static_tlbs holds 8 on a p150a" in text
    assert f"(pid {os.getpid()})" in text and str(node) in text
    assert bb.live_windows == 0
    # the planned staged route: 2 MiB windows, 45 of them left next to tt-metal
    staged = TtKmdBankBuffers(ours, window_bytes=2 * MiB)
    bufs = [make_buffer(10 + i, address=(2 + i) * 2 * MiB, pages=16) for i in range(5)]
    for buf in bufs:
        staged.adopt(buf)
    assert staged.live_windows == 40 and pool.free(2 * MiB) == 5
    with pytest.raises(TtKmdError, match="no window of 2 MiB is free.*holds 156"):
        staged.adopt(make_buffer(20, address=20 * MiB, pages=16))
    staged.close()
    ours.close()
    tt_metal.close()
    assert pool.free(2 * MiB) == 201 and pool.free(4 * GiB) == 8


def test_device_holders_scans_a_proc_tree(tmp_path: Path) -> None:
    for pid, comm, targets in ((12, "python3", ["/dev/tenstorrent/0", "pipe:[1]"]), (7, "tt-smi", ["/dev/null"])):
        fd_dir = tmp_path / "proc" / str(pid) / "fd"
        fd_dir.mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "comm").write_text(comm + "\n")
        for i, target in enumerate(targets):
            (fd_dir / str(i)).symlink_to(target)
    (tmp_path / "proc" / "self").mkdir()
    (tmp_path / "proc" / "99").mkdir()  # a process whose fds cannot be listed
    assert device_holders("/dev/tenstorrent/0", proc_root=tmp_path) == [(12, "python3")]
    assert device_holders("/dev/tenstorrent/1", proc_root=tmp_path) == []
    assert device_holders("/dev/tenstorrent/0", proc_root=tmp_path / "absent") == []


def test_dram_write_barrier_reads_one_word_through_every_live_window(monkeypatch: pytest.MonkeyPatch) -> None:
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_bytes=2 * MiB)
    reads: list[int] = []
    real_read = bank_buffers_module._read_word
    monkeypatch.setattr(bank_buffers_module, "_read_word", lambda address: reads.append(address) or 0)
    bb.dram_write_barrier()
    assert reads == []  # nothing mapped, nothing to drain
    buf = bb.allocate_bank_buffers(4096)
    bb.map_buffer_dma(buf)
    bb.dram_write_barrier()
    assert sorted(reads) == sorted(bb.bank_mapping(buf, b).window_va for b in range(8))
    ctypes.c_uint32.from_address(bb.bank_mapping(buf, 0).window_va).value = 0xC0FFEE
    assert real_read(bb.bank_mapping(buf, 0).window_va) == 0xC0FFEE
    bb.close()


def test_package_exports_the_window_plan_next_to_the_backend() -> None:
    from vllm_hawk.npu.tt_kmd import window_plan

    assert tt_kmd.plan_route_windows is window_plan.plan_route_windows
    assert tt_kmd.WindowsRefused is window_plan.WindowsRefused
