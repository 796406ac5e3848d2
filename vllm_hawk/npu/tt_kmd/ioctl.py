"""ctypes mirror of ``kernel_driver/uapi/tenstorrent_ioctl.h`` (the tt-kmd ABI we use).

Read from tt-kmd ttkmd-2.10.0-6-g4af7192 (commit 4af71921ac02, module 2.10.1-pre).
Every struct here must stay byte-identical to the header; ``tests/test_tt_kmd_abi.py``
compiles the header with gcc and checks every size, field offset and request number.

All requests are ``_IO(0xFA, n)``: tt-kmd does not encode the argument size in the
request number, so the number alone never tells whether a struct grew.
"""

from __future__ import annotations

import ctypes

# Linux asm-generic/ioctl.h encoding (x86-64, arm64): nr bits 0-7, type bits 8-15,
# size bits 16-29, dir bits 30-31. _IO has dir = 0 and size = 0.
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = 8
_IOC_SIZESHIFT = 16
_IOC_DIRSHIFT = 30
_IOC_NONE = 0


def _IO(ioc_type: int, nr: int) -> int:  # noqa: N802 - mirrors the C macro name
    """The request number of a Linux ``_IO(type, nr)`` ioctl (no direction, no size)."""
    return (_IOC_NONE << _IOC_DIRSHIFT) | (ioc_type << _IOC_TYPESHIFT) | (nr << _IOC_NRSHIFT) | (0 << _IOC_SIZESHIFT)


TENSTORRENT_IOCTL_MAGIC = 0xFA

TENSTORRENT_IOCTL_GET_DEVICE_INFO = _IO(TENSTORRENT_IOCTL_MAGIC, 0)
TENSTORRENT_IOCTL_GET_DRIVER_INFO = _IO(TENSTORRENT_IOCTL_MAGIC, 5)
TENSTORRENT_IOCTL_ALLOCATE_TLB = _IO(TENSTORRENT_IOCTL_MAGIC, 11)
TENSTORRENT_IOCTL_FREE_TLB = _IO(TENSTORRENT_IOCTL_MAGIC, 12)
TENSTORRENT_IOCTL_CONFIGURE_TLB = _IO(TENSTORRENT_IOCTL_MAGIC, 13)
TENSTORRENT_IOCTL_SET_POWER_STATE = _IO(TENSTORRENT_IOCTL_MAGIC, 15)
TENSTORRENT_IOCTL_EXPORT_TLB_DMABUF = _IO(TENSTORRENT_IOCTL_MAGIC, 16)

#: Request numbers by their C macro name (the ABI test iterates over this).
IOCTL_NUMBERS: dict[str, int] = {
    "TENSTORRENT_IOCTL_GET_DEVICE_INFO": TENSTORRENT_IOCTL_GET_DEVICE_INFO,
    "TENSTORRENT_IOCTL_GET_DRIVER_INFO": TENSTORRENT_IOCTL_GET_DRIVER_INFO,
    "TENSTORRENT_IOCTL_ALLOCATE_TLB": TENSTORRENT_IOCTL_ALLOCATE_TLB,
    "TENSTORRENT_IOCTL_FREE_TLB": TENSTORRENT_IOCTL_FREE_TLB,
    "TENSTORRENT_IOCTL_CONFIGURE_TLB": TENSTORRENT_IOCTL_CONFIGURE_TLB,
    "TENSTORRENT_IOCTL_SET_POWER_STATE": TENSTORRENT_IOCTL_SET_POWER_STATE,
    "TENSTORRENT_IOCTL_EXPORT_TLB_DMABUF": TENSTORRENT_IOCTL_EXPORT_TLB_DMABUF,
}

TT_POWER_FLAG_MAX_AI_CLK = 1 << 0
TT_POWER_FLAG_MRISC_PHY_WAKEUP = 1 << 1
TT_POWER_FLAG_TENSIX_ENABLE = 1 << 2
TT_POWER_FLAG_L2CPU_ENABLE = 1 << 3


def tt_power_validity(flags_count: int, settings_count: int) -> int:
    """``TT_POWER_VALIDITY``: how many power flags (bits 0-3) and settings (bits 4-7) are valid."""
    return ((flags_count & 0xF) << 0) | ((settings_count & 0xF) << 4)


# Native alignment, no packing: the driver's structs are naturally aligned.
u8, u16, u32, u64, s32 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32


class GetDeviceInfoIn(ctypes.Structure):
    """struct tenstorrent_get_device_info_in"""

    _fields_ = [("output_size_bytes", u32)]


class GetDeviceInfoOut(ctypes.Structure):
    """struct tenstorrent_get_device_info_out"""

    _fields_ = [
        ("output_size_bytes", u32),
        ("vendor_id", u16),
        ("device_id", u16),
        ("subsystem_vendor_id", u16),
        ("subsystem_id", u16),
        ("bus_dev_fn", u16),
        ("max_dma_buf_size_log2", u16),
        ("pci_domain", u16),
        ("reserved", u16),
    ]


class GetDeviceInfo(ctypes.Structure):
    """struct tenstorrent_get_device_info"""

    _fields_ = [("in_", GetDeviceInfoIn), ("out", GetDeviceInfoOut)]


