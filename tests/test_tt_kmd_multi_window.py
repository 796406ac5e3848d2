"""Bank regions over several consecutive 2 MiB TLB windows (the staged route on a p150),
against the tt-kmd fakes of ``tests/tt_kmd_fakes.py`` (below the ioctl boundary). Nothing
here proves the real driver behaves so: that needs a Blackhole."""

from __future__ import annotations

import ctypes
import errno
import mmap

import numpy as np
import pytest
from tt_kmd_fakes import (
    FakeMooncakeEngine,
    FakeTlbDevice,
    FakeTlbPool,
    FakeTtPeermem,
    fd_is_open,
    hold_like_tt_metal,
)

from vllm_hawk.npu.bank_buffer import BankBufferError, DeviceBuffer
from vllm_hawk.npu.tt_kmd import bank_buffers as bank_buffers_module
from vllm_hawk.npu.tt_kmd import bank_windows
from vllm_hawk.npu.tt_kmd.bank_buffers import TtKmdBankBuffers
from vllm_hawk.npu.tt_kmd.device import TtKmdError
from vllm_hawk.npu.tt_kmd.registration import (
    peermem_range,
    register_bank_dmabuf_mr,
    register_bank_with_mooncake,
    unregister_bank_from_mooncake,
)
from vllm_hawk.npu.tt_kmd.topology import blackhole_bank_endpoint, plan_tlb_windows

MiB = 1 << 20
W = 2 * MiB
PAGE = mmap.PAGESIZE


def region(buffer_id: int, address: int, size_per_bank: int) -> DeviceBuffer:
    """A buffer of ``size_per_bank`` bytes per bank over the 8 banks of a p150, at ``address``."""
    return DeviceBuffer(buffer_id, address, size_per_bank, 64, size_per_bank // 64 * 8, 64, 8)


@pytest.fixture
def reservations(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """The address ranges reserved (reserve_va) and not yet released, address -> length."""
    live: dict[int, int] = {}
    real_reserve, real_release = bank_windows.reserve_va, bank_windows.release_va

    def reserve(length: int) -> int:
        va = real_reserve(length)
        live[va] = length
        return va

    def release(va: int, length: int) -> None:
        assert live.pop(va) == length
        real_release(va, length)

    monkeypatch.setattr(bank_windows, "reserve_va", reserve)
    monkeypatch.setattr(bank_windows, "release_va", release)
    return live


def test_plan_splits_a_range_at_window_boundaries() -> None:
    plans = plan_tlb_windows(0x30_0040, 8 * MiB, W, PAGE)
    assert [p.window_base for p in plans] == [0x20_0000 + i * W for i in range(5)]
    assert [p.offset for p in plans] == [0x10_0040, 0, 0, 0, 0]
    assert sum(p.nbytes for p in plans) == 8 * MiB and plans[0].nbytes == W - 0x10_0040
    assert plans[-1].nbytes == 0x10_0040 and plans[-1].export_size == 0x10_0000 + PAGE
    assert [p.export_offset for p in plans] == [0x10_0000, 0, 0, 0, 0]
    assert len(plan_tlb_windows(0x20_0000, W, W, PAGE)) == 1


def test_a_region_over_five_windows_is_one_contiguous_host_range_per_bank(reservations) -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_bytes=W)
    buf = region(1, 0x30_0040, 8 * MiB)
    bb.map_buffer_dma(buf)
    assert bb.live_windows == 40 and dev.pool.free(W) == 201 - 40 and len(reservations) == 8
    for bank in range(8):
        m = bb.bank_mapping(buf, bank)
        assert m.host_address == m.window_va + 0x10_0040 == bb.get_buffer_address_bank(buf, bank)
        assert m.nbytes == bb.get_buffer_size_bank(buf, bank) == 8 * MiB
        assert reservations[m.window_va] == 5 * W
        endpoint = blackhole_bank_endpoint(bank)
        address = m.host_address
        for i, seg in enumerate(m.segments):
            assert seg.host_address == address  # consecutive parts, no gap
            address += seg.nbytes
            # the window mapped at window_va + i x 2 MiB is the one aimed at base + i x 2 MiB of this bank
            assert dev.mapped[m.window_va + i * W] == (seg.window.id, W)
            assert dev.config[seg.window.id] == (endpoint, 0x20_0000 + i * W)
        # the whole range is writable host memory, across the window boundaries
        data = bytes([bank + 1]) * (8 * MiB)
        ctypes.memmove(m.host_address, data, len(data))
        assert ctypes.string_at(m.segments[3].host_address - 8, 16) == bytes([bank + 1]) * 16
    bb.close()
    assert bb.live_windows == 0 and dev.pool.free(W) == 201 and not dev.mapped and not reservations


def test_one_dma_buf_per_window_over_the_parts_page_rounded_range() -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_bytes=W)
    buf = region(1, 0x30_0040, 8 * MiB)
    bb.map_buffer_dma(buf)
    assert len(dev.exports) == 8 * 5 and all(fd_is_open(fd) for fd in dev.exports)
    m = bb.bank_mapping(buf, 2)
    assert len({s.dmabuf_fd for s in m.segments}) == 5
    first, last = m.segments[0], m.segments[-1]
    assert (first.plan.export_offset, first.plan.export_size, first.dmabuf_offset) == (0x10_0000, 0x10_0000, 0x40)
    assert all((s.plan.export_offset, s.plan.export_size, s.dmabuf_offset) == (0, W, 0) for s in m.segments[1:-1])
    assert (last.plan.export_offset, last.plan.export_size) == (0, 0x10_0000 + PAGE)
    assert first.export_address == m.window_va + 0x10_0000 and last.export_address == m.window_va + 4 * W
    with pytest.raises(ValueError, match="spans 5 TLB windows, each with its own dma-buf"):
        m.dmabuf_fd  # noqa: B018 - the property raises
    bb.unmap_buffer_dma(buf)
    assert not any(fd_is_open(fd) for fd in dev.exports)


