"""FAKES of tt-kmd below the ioctl boundary, shared by the tests (``from tt_kmd_fakes import ...``).

Each method of :class:`~vllm_hawk.npu.tt_kmd.device.TtKmdDevice` is one ioctl or mmap of
``/dev/tenstorrent/N``; :class:`FakeTlbDevice` stands in for one such open fd,
:class:`FakeTlbPool` for the device tt-kmd drives (its window pools, arch and driver
version), :class:`FakeTtKmd` for the ``/dev/tenstorrent`` nodes of a host
(``FakeTtKmd.open(pci, dev_root)`` takes the place of ``TtKmdDevice.open``). Window
mappings are anonymous memory, so host addresses are real and writable; dma-buf fds are
memfds. Nothing here proves the real driver behaves so: that needs a Tenstorrent card.

Driver rules enforced (tt-kmd ttkmd-2.10.0-6-g4af7192, commit 4af71921ac02; the project's
docs/tenstorrent-route-evidence.md, section a):

- one pool of windows per size per device, shared by every fd of every process
  (``tlb.c`` ``tenstorrent_device_allocate_tlb``); first free id first; ENOMEM when a size's
  pool is empty, EINVAL for a size the arch lacks; window counts and ids as ``blackhole.c``
  (2 MiB ids 0-201, 201 the kernel's; 4 GiB ids 202.., as many as BAR4 holds, at most 8)
  and ``wormhole.c`` (1 MiB x 156, 2 MiB x 10, 16 MiB x 20, the last the kernel's);
- ownership per open fd (``memory.c`` ``ioctl_allocate_tlb`` sets the bit in the fd's
  ``priv->tlbs``): CONFIGURE_TLB, mmap, EXPORT_TLB_DMABUF and FREE_TLB of a window another
  fd owns answer EPERM; closing an fd returns its windows (``chardev.c``
  ``tt_cdev_release_tlbs``);
- CONFIGURE_TLB needs a window-size-aligned base; mmap starts at the window's first byte,
  is a page multiple of at most the window, and a window may be mapped several times
  (``map_tlb_window``, ``tlb_refs``); FREE_TLB of a mapped window answers EBUSY;
- EXPORT_TLB_DMABUF needs tt-kmd >= 2.10.0 (ENOTTY before: an unknown ioctl), a page-aligned
  range inside the window (EINVAL) and the owning fd (EPERM) (``ioctl_export_tlb_dmabuf``);
- GET_DRIVER_INFO returns the configured version (a real ``DriverInfo``, so
  ``supports_dmabuf_export`` is the real property).

The error texts are the real device's (``device.allocate_tlb_error``,
``device.export_eperm_error``), so callers see what they would on hardware.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

from vllm_hawk.npu.bank_buffer import DeviceBuffer
from vllm_hawk.npu.tt_kmd import sysfs
from vllm_hawk.npu.tt_kmd.device import (
    MAP_FIXED,
    MAP_NORESERVE,
    DriverInfo,
    TlbWindow,
    TtDeviceNotFoundError,
    TtKmdError,
    allocate_tlb_error,
    check_map_length,
    export_eperm_error,
    no_device_message,
)
from vllm_hawk.npu.tt_kmd.topology import Arch, NocEndpoint

MiB = 1 << 20
GiB = 1 << 30

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _id_ranges(arch: Arch, windows_4g: int) -> dict[int, list[int]]:
    """Window bytes -> user-allocatable window ids, as tt-kmd numbers them (see module doc)."""
    if arch is Arch.BLACKHOLE:
        return {2 * MiB: list(range(0, 201)), 4 * GiB: list(range(202, 202 + windows_4g))}
    return {1 * MiB: list(range(0, 156)), 2 * MiB: list(range(156, 166)), 16 * MiB: list(range(166, 185))}


class FakeTlbPool:
    """FAKE of one Tenstorrent device as tt-kmd drives it: its window pools (one per size,
    shared by every fd), its arch and the loaded driver's version (see module doc).
    ``windows_4g``: 4 GiB windows BAR4 holds (Blackhole)."""

    def __init__(
        self, windows_4g: int = 8, arch: Arch = Arch.BLACKHOLE, driver_version: tuple[int, int, int] = (2, 10, 0)
    ) -> None:
        self.arch = arch
        self.driver_version = driver_version
        self.kinds = _id_ranges(arch, windows_4g)
        self.owner: dict[int, FakeTlbDevice] = {}
        self.size_of = {wid: size for size, ids in self.kinds.items() for wid in ids}

    def claim(self, size: int, fd: FakeTlbDevice) -> int:
        if size not in self.kinds:
            raise TtKmdError(errno.EINVAL, os.strerror(errno.EINVAL))
        free = [wid for wid in self.kinds[size] if wid not in self.owner]
        if not free:
            raise TtKmdError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        self.owner[free[0]] = fd
        return free[0]

    def free(self, size: int) -> int:
        """Windows of ``size`` no fd holds."""
        return sum(wid not in self.owner for wid in self.kinds[size])


class FakeTlbDevice:
    """FAKE of one open fd of ``/dev/tenstorrent/N`` (a TtKmdDevice), on ``pool``'s device.

    ``path``: a file the fake holds open, as a real fd holds the node (``device_holders``
    finds it). ``fail_export_at``: the n-th export (0-based) fails with EINVAL.
    ``driver_version``: the loaded tt-kmd's version as this fd sees it (default the pool's)."""

    def __init__(
        self,
        arch: Arch | None = None,
        windows: int = 8,
        fail_export_at: int | None = None,
        pool: FakeTlbPool | None = None,
        path: Path | None = None,
        driver_version: tuple[int, int, int] | None = None,
    ):
        self.pool = pool or FakeTlbPool(windows, arch or Arch.BLACKHOLE)
        self.driver_version = driver_version or self.pool.driver_version
        if arch is not None and arch is not self.pool.arch:
            raise ValueError(f"fake fd of arch {arch} on a {self.pool.arch} device")
        self.page_size = mmap.PAGESIZE
        self.config: dict[int, tuple[NocEndpoint, int]] = {}
        self.mapped: dict[int, tuple[int, int]] = {}  # va -> (window id, length)
        self.exports: list[int] = []
        self.fail_export_at = fail_export_at
        self.calls: list[str] = []
        self.path = path
        self.closed = False
        self._fd = os.open(path, os.O_RDWR) if path is not None else None

    @property
    def arch(self) -> Arch:
        return self.pool.arch

    @property
    def free_ids(self) -> list[int]:
        """Free 4 GiB window ids."""
        return [wid for wid in self.pool.kinds.get(4 * GiB, []) if wid not in self.pool.owner]

    def _open(self, call: str) -> None:
        if self.closed:
            raise TtKmdError(errno.EBADF, f"fake {call}: {self.path or 'the fd'} is closed")

    def _own(self, window: TlbWindow, call: str) -> None:
        self._open(call)
        if self.pool.owner.get(window.id) is not self:
            raise TtKmdError(errno.EPERM, f"fake {call}: window {window.id} is not this fd's")

    def driver_info(self) -> DriverInfo:
        self._open("GET_DRIVER_INFO")
        self.calls.append("driver_info")
        return DriverInfo(2, *self.driver_version)

    def allocate_tlb(self, size: int) -> TlbWindow:
        self._open("ALLOCATE_TLB")
        self.calls.append("allocate")
        try:
            wid = self.pool.claim(size, self)
        except TtKmdError as exc:
            raise allocate_tlb_error(exc.errno, size, self.path, self.arch) from exc
        return TlbWindow(id=wid, size=size, mmap_offset_uc=(6 << 36) + wid, mmap_offset_wc=(7 << 36) + wid)

    def configure_tlb(self, window: TlbWindow, endpoint: NocEndpoint, noc_address: int, ordering: int = 0) -> None:
        self.calls.append("configure")
        self._own(window, "CONFIGURE_TLB")
        if noc_address % window.size:
            raise TtKmdError(errno.EINVAL, "fake CONFIGURE_TLB: base not aligned to the window size")
        self.config[window.id] = (endpoint, noc_address)

    def map_window(self, window: TlbWindow, length: int, write_combined: bool = True, at: int | None = None) -> int:
        self.calls.append("map")
        self._own(window, "mmap")
        check_map_length(window, length, self.page_size)
        assert window.id in self.config, "mmap of a window never configured"
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED if at is not None else 0)
        va = _libc.mmap(at, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        assert va not in (None, _MAP_FAILED) and (at is None or va == at)
        self.mapped[va] = (window.id, length)
        return va

    def unmap_window(self, address: int, length: int) -> None:
        self.calls.append("unmap")
        assert self.mapped.pop(address)[1] == length, "munmap must cover a window's whole mapping"
        assert _libc.munmap(address, length) == 0

    def export_dmabuf(self, window: TlbWindow, offset: int, size: int) -> int:
        self.calls.append("export")
        self._open("EXPORT_TLB_DMABUF")
        if self.driver_version < sysfs.MIN_KMD_VERSION_FOR_DMABUF:
            raise TtKmdError(errno.ENOTTY, os.strerror(errno.ENOTTY))
        if self.fail_export_at is not None and len(self.exports) == self.fail_export_at:
            raise TtKmdError(errno.EINVAL, "fake: export refused")
        if self.pool.owner.get(window.id) is not self:
            raise export_eperm_error(window, self.path)
        if offset % self.page_size or size % self.page_size or offset >= window.size or offset + size > window.size:
            raise TtKmdError(errno.EINVAL, "fake EXPORT_TLB_DMABUF: range not page aligned inside the window")
        fd = os.memfd_create("fake-dmabuf")
        self.exports.append(fd)
        return fd

    def free_tlb(self, window: TlbWindow) -> None:
        self.calls.append("free")
        self._own(window, "FREE_TLB")
        if any(wid == window.id for wid, _ in self.mapped.values()):
            raise TtKmdError(errno.EBUSY, "fake: FREE_TLB while mapped")
        self.config.pop(window.id, None)
        del self.pool.owner[window.id]

    def close(self) -> None:
        """Closing the fd returns its windows to the pool (tt-kmd ``tt_cdev_release_tlbs``)."""
        self.calls.append("close")
        for wid in [w for w, fd in self.pool.owner.items() if fd is self]:
            del self.pool.owner[wid]
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.closed = True


class FakeTtKmd:
    """FAKE ``/dev/tenstorrent`` of a host: ``devices`` maps N of ``/dev/tenstorrent/N`` to
    its device; :meth:`open` stands in for ``TtKmdDevice.open(pci, dev_root)`` (an
    ``open_device`` for ``route.choose_route``): a new fd, holding ``dev_root``'s
    ``dev/tenstorrent/<pci>`` open when a test made that file (so ``device_holders`` finds
    this process). ``opened`` lists every fd handed out."""

    def __init__(self, devices: dict[int, FakeTlbPool] | None = None) -> None:
        self.devices = {0: FakeTlbPool()} if devices is None else devices
        self.opened: list[FakeTlbDevice] = []

    def open(self, pci: int, dev_root: str = "/") -> FakeTlbDevice:
        dev_dir = Path(dev_root) / sysfs.DEV_TENSTORRENT
        if not self.devices:
            raise TtDeviceNotFoundError(errno.ENOENT, no_device_message(dev_dir))
        if pci not in self.devices:
            raise TtDeviceNotFoundError(
                errno.ENOENT, f"no Tenstorrent device {pci}: {dev_dir} holds only {sorted(self.devices)}"
            )
        node = dev_dir / str(pci)
        fd = FakeTlbDevice(pool=self.devices[pci], path=node if node.is_file() else None)
        self.opened.append(fd)
        return fd


def hold_like_tt_metal(pool: FakeTlbPool, path: Path | None = None) -> FakeTlbDevice:
    """Another fd on the same device taking what tt-metal's configure_static_tlbs takes
    (``window_plan.tt_metal_held_windows``): on a p150 one 4 GiB window per DRAM channel and
    156 of 2 MiB (154 per-core ones and tt-umd's 2 cached); on a Wormhole 98 of 1 MiB."""
    from vllm_hawk.npu.tt_kmd.window_plan import tt_metal_held_windows

    tt_metal = FakeTlbDevice(pool=pool, path=path)
    banks = 12 if pool.arch is Arch.WORMHOLE else 8 if len(pool.kinds[4 * GiB]) == 8 else 7
    for size, count in tt_metal_held_windows(pool.arch.value, banks).items():
        for _ in range(min(count, pool.free(size))):
            tt_metal.allocate_tlb(size)
    return tt_metal


def make_buffer(
    buffer_id: int = 1, address: int = 0x10_0040, pages: int = 80, page: int = 1088, banks: int = 8
) -> DeviceBuffer:
    """An interleaved buffer of ``pages`` pages of ``page`` bytes over ``banks`` banks at ``address``."""
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


class FakeMooncakeEngine:
    """FAKE of mooncake.engine.TransferEngine's register_memory/unregister_memory: records
    the ranges registered; register_memory returns ``rc`` from its ``fail_at``-th call
    (0-based; None: every call) and 0 before."""

    def __init__(self, rc: int = 0, fail_at: int | None = None) -> None:
        self.rc, self.fail_at, self.calls = rc, fail_at, 0
        self.registered: list[tuple[int, int]] = []

    def register_memory(self, addr: int, length: int) -> int:
        self.calls += 1
        if self.rc and (self.fail_at is None or self.calls > self.fail_at):
            return self.rc
        self.registered.append((addr, length))
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.registered = [r for r in self.registered if r[0] != addr]
        return 0


class FakeTtPeermem:
    """FAKE of the tt_peermem char device (a kernel module, not loadable here): records the
    registrations and refuses one overlapping another with EEXIST
    (``kernel_driver/tt_peermem/peermem_core.c``)."""

    def __init__(self) -> None:
        self.ranges: dict[int, tuple[int, int, int, int]] = {}
        self._next = 1

    def register(self, va: int, length: int, dmabuf_fd: int, dmabuf_offset: int) -> int:
        if any(va < v + n and v < va + length for v, n, _, _ in self.ranges.values()):
            raise OSError(errno.EEXIST, os.strerror(errno.EEXIST))
        handle, self._next = self._next, self._next + 1
        self.ranges[handle] = (va, length, dmabuf_fd, dmabuf_offset)
        return handle

    def unregister(self, handle: int) -> None:
        del self.ranges[handle]