class GetDriverInfoIn(ctypes.Structure):
    """struct tenstorrent_get_driver_info_in"""

    _fields_ = [("output_size_bytes", u32)]


class GetDriverInfoOut(ctypes.Structure):
    """struct tenstorrent_get_driver_info_out"""

    _fields_ = [
        ("output_size_bytes", u32),
        ("driver_version", u32),
        ("driver_version_major", u8),
        ("driver_version_minor", u8),
        ("driver_version_patch", u8),
        ("reserved0", u8),
    ]


class GetDriverInfo(ctypes.Structure):
    """struct tenstorrent_get_driver_info"""

    _fields_ = [("in_", GetDriverInfoIn), ("out", GetDriverInfoOut)]


class AllocateTlbIn(ctypes.Structure):
    """struct tenstorrent_allocate_tlb_in (size: exact window size in bytes)"""

    _fields_ = [("size", u64), ("reserved", u64)]


class AllocateTlbOut(ctypes.Structure):
    """struct tenstorrent_allocate_tlb_out (mmap offsets select the window and cache mode)"""

    _fields_ = [
        ("id", u32),
        ("reserved0", u32),
        ("mmap_offset_uc", u64),
        ("mmap_offset_wc", u64),
        ("reserved1", u64),
    ]


class AllocateTlb(ctypes.Structure):
    """struct tenstorrent_allocate_tlb"""

    _fields_ = [("in_", AllocateTlbIn), ("out", AllocateTlbOut)]


class FreeTlbIn(ctypes.Structure):
    """struct tenstorrent_free_tlb_in"""

    _fields_ = [("id", u32)]


class FreeTlbOut(ctypes.Structure):
    """struct tenstorrent_free_tlb_out (empty: size 0, a GNU C extension)"""

    _fields_: list = []


class FreeTlb(ctypes.Structure):
    """struct tenstorrent_free_tlb"""

    _fields_ = [("in_", FreeTlbIn), ("out", FreeTlbOut)]


class NocTlbConfig(ctypes.Structure):
    """struct tenstorrent_noc_tlb_config: NOC endpoint (x_end, y_end) and window base ``addr``."""

    _fields_ = [
        ("addr", u64),
        ("x_end", u16),
        ("y_end", u16),
        ("x_start", u16),
        ("y_start", u16),
        ("noc", u8),
        ("mcast", u8),
        ("ordering", u8),
        ("linked", u8),
        ("static_vc", u8),
        ("reserved0", u8 * 3),
        ("reserved1", u32 * 2),
    ]


class ConfigureTlbIn(ctypes.Structure):
    """struct tenstorrent_configure_tlb_in"""

    _fields_ = [("id", u32), ("reserved", u32), ("config", NocTlbConfig)]


class ConfigureTlbOut(ctypes.Structure):
    """struct tenstorrent_configure_tlb_out"""

    _fields_ = [("reserved", u64)]


class ConfigureTlb(ctypes.Structure):
    """struct tenstorrent_configure_tlb"""

    _fields_ = [("in_", ConfigureTlbIn), ("out", ConfigureTlbOut)]


class PowerState(ctypes.Structure):
    """struct tenstorrent_power_state (argsz must be its size)"""

    _fields_ = [
        ("argsz", u32),
        ("flags", u32),
        ("reserved0", u8),
        ("validity", u8),
        ("power_flags", u16),
        ("power_settings", u16 * 14),
    ]


class ExportTlbDmabuf(ctypes.Structure):
    """struct tenstorrent_export_tlb_dmabuf (fd is written back by the driver)"""

    _fields_ = [
        ("argsz", u32),
        ("flags", u32),
        ("tlb_id", u32),
        ("fd", s32),
        ("offset", u64),
        ("size", u64),
    ]


#: ctypes mirror -> C struct name. ``in_`` in Python is ``in`` in C (a Python keyword).
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "tenstorrent_get_device_info_in": GetDeviceInfoIn,
    "tenstorrent_get_device_info_out": GetDeviceInfoOut,
    "tenstorrent_get_device_info": GetDeviceInfo,
    "tenstorrent_get_driver_info_in": GetDriverInfoIn,
    "tenstorrent_get_driver_info_out": GetDriverInfoOut,
    "tenstorrent_get_driver_info": GetDriverInfo,
    "tenstorrent_allocate_tlb_in": AllocateTlbIn,
    "tenstorrent_allocate_tlb_out": AllocateTlbOut,
    "tenstorrent_allocate_tlb": AllocateTlb,
    "tenstorrent_free_tlb_in": FreeTlbIn,
    "tenstorrent_free_tlb_out": FreeTlbOut,
    "tenstorrent_free_tlb": FreeTlb,
    "tenstorrent_noc_tlb_config": NocTlbConfig,
    "tenstorrent_configure_tlb_in": ConfigureTlbIn,
    "tenstorrent_configure_tlb_out": ConfigureTlbOut,
    "tenstorrent_configure_tlb": ConfigureTlb,
    "tenstorrent_power_state": PowerState,
    "tenstorrent_export_tlb_dmabuf": ExportTlbDmabuf,
}


def c_field_name(py_name: str) -> str:
    """The C spelling of a mirrored field name (``in_`` -> ``in``)."""
    return "in" if py_name == "in_" else py_name