def test_buffers_share_the_windows_they_have_in_common(reservations) -> None:
    dev = FakeTlbDevice()
    bb = TtKmdBankBuffers(dev, window_bytes=W)
    inside = region(1, 0x20_1000, 64 * 1024)  # inside window 0x200000
    over = region(2, 0x20_2000, 3 * MiB)  # windows 0x200000 and 0x400000
    same = region(3, 0x20_8000, 2 * MiB)  # the same two windows
    bb.map_buffer_dma(inside)
    bb.map_buffer_dma(over)
    assert bb.live_windows == 16 and dev.calls.count("allocate") == 16
    maps = dev.calls.count("map")
    bb.map_buffer_dma(same)  # its run (same two windows) is shared: nothing allocated or mapped
    assert bb.live_windows == 16 and dev.calls.count("map") == maps
    # one window, two mappings (tt-kmd allows several): both alias the same device bytes
    for bank in (0, 5):
        a = bb.get_buffer_address_bank(inside, bank)
        b = bb.get_buffer_address_bank(over, bank)
        assert bb.bank_mapping(inside, bank).window.id == bb.bank_mapping(over, bank).segments[0].window.id
        assert b - bb.bank_mapping(over, bank).window_va == 0x2000 and a != b
    assert bb.get_buffer_address_bank(same, 1) - bb.get_buffer_address_bank(over, 1) == 0x6000
    bb.unmap_buffer_dma(over)
    assert bb.live_windows == 16  # `same` holds both windows
    bb.unmap_buffer_dma(same)
    assert bb.live_windows == 8 and len(reservations) == 0  # `inside` holds the first
    bb.unmap_buffer_dma(inside)
    assert bb.live_windows == 0 and not dev.mapped and dev.pool.free(W) == 201


def test_enomem_midway_rolls_back_every_bank_and_names_tt_metal(reservations) -> None:
    pool = FakeTlbPool()
    tt_metal = hold_like_tt_metal(pool)
    assert pool.free(W) == 45
    ours = FakeTlbDevice(pool=pool)
    bb = TtKmdBankBuffers(ours, window_bytes=W)
    with pytest.raises(TtKmdError) as info:
        bb.adopt(region(1, 0x40_0000, 12 * MiB))  # 8 banks x 6 windows = 48 > 45
    assert info.value.errno == errno.ENOMEM
    assert "ALLOCATE_TLB(2 MiB) for bank 7: no window of 2 MiB is free" in str(info.value)
    assert "tt-metal's configure_static_tlbs holds 156" in str(info.value)
    assert bb.live_windows == 0 and pool.free(W) == 45 and not ours.mapped and not reservations
    assert not any(fd_is_open(fd) for fd in ours.exports) and bb.adopted_buffers() == [] and bb.mapped_buffers() == []
    bb.adopt(region(2, 0x40_0000, 10 * MiB))  # 8 x 5 = 40 fits
    assert pool.free(W) == 5
    bb.close()
    tt_metal.close()
    assert pool.free(W) == 201


