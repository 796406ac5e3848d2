"""Making a mapped bank region reachable by a NIC: two registration paths.

NOT exercised in CI: no Tenstorrent device and no RDMA device here.

(a) **Mooncake + tt_peermem** (:func:`register_bank_with_mooncake`): the region's host VA
    range is a BAR mapping (VM_IO | VM_PFNMAP) that ``ibv_reg_mr`` cannot pin by itself.
    The tt_peermem peer-memory client (``kernel_driver/tt_peermem``, another module) claims
    such ranges once userspace has told it, through its character device, which dma-buf
    backs the range; then Mooncake's ``TransferEngine.register_memory(addr, len)`` works on
    the plain address. The char-device ABI below mirrors
    ``kernel_driver/tt_peermem/tt_peermem_uapi.h`` (tests/test_tt_kmd_abi.py compares);
    tt_peermem registers whole pages, so the page-rounded exported range is registered
    and Mooncake then registers the exact bank region inside it.
(b) **dma-buf MR** (:func:`register_bank_dmabuf_mrs`): register the dma-buf fd that
    EXPORT_TLB_DMABUF returned with pyverbs ``DmaBufMR`` (``ibv_reg_dmabuf_mr``; mainline
    Linux, mlx5/bnxt_re/irdma). pyverbs passes iova = dma-buf offset, so a peer addresses
    the region at remote address ``segment.dmabuf_offset`` with the MR's rkey.

A bank region over several TLB windows (2 MiB windows) has one dma-buf per window
(``BankMapping.segments``), and both paths register **one registration per window**:
``ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)`` takes one dma-buf fd per MR
(rdma-core ``libibverbs/verbs.c``), and a tt_peermem registration, like the MR the RDMA
core acquires through it, is backed by one dma-buf and must contain the MR's whole range
(``kernel_driver/tt_peermem`` ``tpm_registry_lookup``). So a NIC transfer into such a
region is split at window boundaries: each part goes to its own window's registration.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from typing import Any, Protocol

from vllm_hawk.npu.tt_kmd.bank_windows import BankMapping, WindowSegment

# ---------------------------------------------------------------------------------------
# (a) tt_peermem char device + Mooncake
# ---------------------------------------------------------------------------------------

#: Character device of the tt_peermem kernel client (``TT_PEERMEM_DEVICE_NAME``).
TT_PEERMEM_DEVICE_PATH = "/dev/tt_peermem"
#: The kernel module name as /proc/modules lists it.
TT_PEERMEM_MODULE_NAME = "tt_peermem"
#: Its uapi header, which the structs below mirror (tests/test_tt_kmd_abi.py checks).
TT_PEERMEM_UAPI_HEADER = "kernel_driver/tt_peermem/tt_peermem_uapi.h"
TT_PEERMEM_IOC_MAGIC = 0xF7
#: tt_peermem registers whole 4 KiB pages (va_start, nbytes, dmabuf_offset aligned).
TT_PEERMEM_ALIGN = 4096


class TtPeermemRegister(ctypes.Structure):
    """``struct tt_peermem_register``: VA range [va_start, va_start + nbytes) is backed by
    dma-buf ``dmabuf_fd`` from byte ``dmabuf_offset``; ``id`` is the OUT handle (never 0)."""

    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("dmabuf_fd", ctypes.c_int32),
        ("id", ctypes.c_uint32),
        ("va_start", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("dmabuf_offset", ctypes.c_uint64),
    ]


class TtPeermemUnregister(ctypes.Structure):
    """``struct tt_peermem_unregister``: drop registration ``id`` made through this fd."""

    _fields_ = [("argsz", ctypes.c_uint32), ("id", ctypes.c_uint32)]


def _ioc(direction: int, ioc_type: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ioc_type << 8) | nr


_IOC_WRITE, _IOC_READ = 1, 2
TT_PEERMEM_IOCTL_REGISTER = _ioc(_IOC_READ | _IOC_WRITE, TT_PEERMEM_IOC_MAGIC, 1, ctypes.sizeof(TtPeermemRegister))
TT_PEERMEM_IOCTL_UNREGISTER = _ioc(_IOC_WRITE, TT_PEERMEM_IOC_MAGIC, 2, ctypes.sizeof(TtPeermemUnregister))


class PeermemRegistrar(Protocol):
    """Tells a peer-memory client which dma-buf backs a VA range (and forgets it)."""

    def register(self, va: int, length: int, dmabuf_fd: int, dmabuf_offset: int) -> int: ...

    def unregister(self, handle: int) -> None: ...


def peermem_range(segment: WindowSegment) -> tuple[int, int, int]:
    """(va_start, nbytes, dmabuf_offset) to register with tt_peermem for one window's part
    of a bank region: the page-rounded range its dma-buf was exported over, which starts at
    dma-buf offset 0.

    Bank buffers whose page-rounded ranges share a page cannot both be registered
    (tt_peermem answers EEXIST): page-align bank buffers used on this path."""
    return segment.export_address, segment.plan.export_size, 0


class TtPeermemDevice:
    """The tt_peermem char device. NOT exercised in CI: the module is not loaded here.

    Registrations belong to this open file; :meth:`close` drops them all."""

    def __init__(self, path: str = TT_PEERMEM_DEVICE_PATH) -> None:
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                errno.ENOENT,
                f"{path} is missing: load the tt_peermem module (kernel_driver/tt_peermem, "
                "`insmod tt_peermem.ko`) or use the dma-buf MR path (pyverbs DmaBufMR)",
            ) from exc

    def register(self, va: int, length: int, dmabuf_fd: int, dmabuf_offset: int) -> int:
        """TT_PEERMEM_IOCTL_REGISTER; all three of va, length, dmabuf_offset 4 KiB aligned."""
        if (va | length | dmabuf_offset) % TT_PEERMEM_ALIGN:
            raise ValueError(
                f"tt_peermem needs 4 KiB alignment: va {va:#x}, length {length:#x}, dmabuf_offset {dmabuf_offset:#x}"
            )
        arg = TtPeermemRegister(
            argsz=ctypes.sizeof(TtPeermemRegister),
            flags=0,
            dmabuf_fd=dmabuf_fd,
            va_start=va,
            nbytes=length,
            dmabuf_offset=dmabuf_offset,
        )
        fcntl.ioctl(self._fd, TT_PEERMEM_IOCTL_REGISTER, arg, True)
        return int(arg.id)

    def unregister(self, handle: int) -> None:
        arg = TtPeermemUnregister(argsz=ctypes.sizeof(TtPeermemUnregister), id=handle)
        fcntl.ioctl(self._fd, TT_PEERMEM_IOCTL_UNREGISTER, arg, True)

    def close(self) -> None:
        os.close(self._fd)


class MooncakeEngine(Protocol):
    """The two calls we use of ``mooncake.engine.TransferEngine``."""

    def register_memory(self, buffer_addr: int, capacity: int) -> int: ...

    def unregister_memory(self, buffer_addr: int) -> int: ...


def register_bank_with_mooncake(
    engine: MooncakeEngine, mapping: BankMapping, peermem: PeermemRegistrar | None
) -> list[int | None]:
    """Path (a), per window of the region: announce its part to tt_peermem, then
    ``engine.register_memory`` over the part (one Mooncake buffer per window: see module doc).

    Returns the tt_peermem handles, one per window (None each if ``peermem`` is None, e.g.
    the TCP transport, which needs no peer memory). Raises RuntimeError if Mooncake refuses
    a part; the parts already registered are undone first."""
    handles: list[int | None] = []
    try:
        for seg in mapping.segments:
            handles.append(_register_segment(engine, mapping.bank, seg, peermem))
    except BaseException:
        unregister_bank_from_mooncake(engine, _first(mapping, len(handles)), peermem, handles)
        raise
    return handles


def _first(mapping: BankMapping, count: int) -> BankMapping:
    return BankMapping(mapping.bank, mapping.endpoint, mapping.window_va, mapping.segments[:count])


def _register_segment(
    engine: MooncakeEngine, bank: int, seg: WindowSegment, peermem: PeermemRegistrar | None
) -> int | None:
    handle = None
    if peermem is not None:
        if seg.dmabuf_fd is None:
            raise ValueError(f"bank {bank} was mapped without a dma-buf; tt_peermem needs one")
        va_start, nbytes, dmabuf_offset = peermem_range(seg)
        handle = peermem.register(va_start, nbytes, seg.dmabuf_fd, dmabuf_offset)
    rc = engine.register_memory(seg.host_address, seg.nbytes)
    if rc != 0:
        if peermem is not None and handle is not None:
            peermem.unregister(handle)
        raise RuntimeError(
            f"Mooncake register_memory({seg.host_address:#x}, {seg.nbytes}) for bank {bank} "
            f"returned {rc}: for RDMA the tt_peermem module must be loaded"
        )
    return handle


def unregister_bank_from_mooncake(
    engine: MooncakeEngine, mapping: BankMapping, peermem: PeermemRegistrar | None, handles: list[int | None]
) -> None:
    """Undo :func:`register_bank_with_mooncake` (per window: Mooncake first, then tt_peermem)."""
    for seg, handle in zip(mapping.segments, handles, strict=False):
        engine.unregister_memory(seg.host_address)
        if peermem is not None and handle is not None:
            peermem.unregister(handle)


# ---------------------------------------------------------------------------------------
# (b) pyverbs dma-buf MR
# ---------------------------------------------------------------------------------------

PYVERBS_INSTALL_HINT = (
    "pyverbs is not importable: on Debian/Ubuntu `apt-get install python3-pyverbs` and create "
    "the venv with --system-site-packages (the PyPI sdist builds all of rdma-core)"
)


def pyverbs_available() -> bool:
    """True if ``pyverbs.mr.DmaBufMR`` can be imported."""
    try:
        from pyverbs.mr import DmaBufMR  # noqa: F401
    except ImportError:
        return False
    return True


def default_access() -> int:
    """IBV_ACCESS_LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ from pyverbs' enums."""
    try:
        import pyverbs.enums as e
    except ImportError as exc:
        raise RuntimeError(PYVERBS_INSTALL_HINT) from exc
    return int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ)


