"""The real Tenstorrent device over tt-kmd (Blackhole only for per-bank RDMA buffers).

NOT exercised in CI: no Tenstorrent device here. Importing this package touches no
hardware; ``TtKmdDevice.open()`` is the first call that does.

- ``ioctl``: ctypes mirror of ``kernel_driver/uapi/tenstorrent_ioctl.h``
- ``topology``: PCI ids, Blackhole DRAM bank -> NOC endpoint, TLB window arithmetic (pure)
- ``window_plan``: which window size and count a route needs next to tt-metal's (pure)
- ``sysfs``: device discovery from /dev, /sys, /proc (read-only), processes holding a device
- ``device``: ``TtKmdDevice`` (ioctls, mmap, dma-buf export)
- ``bank_windows``: a device's TLB windows aimed at banks, shared, mapped contiguously per region
- ``bank_buffers``: ``TtKmdBankBuffers``, the BankBufferAPI implementation
- ``registration``: Mooncake + tt_peermem, and pyverbs dma-buf MR registration
"""

from vllm_hawk.npu.tt_kmd.bank_buffers import BankMapping, TtKmdBankBuffers, WindowSegment
from vllm_hawk.npu.tt_kmd.device import TtDeviceNotFoundError, TtKmdDevice, TtKmdError, find_device
from vllm_hawk.npu.tt_kmd.topology import Arch, CoordSystem, UnsupportedArchError
from vllm_hawk.npu.tt_kmd.window_plan import RouteWindows, WindowsRefused, plan_route_windows

__all__ = [
    "Arch",
    "BankMapping",
    "CoordSystem",
    "RouteWindows",
    "TtDeviceNotFoundError",
    "TtKmdBankBuffers",
    "TtKmdDevice",
    "TtKmdError",
    "UnsupportedArchError",
    "WindowSegment",
    "WindowsRefused",
    "find_device",
    "plan_route_windows",
]
