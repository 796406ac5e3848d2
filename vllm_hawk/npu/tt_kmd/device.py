"""A Tenstorrent device opened through tt-kmd: device info, TLB windows, mmap, dma-buf.

NOT exercised in CI: no Tenstorrent device here. Only the pure parts (request numbers,
struct layouts, window arithmetic, error messages when /dev/tenstorrent is absent) are
tested on CPU machines; every call below that reaches the driver is unverified until run
on a Blackhole host with tt-kmd >= 2.10.0.

The flow for one DRAM bank (tt-kmd ``tools/rdma/nic_bh_p2p_dma.c`` does the same for one
GDDR tile): ALLOCATE_TLB(4 GiB) -> CONFIGURE_TLB(bank's NOC endpoint, window base) ->
mmap(window, write-combined) for host access -> EXPORT_TLB_DMABUF(page-aligned sub-range)
for a NIC. Teardown is the reverse: munmap, close the dma-buf, FREE_TLB (tt-kmd refuses
FREE_TLB with EBUSY while the window is mmap'd; a live dma-buf keeps the window pinned
after FREE_TLB until its last reference is dropped).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from vllm_hawk.npu.tt_kmd import ioctl as abi
from vllm_hawk.npu.tt_kmd import sysfs
from vllm_hawk.npu.tt_kmd.topology import (
    PCI_VENDOR_ID_TENSTORRENT,
    Arch,
    NocEndpoint,
    arch_from_pci_device_id,
    require_blackhole,
)

#: TLB ordering modes (tt-umd ``tlb_data``): relaxed is what tt-umd uses for exports.
ORDERING_RELAXED = 0
ORDERING_STRICT = 1
ORDERING_POSTED = 2


class TtKmdError(OSError):
    """A tt-kmd ioctl or mapping failed; the message names the call and the fix."""


class TtDeviceNotFoundError(FileNotFoundError):
    """No /dev/tenstorrent/N device (driver not loaded, no card, or not visible here)."""


def no_device_message(dev_dir: Path) -> str:
    """The error text used when ``dev_dir`` holds no Tenstorrent device node."""
    return (
        f"no Tenstorrent device: {dev_dir} does not exist or holds no device nodes. "
        "Install and load tt-kmd >= 2.10.0 (https://github.com/tenstorrent/tt-kmd; "
        "`modprobe tenstorrent`), check `lspci -d 1e52:` lists the card, and in a container "
        "pass the device through (--device /dev/tenstorrent)."
    )


def find_device(ordinal: int | None = None, root: str | os.PathLike[str] = "/") -> Path:
    """Path of /dev/tenstorrent/<ordinal> (the lowest one if ``ordinal`` is None).

    Raises :class:`TtDeviceNotFoundError` with what to fix if there is none."""
    ordinals = sysfs.device_ordinals(root)
    dev_dir = Path(root) / sysfs.DEV_TENSTORRENT
    if not ordinals:
        raise TtDeviceNotFoundError(errno.ENOENT, no_device_message(dev_dir))
    if ordinal is None:
        ordinal = ordinals[0]
    if ordinal not in ordinals:
        raise TtDeviceNotFoundError(
            errno.ENOENT,
            f"no Tenstorrent device {ordinal}: {dev_dir} holds only {ordinals}",
        )
    return sysfs.device_path(ordinal, root)


@dataclass(frozen=True)
class DeviceInfo:
    """GET_DEVICE_INFO: PCI identity of the opened device."""

    vendor_id: int
    device_id: int
    subsystem_vendor_id: int
    subsystem_id: int
    bus_dev_fn: int
    pci_domain: int
    max_dma_buf_size_log2: int

    @property
    def arch(self) -> Arch:
        """Blackhole or Wormhole, from the PCI device id."""
        return arch_from_pci_device_id(self.device_id)

    @property
    def pci_address(self) -> str:
        """``domain:bus:device.function`` as sysfs names it, e.g. ``0000:03:00.0``."""
        bus, dev, fn = self.bus_dev_fn >> 8, (self.bus_dev_fn >> 3) & 0x1F, self.bus_dev_fn & 0x7
        return f"{self.pci_domain:04x}:{bus:02x}:{dev:02x}.{fn}"


@dataclass(frozen=True)
class DriverInfo:
    """GET_DRIVER_INFO: ioctl API version and tt-kmd's semantic version."""

    api_version: int
    major: int
    minor: int
    patch: int

    @property
    def version(self) -> tuple[int, int, int]:
        return self.major, self.minor, self.patch

    @property
    def supports_dmabuf_export(self) -> bool:
        """True from tt-kmd 2.10.0 (EXPORT_TLB_DMABUF, ioctl 16)."""
        return self.version >= sysfs.MIN_KMD_VERSION_FOR_DMABUF