def test_a_failed_mmap_midway_unmaps_the_run_and_frees_its_windows(reservations) -> None:
    dev = FakeTlbDevice()
    real_map, maps = dev.map_window, []

    def flaky_map(window, length, write_combined=True, at=None):
        if len(maps) == 13:
            raise TtKmdError(errno.EAGAIN, "fake mmap refused")
        maps.append(window.id)
        return real_map(window, length, write_combined, at)

    dev.map_window = flaky_map
    bb = TtKmdBankBuffers(dev, window_bytes=W)
    with pytest.raises(TtKmdError, match="fake mmap refused"):
        bb.map_buffer_dma(region(1, 0x20_0000, 8 * MiB))  # 4 windows per bank: fails in bank 3
    assert bb.live_windows == 0 and not dev.mapped and not reservations and dev.pool.free(W) == 201
    assert not any(fd_is_open(fd) for fd in dev.exports)


def test_a_failed_export_midway_closes_every_dma_buf_and_frees_every_window(reservations) -> None:
    dev = FakeTlbDevice(fail_export_at=7)  # bank 1's third window
    bb = TtKmdBankBuffers(dev, window_bytes=W)
    with pytest.raises(TtKmdError, match="export refused"):
        bb.map_buffer_dma(region(1, 0x30_0040, 8 * MiB))
    assert len(dev.exports) == 7 and not any(fd_is_open(fd) for fd in dev.exports)
    assert bb.live_windows == 0 and not dev.mapped and not reservations and dev.pool.free(W) == 201


def test_partial_window_mappings_cannot_hold_a_region_over_several_windows() -> None:
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_bytes=W, window_map_bytes=1 * MiB)
    with pytest.raises(BankBufferError, match="spans 2 TLB windows of 2 MiB.*window_map_bytes \\(0x100000\\)"):
        bb.map_buffer_dma(region(1, 0x20_0000, 3 * MiB))


def test_copies_cross_window_boundaries_and_the_barrier_reads_each_window_once(monkeypatch) -> None:
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_bytes=W)
    a, b = region(1, 0x20_0000, 6 * MiB), region(2, 0x40_0000, 2 * MiB)  # b's window is a's second
    bb.map_buffer_dma(a)
    bb.map_buffer_dma(b)
    start = bb.get_buffer_address_bank(a, 4)
    ctypes.memmove(start + W - 32, bytes(range(64)), 64)
    src, dst, n = np.array([0x20_0000 + W - 32]), np.array([0x20_0000 + 2 * W - 16]), np.array([64])
    assert bb.copy_in_banks([(4, src, dst, n)]) == 1
    assert ctypes.string_at(start + 2 * W - 16, 64) == bytes(range(64))
    reads: list[int] = []
    monkeypatch.setattr(bank_buffers_module, "_read_word", lambda address: reads.append(address) or 0)
    bb.dram_write_barrier()
    assert len(reads) == bb.live_windows == 8 * 3
    assert start in reads and bb.bank_mapping(a, 4).window_va + 2 * W in reads
    bb.close()


def test_allocated_receive_buffers_take_whole_windows_and_map_over_several() -> None:
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_bytes=W)
    buf = bb.allocate_bank_buffers(5 * MiB)
    assert buf.address % W == 0 and buf.size_per_bank == 6 * MiB
    bb.map_buffer_dma(buf)
    assert bb.live_windows == 24 and len(bb.bank_mapping(buf, 0).segments) == 3
    bb.free_buffer(buf)
    assert bb.live_windows == 0


def test_each_window_is_registered_on_its_own_for_mooncake_and_tt_peermem() -> None:
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_bytes=W)
    buf = region(1, 0x20_0000, 6 * MiB)
    bb.map_buffer_dma(buf)
    m = bb.bank_mapping(buf, 6)
    engine, peermem = FakeMooncakeEngine(), FakeTtPeermem()
    handles = register_bank_with_mooncake(engine, m, peermem)
    assert len(handles) == 3 and engine.registered == [(s.host_address, s.nbytes) for s in m.segments]
    assert list(peermem.ranges.values()) == [(*peermem_range(s)[:2], s.dmabuf_fd, 0) for s in m.segments]
    assert [r[:2] for r in peermem.ranges.values()] == [(s.export_address, s.plan.export_size) for s in m.segments]
    unregister_bank_from_mooncake(engine, m, peermem, handles)
    assert not engine.registered and not peermem.ranges
    failing = FakeMooncakeEngine(rc=-1, fail_at=2)  # the third window is refused
    with pytest.raises(RuntimeError, match="tt_peermem module must be loaded"):
        register_bank_with_mooncake(failing, m, peermem)
    assert not failing.registered and not peermem.ranges  # the first two rolled back
    with pytest.raises(ValueError, match="spans 3 TLB windows.*register_bank_dmabuf_mrs"):
        register_bank_dmabuf_mr(object(), m)
    bb.close()
