"""The tt-kmd fakes (``tests/tt_kmd_fakes.py``) keep the driver's rules that the route
choice (``vllm_hawk.tenstorrent.route``) and the bank buffers rely on: per-device window
pools shared by every fd, ENOMEM with the real device's text, the driver version behind
``supports_dmabuf_export``, ownership per fd, Wormhole's window sizes, and device nodes
that may be absent."""

from __future__ import annotations

import errno
import mmap

import pytest
from tt_kmd_fakes import FakeTlbDevice, FakeTlbPool, FakeTtKmd, hold_like_tt_metal

from vllm_hawk.npu.tt_kmd.bank_buffers import TtKmdBankBuffers
from vllm_hawk.npu.tt_kmd.device import DriverInfo, TlbDevice, TtDeviceNotFoundError, TtKmdError
from vllm_hawk.npu.tt_kmd.topology import Arch, UnsupportedArchError
from vllm_hawk.npu.tt_kmd.window_plan import DEVICE_WINDOWS, tt_metal_held_windows

MiB = 1 << 20
GiB = 1 << 30


def test_open_finds_devices_by_pci_number_and_names_what_is_missing() -> None:
    host = FakeTtKmd({0: FakeTlbPool(), 3: FakeTlbPool(arch=Arch.WORMHOLE)})
    assert host.open(3, "/").arch is Arch.WORMHOLE and host.open(0).arch is Arch.BLACKHOLE
    assert isinstance(host.opened[0], TlbDevice)
    with pytest.raises(TtDeviceNotFoundError, match="no Tenstorrent device 1: /dev/tenstorrent holds only \\[0, 3\\]"):
        host.open(1, "/")
    with pytest.raises(TtDeviceNotFoundError, match="Install and load tt-kmd >= 2.10.0"):
        FakeTtKmd({}).open(0, "/")


@pytest.mark.parametrize(("version", "exports"), [((2, 9, 1), False), ((2, 10, 0), True), ((3, 0, 0), True)])
def test_driver_info_is_a_real_driver_info_and_old_drivers_cannot_export(version, exports) -> None:
    dev = FakeTtKmd({0: FakeTlbPool(driver_version=version)}).open(0)
    info = dev.driver_info()
    assert isinstance(info, DriverInfo) and info.version == version and info.supports_dmabuf_export is exports
    window = dev.allocate_tlb(2 * MiB)
    if exports:
        assert dev.export_dmabuf(window, 0, mmap.PAGESIZE) >= 0
    else:
        with pytest.raises(TtKmdError) as err:
            dev.export_dmabuf(window, 0, mmap.PAGESIZE)
        assert err.value.errno == errno.ENOTTY


def test_one_pool_per_size_per_device_shared_by_every_fd_and_freed_on_close() -> None:
    host = FakeTtKmd()
    a, b = host.open(0), host.open(0)
    got = [a.allocate_tlb(4 * GiB) for _ in range(5)] + [b.allocate_tlb(4 * GiB) for _ in range(3)]
    assert [w.id for w in got] == list(range(202, 210))
    with pytest.raises(TtKmdError) as err:
        b.allocate_tlb(4 * GiB)
    assert err.value.errno == errno.ENOMEM
    assert "every window of that size is taken" in err.value.strerror  # the real device's text
    with pytest.raises(TtKmdError) as err:
        b.free_tlb(got[0])  # a's window
    assert err.value.errno == errno.EPERM
    a.close()
    assert host.devices[0].free(4 * GiB) == 5 and b.allocate_tlb(4 * GiB).id == 202
    with pytest.raises(TtKmdError) as err:
        a.allocate_tlb(2 * MiB)
    assert err.value.errno == errno.EBADF
    other = FakeTtKmd({0: FakeTlbPool(), 1: FakeTlbPool()})
    other.open(0).allocate_tlb(4 * GiB)
    assert other.devices[1].free(4 * GiB) == 8  # pools are per device


def test_wormhole_windows_and_what_tt_metal_leaves() -> None:
    pool = FakeTlbPool(arch=Arch.WORMHOLE)
    assert {size: pool.free(size) for size in pool.kinds} == DEVICE_WINDOWS["wormhole"]
    with pytest.raises(TtKmdError) as err:
        FakeTlbDevice(pool=pool).allocate_tlb(4 * GiB)
    assert err.value.errno == errno.EINVAL and "wormhole has no TLB window of that size" in err.value.strerror
    hold_like_tt_metal(pool)
    held = tt_metal_held_windows("wormhole", 12)
    assert pool.free(1 * MiB) == 156 - held[1 * MiB] == 58 and pool.free(16 * MiB) == 19


def test_bank_buffers_on_a_wormhole_are_refused_naming_blackhole_only() -> None:
    with pytest.raises(UnsupportedArchError, match="this backend maps Blackhole DRAM banks only"):
        TtKmdBankBuffers(FakeTlbDevice(arch=Arch.WORMHOLE))