@dataclass(frozen=True)
class TlbWindow:
    """An allocated TLB window: driver id, size in bytes, mmap offsets (UC and WC)."""

    id: int
    size: int
    mmap_offset_uc: int
    mmap_offset_wc: int


@runtime_checkable
class TlbDevice(Protocol):
    """The hardware boundary the bank-buffer backend drives (tt-kmd, or a named fake)."""

    @property
    def arch(self) -> Arch: ...

    @property
    def page_size(self) -> int:
        """Host page size in bytes (mmap and dma-buf granularity)."""

    def allocate_tlb(self, size: int) -> TlbWindow: ...

    def configure_tlb(
        self, window: TlbWindow, endpoint: NocEndpoint, noc_address: int, ordering: int = ORDERING_RELAXED
    ) -> None: ...

    def map_window(self, window: TlbWindow, length: int, write_combined: bool = True, at: int | None = None) -> int:
        """mmap the first ``length`` bytes of ``window``; returns the host virtual address
        (``at``: exactly there, over a :func:`reserve_va` reservation)."""

    def unmap_window(self, address: int, length: int) -> None: ...

    def export_dmabuf(self, window: TlbWindow, offset: int, size: int) -> int:
        """dma-buf fd over ``[offset, offset + size)`` of ``window`` (page aligned)."""

    def free_tlb(self, window: TlbWindow) -> None: ...

    def driver_info(self) -> DriverInfo: ...

    def close(self) -> None: ...


class _Libc:
    """mmap/munmap through libc, so mappings are plain addresses a NIC stack can register."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        # off_t is 64-bit on the LP64 Linux targets tt-kmd supports (x86-64, arm64).
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.map_failed = ctypes.c_void_p(-1).value


_libc: _Libc | None = None


def _get_libc() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


#: mmap flags missing from Python's mmap module on some versions (Linux values).
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
PROT_NONE = 0x0


def reserve_va(length: int) -> int:
    """Reserve ``length`` bytes of host address space (anonymous, PROT_NONE, no memory
    committed) for windows to be mapped into with ``map_window(..., at=)``; returns its address."""
    libc = _get_libc()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    addr = libc.mmap(None, length, PROT_NONE, flags, -1, 0)
    if addr is None or addr == libc.map_failed:
        err = ctypes.get_errno()
        raise TtKmdError(err, f"reserving {length:#x} bytes of address space failed: {os.strerror(err)}")
    return int(addr)


def release_va(address: int, length: int) -> None:
    """munmap ``[address, address + length)`` (a :func:`reserve_va` range, its windows unmapped first)."""
    if _get_libc().munmap(address, length) != 0:
        err = ctypes.get_errno()
        raise TtKmdError(err, f"munmap({address:#x}, {length:#x}) failed: {os.strerror(err)}")


def check_map_length(window: TlbWindow, length: int, page_size: int) -> None:
    """ValueError unless ``length`` is a page multiple within ``window`` (what mmap of a window takes)."""
    if length <= 0 or length % page_size or length > window.size:
        raise ValueError(f"mmap length {length:#x} must be a page multiple within the {window.size:#x} window")


def allocate_tlb_error(err: int, size: int, path: object, arch: Arch) -> TtKmdError:
    """The error ALLOCATE_TLB's ENOMEM (pool of ``size`` empty) or EINVAL (no such size) is raised as."""
    if err == errno.ENOMEM:
        return TtKmdError(
            errno.ENOMEM,
            f"ALLOCATE_TLB({size:#x}) on {path}: every window of that size is taken "
            "(tt-kmd hands each size out from one pool shared by every fd of every process; "
            "tt-metal's configure_static_tlbs takes its windows when it opens the device)",
        )
    return TtKmdError(errno.EINVAL, f"ALLOCATE_TLB({size:#x}): {arch.value} has no TLB window of that size")


def export_eperm_error(window: TlbWindow, path: object) -> TtKmdError:
    """The error EXPORT_TLB_DMABUF's EPERM (the calling fd does not own the window) is raised as."""
    return TtKmdError(
        errno.EPERM,
        f"EXPORT_TLB_DMABUF of TLB window {window.id} on {path}: this fd does not own it "
        "(tt-kmd exports only windows the calling fd allocated; a window tt-metal holds can be "
        "exported only through tt-metal's own fd)",
    )


