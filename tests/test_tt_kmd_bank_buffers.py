"""TtKmdBankBuffers' bookkeeping against FakeTlbDevice, a fake ONLY at the hardware
boundary (the tt-kmd ioctls + mmap of BAR4). The fake enforces the tt-kmd rules we rely
on (exact 4 GiB windows, at most 8, size-aligned base, page-aligned export inside the
window, FREE_TLB refused while mapped) and backs each window with anonymous memory, so
host addresses are real and writable. Nothing here proves the real driver behaves so:
that needs a Blackhole."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import pytest

from vllm_hawk.npu.bank_buffer import BankBufferAPI, BankBufferError, DeviceBuffer
from vllm_hawk.npu.tt_kmd.bank_buffers import TtKmdBankBuffers
from vllm_hawk.npu.tt_kmd.device import TlbDevice, TlbWindow, TtKmdError
from vllm_hawk.npu.tt_kmd.registration import register_bank_with_mooncake, unregister_bank_from_mooncake
from vllm_hawk.npu.tt_kmd.topology import Arch, NocEndpoint, UnsupportedArchError

GiB = 1 << 30
MAP_BYTES = 64 << 20  # map only the first 64 MiB of each fake window

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_NORESERVE = 0x4000


class FakeTlbDevice:
    """FAKE Blackhole at the tt-kmd boundary (see module docstring)."""

    def __init__(self, arch: Arch = Arch.BLACKHOLE, windows: int = 8, fail_export_at: int | None = None):
        self.arch = arch
        self.page_size = mmap.PAGESIZE
        self.free_ids = list(range(202, 202 + windows))  # BH: 4 GiB windows follow 202 2 MiB ones
        self.config: dict[int, tuple[NocEndpoint, int]] = {}
        self.mapped: dict[int, tuple[int, int]] = {}  # va -> (window id, length)
        self.exports: list[int] = []
        self.fail_export_at = fail_export_at
        self.calls: list[str] = []

    def allocate_tlb(self, size: int) -> TlbWindow:
        self.calls.append("allocate")
        if size != 4 * GiB:
            raise TtKmdError(errno.EINVAL, "fake: only 4 GiB windows")
        if not self.free_ids:
            raise TtKmdError(errno.ENOMEM, "fake: no free 4 GiB window")
        wid = self.free_ids.pop(0)
        return TlbWindow(id=wid, size=size, mmap_offset_uc=(6 << 36) + wid, mmap_offset_wc=(7 << 36) + wid)

    def configure_tlb(self, window: TlbWindow, endpoint: NocEndpoint, noc_address: int, ordering: int = 0) -> None:
        self.calls.append("configure")
        assert noc_address % window.size == 0
        self.config[window.id] = (endpoint, noc_address)

    def map_window(self, window: TlbWindow, length: int, write_combined: bool = True) -> int:
        self.calls.append("map")
        assert window.id in self.config and 0 < length <= window.size and length % self.page_size == 0
        va = _libc.mmap(
            None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0
        )
        assert va not in (None, ctypes.c_void_p(-1).value)
        self.mapped[va] = (window.id, length)
        return va

    def unmap_window(self, address: int, length: int) -> None:
        self.calls.append("unmap")
        assert self.mapped.pop(address)[1] == length
        assert _libc.munmap(address, length) == 0

    def export_dmabuf(self, window: TlbWindow, offset: int, size: int) -> int:
        self.calls.append("export")
        if self.fail_export_at is not None and len(self.exports) == self.fail_export_at:
            raise TtKmdError(errno.EINVAL, "fake: export refused")
        assert offset % self.page_size == 0 and size % self.page_size == 0 and offset + size <= window.size
        fd = os.memfd_create("fake-dmabuf")
        self.exports.append(fd)
        return fd

    def free_tlb(self, window: TlbWindow) -> None:
        self.calls.append("free")
        if any(wid == window.id for wid, _ in self.mapped.values()):
            raise TtKmdError(errno.EBUSY, "fake: FREE_TLB while mapped")
        del self.config[window.id]
        self.free_ids.append(window.id)


def make_buffer(
    buffer_id: int = 1, address: int = 0x10_0040, pages: int = 80, page: int = 1088, banks: int = 8
) -> DeviceBuffer:
    aligned = -(-page // 64) * 64
    return DeviceBuffer(
        buffer_id=buffer_id,
        address=address,
        size_per_bank=-(-pages // banks) * aligned,
        page_size=page,
        num_pages=pages,
        aligned_page_size=aligned,
        num_banks=banks,
    )


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


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


class RecordingEngine:
    """Stands in for mooncake.engine.TransferEngine's register_memory/unregister_memory."""

    def __init__(self, rc: int = 0) -> None:
        self.rc, self.registered = rc, []

    def register_memory(self, addr: int, length: int) -> int:
        self.registered.append((addr, length))
        return self.rc

    def unregister_memory(self, addr: int) -> int:
        self.registered = [r for r in self.registered if r[0] != addr]
        return 0


class RecordingPeermem:
    """Stands in for the tt_peermem char device (kernel module, not loadable here)."""

    def __init__(self) -> None:
        self.ranges: dict[int, tuple[int, int, int, int]] = {}

    def register(self, va: int, length: int, dmabuf_fd: int, dmabuf_offset: int) -> int:
        handle = len(self.ranges) + 1
        self.ranges[handle] = (va, length, dmabuf_fd, dmabuf_offset)
        return handle

    def unregister(self, handle: int) -> None:
        del self.ranges[handle]


def test_mooncake_path_announces_range_to_peermem_first() -> None:
    bb = TtKmdBankBuffers(FakeTlbDevice(), window_map_bytes=MAP_BYTES)
    buf = make_buffer()
    bb.map_buffer_dma(buf)
    m = bb.bank_mapping(buf, 2)
    engine, peermem = RecordingEngine(), RecordingPeermem()
    handle = register_bank_with_mooncake(engine, m, peermem)
    assert engine.registered == [(m.host_address, buf.size_per_bank)]
    # tt_peermem gets the page-rounded exported range (dma-buf offset 0) that contains the region
    va, nbytes, fd, off = peermem.ranges[handle]
    assert (fd, off) == (m.dmabuf_fd, 0) and va % 4096 == 0 and nbytes % 4096 == 0
    assert va <= m.host_address and m.host_address + m.nbytes <= va + nbytes
    assert m.host_address - va == m.dmabuf_offset
    unregister_bank_from_mooncake(engine, m, peermem, handle)
    assert not engine.registered and not peermem.ranges
    failing = RecordingEngine(rc=-1)
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