class DmaBufMRUnsupported(OSError):
    """The RDMA device cannot register dma-buf MRs (``ibv_reg_dmabuf_mr`` -> EOPNOTSUPP).

    Mainline drivers that import dma-bufs: mlx5, bnxt_re, irdma (and efa, mana). Soft-RoCE
    (``rdma_rxe``) and soft-iWARP (``siw``) never do, up to at least Linux 6.12: measured in
    the QEMU guest stage (tests/guest), errno 95. On such a device use host staging, or a
    real NIC; ``hawk doctor`` says so."""


def soft_rdma_devices(root: str = "/") -> dict[str, str]:
    """Software RDMA devices under ``root``/sys/class/infiniband: {name: "soft-RoCE (rdma_rxe)
    on NETDEV" or "soft-iWARP (siw)"}. They have no bus device (/sys/devices/virtual/...);
    rxe also has a ``parent`` attribute naming its netdev."""
    base = os.path.join(root, "sys/class/infiniband")
    out = {}
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        dev = os.path.join(base, name)
        virtual = "/devices/virtual/" in os.path.realpath(dev)
        parent = os.path.join(dev, "parent")
        node_type = _read(os.path.join(dev, "node_type"))
        if os.path.isfile(parent) or (virtual and "iWARP" not in node_type):
            out[name] = f"soft-RoCE (rdma_rxe) on {_read(parent) or '?'}"
        elif virtual:
            out[name] = "soft-iWARP (siw)"
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def register_bank_dmabuf_mrs(
    pd: Any, mapping: BankMapping, access: int | None = None, device_name: str = ""
) -> list[Any]:
    """Path (b) for every window of a bank region: one MR per window's dma-buf (see module
    doc), in address order; each MR's iova is its ``segment.dmabuf_offset``. If one fails,
    the MRs already made are closed before the error propagates."""
    mrs: list[Any] = []
    try:
        for seg in mapping.segments:
            mrs.append(_dmabuf_mr(pd, mapping.bank, seg, access, device_name))
    except BaseException:
        for mr in mrs:
            mr.close()
        raise
    return mrs