class TtKmdDevice:
    """One open /dev/tenstorrent/N. NOT exercised in CI: no Tenstorrent device here.

    Opened without O_APPEND so tt-kmd applies its legacy "high power" state at open (GDDR
    PHYs awake); :meth:`request_power` can ask for it explicitly on Blackhole.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise TtDeviceNotFoundError(errno.ENOENT, no_device_message(self.path.parent)) from exc
        except PermissionError as exc:
            raise TtKmdError(
                errno.EACCES,
                f"cannot open {self.path}: permission denied. Install tt-kmd's udev rule "
                "(udev-50-tenstorrent.rules) or run as a user allowed to access it.",
            ) from exc
        try:
            self.info = self._get_device_info()
        except BaseException:
            self.close()
            raise
        if self.info.vendor_id != PCI_VENDOR_ID_TENSTORRENT:
            vendor = self.info.vendor_id
            self.close()
            raise TtKmdError(errno.ENODEV, f"{path} is not a Tenstorrent device (vendor {vendor:#06x})")

    @classmethod
    def open(cls, ordinal: int | None = None, root: str | os.PathLike[str] = "/") -> TtKmdDevice:
        """Open /dev/tenstorrent/<ordinal> (lowest ordinal if None)."""
        return cls(find_device(ordinal, root))

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def fd(self) -> int:
        if self._fd is None:
            raise TtKmdError(errno.EBADF, f"{self.path} is closed")
        return self._fd

    def _ioctl(self, name: str, request: int, arg: ctypes.Structure) -> None:
        try:
            fcntl.ioctl(self.fd, request, arg, True)
        except OSError as exc:
            raise TtKmdError(exc.errno, f"{name} on {self.path} failed: {os.strerror(exc.errno or 0)}") from exc

    def close(self) -> None:
        """Close the device fd. Windows still mmap'd or exported stay alive until released."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TtKmdDevice:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- queries ----------------------------------------------------------------------------
    def _get_device_info(self) -> DeviceInfo:
        arg = abi.GetDeviceInfo()
        arg.in_.output_size_bytes = ctypes.sizeof(abi.GetDeviceInfoOut)
        self._ioctl("GET_DEVICE_INFO", abi.TENSTORRENT_IOCTL_GET_DEVICE_INFO, arg)
        out = arg.out
        return DeviceInfo(
            vendor_id=out.vendor_id,
            device_id=out.device_id,
            subsystem_vendor_id=out.subsystem_vendor_id,
            subsystem_id=out.subsystem_id,
            bus_dev_fn=out.bus_dev_fn,
            pci_domain=out.pci_domain,
            max_dma_buf_size_log2=out.max_dma_buf_size_log2,
        )

    def driver_info(self) -> DriverInfo:
        """GET_DRIVER_INFO: the loaded tt-kmd's API and semantic version."""
        arg = abi.GetDriverInfo()
        arg.in_.output_size_bytes = ctypes.sizeof(abi.GetDriverInfoOut)
        self._ioctl("GET_DRIVER_INFO", abi.TENSTORRENT_IOCTL_GET_DRIVER_INFO, arg)
        out = arg.out
        return DriverInfo(
            out.driver_version, out.driver_version_major, out.driver_version_minor, out.driver_version_patch
        )

    @property
    def arch(self) -> Arch:
        return self.info.arch

    @property
    def page_size(self) -> int:
        return mmap.PAGESIZE

    def bar4_bytes(self, sys_root: str | os.PathLike[str] = "/") -> int:
        """Size of the device's BAR4 in bytes from sysfs (0 if unknown)."""
        res = Path(sys_root) / sysfs.SYS_PCI_DEVICES / self.info.pci_address / "resource"
        try:
            sizes = sysfs.parse_resource_file(res.read_text())
        except OSError:
            return 0
        return sizes[4] if len(sizes) > 4 else 0

    # -- power ------------------------------------------------------------------------------
    def request_power(
        self,
        flags: int = abi.TT_POWER_FLAG_MAX_AI_CLK
        | abi.TT_POWER_FLAG_MRISC_PHY_WAKEUP
        | abi.TT_POWER_FLAG_TENSIX_ENABLE
        | abi.TT_POWER_FLAG_L2CPU_ENABLE,
    ) -> None:
        """SET_POWER_STATE (Blackhole): keep GDDR PHYs awake while this fd is open."""
        require_blackhole(self.arch, "SET_POWER_STATE")
        arg = abi.PowerState()
        arg.argsz = ctypes.sizeof(abi.PowerState)
        arg.validity = abi.tt_power_validity(4, 0)
        arg.power_flags = flags
        self._ioctl("SET_POWER_STATE", abi.TENSTORRENT_IOCTL_SET_POWER_STATE, arg)

    # -- TLB windows ------------------------------------------------------------------------
    def allocate_tlb(self, size: int) -> TlbWindow:
        """ALLOCATE_TLB of exactly ``size`` bytes (Blackhole: 2 MiB or 4 GiB; Wormhole: 1, 2 or 16 MiB)."""
        arg = abi.AllocateTlb()
        arg.in_.size = size
        try:
            self._ioctl("ALLOCATE_TLB", abi.TENSTORRENT_IOCTL_ALLOCATE_TLB, arg)
        except TtKmdError as exc:
            if exc.errno in (errno.ENOMEM, errno.EINVAL):
                raise allocate_tlb_error(exc.errno, size, self.path, self.arch) from exc
            raise
        out = arg.out
        return TlbWindow(id=out.id, size=size, mmap_offset_uc=out.mmap_offset_uc, mmap_offset_wc=out.mmap_offset_wc)

    def configure_tlb(
        self, window: TlbWindow, endpoint: NocEndpoint, noc_address: int, ordering: int = ORDERING_RELAXED
    ) -> None:
        """CONFIGURE_TLB: aim ``window`` at ``noc_address`` (window-size aligned) on ``endpoint``."""
        if noc_address % window.size:
            raise ValueError(f"window base {noc_address:#x} is not aligned to the window size {window.size:#x}")
        arg = abi.ConfigureTlb()
        arg.in_.id = window.id
        cfg = arg.in_.config
        cfg.addr = noc_address
        cfg.x_end, cfg.y_end = endpoint.x, endpoint.y
        cfg.noc = endpoint.noc
        cfg.ordering = ordering
        cfg.static_vc = 0  # tt-umd: off on Blackhole (a known hardware issue)
        self._ioctl("CONFIGURE_TLB", abi.TENSTORRENT_IOCTL_CONFIGURE_TLB, arg)

    def free_tlb(self, window: TlbWindow) -> None:
        """FREE_TLB (munmap first: tt-kmd answers EBUSY while the window is mapped)."""
        arg = abi.FreeTlb()
        arg.in_.id = window.id
        self._ioctl("FREE_TLB", abi.TENSTORRENT_IOCTL_FREE_TLB, arg)

    def map_window(self, window: TlbWindow, length: int, write_combined: bool = True, at: int | None = None) -> int:
        """mmap the first ``length`` bytes (page multiple) of ``window``; returns the host VA.

        ``at``: map exactly there (MAP_FIXED, replacing what :func:`reserve_va` reserved),
        so consecutive windows land at consecutive addresses. tt-kmd maps a window only
        from its first byte, at most its size, and never splits the mapping afterwards
        (``memory.c`` ``map_tlb_window``, ``tlb_vma_may_split``); one window may be mapped
        several times (each mapping counts in ``tlb_refs``)."""
        check_map_length(window, length, self.page_size)
        libc = _get_libc()
        offset = window.mmap_offset_wc if write_combined else window.mmap_offset_uc
        flags = mmap.MAP_SHARED | (MAP_FIXED if at is not None else 0)
        addr = libc.mmap(at, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, self.fd, offset)
        if addr is None or addr == libc.map_failed or (at is not None and addr != at):
            err = ctypes.get_errno()
            raise TtKmdError(
                err,
                f"mmap of TLB window {window.id} ({length:#x} bytes at offset {offset:#x}) "
                f"on {self.path} failed: {os.strerror(err)}",
            )
        return int(addr)

    def unmap_window(self, address: int, length: int) -> None:
        """munmap a range returned by :meth:`map_window`."""
        if _get_libc().munmap(address, length) != 0:
            err = ctypes.get_errno()
            raise TtKmdError(err, f"munmap({address:#x}, {length:#x}) failed: {os.strerror(err)}")

    def export_dmabuf(self, window: TlbWindow, offset: int, size: int) -> int:
        """EXPORT_TLB_DMABUF (tt-kmd >= 2.10.0, any arch): dma-buf fd over part of ``window``.

        ``offset`` and ``size`` are bytes, page aligned (``size`` 0: to the window's end). Only
        the fd that allocated the window may export it (tt-kmd ``ioctl_export_tlb_dmabuf``:
        EPERM otherwise). The caller owns the fd (close it).
        """
        if offset % self.page_size or size % self.page_size:
            raise ValueError(f"dma-buf export offset {offset:#x} and size {size:#x} must be page aligned")
        arg = abi.ExportTlbDmabuf()
        arg.argsz = ctypes.sizeof(abi.ExportTlbDmabuf)
        arg.tlb_id = window.id
        arg.fd = -1
        arg.offset = offset
        arg.size = size
        try:
            self._ioctl("EXPORT_TLB_DMABUF", abi.TENSTORRENT_IOCTL_EXPORT_TLB_DMABUF, arg)
        except TtKmdError as exc:
            if exc.errno == errno.EPERM:
                raise export_eperm_error(window, self.path) from exc
            if exc.errno in (errno.EINVAL, errno.ENOTTY, errno.EOPNOTSUPP):
                raise TtKmdError(
                    exc.errno,
                    f"{exc.strerror}. EXPORT_TLB_DMABUF needs tt-kmd >= 2.10.0 on "
                    "Linux >= 5.8 (see /sys/module/tenstorrent/version)",
                ) from exc
            raise
        return int(arg.fd)