def register_bank_dmabuf_mr(pd: Any, mapping: Any, access: int | None = None, device_name: str = "") -> Any:
    """Path (b) for a region inside one window: ``DmaBufMR(pd, nbytes, access,
    dmabuf=fd, offset=dmabuf_offset)``.

    ``pd`` is a ``pyverbs.pd.PD``; ``mapping`` a one-window :class:`BankMapping` (or anything
    with its ``bank``, ``dmabuf_fd``, ``nbytes`` and ``dmabuf_offset``; a region over several
    windows raises ValueError: use :func:`register_bank_dmabuf_mrs`). Returns the MR
    (``.rkey``, ``.lkey``); its iova is ``mapping.dmabuf_offset``. The MR must be closed
    before the buffer is unmapped. Raises :class:`DmaBufMRUnsupported` (errno EOPNOTSUPP)
    when the device cannot import dma-bufs, e.g. soft-RoCE."""
    windows = len(getattr(mapping, "segments", ()))
    if windows > 1:
        raise ValueError(
            f"bank {mapping.bank}'s region spans {windows} TLB windows, one dma-buf each, and an MR registers "
            "one dma-buf: use register_bank_dmabuf_mrs (one MR per window)"
        )
    return _dmabuf_mr(pd, mapping.bank, mapping, access, device_name)


def _dmabuf_mr(pd: Any, bank: int, part: Any, access: int | None, device_name: str) -> Any:
    """``DmaBufMR`` over ``part`` (``dmabuf_fd``, ``nbytes``, ``dmabuf_offset``) of ``bank``."""
    try:
        from pyverbs.mr import DmaBufMR
    except ImportError as exc:
        raise RuntimeError(PYVERBS_INSTALL_HINT) from exc
    if part.dmabuf_fd is None:
        raise ValueError(f"bank {bank} was mapped without a dma-buf (export_dmabuf=False)")
    if access is None:
        access = default_access()
    try:
        return DmaBufMR(pd, part.nbytes, access, dmabuf=part.dmabuf_fd, offset=part.dmabuf_offset)
    except Exception as exc:  # pyverbs.pyverbs_error.PyverbsRDMAError carries .error_code
        code = getattr(exc, "error_code", None)
        if code != errno.EOPNOTSUPP:
            raise
        soft = soft_rdma_devices()
        dev = device_name or (next(iter(soft)) if len(soft) == 1 else "?")
        raise DmaBufMRUnsupported(
            errno.EOPNOTSUPP,
            f"RDMA device {dev} cannot register dma-buf MRs (ibv_reg_dmabuf_mr: EOPNOTSUPP, errno 95)"
            + (f": it is {soft[dev]}, for testing only; soft-RoCE and siw never import dma-bufs" if dev in soft else "")
            + ". Use a NIC whose driver imports dma-bufs (mlx5, bnxt_re, irdma), or host staging",
        ) from exc
