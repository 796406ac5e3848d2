"""How the NIC reaches a Tenstorrent decode's DRAM: the landing route the worker chooses.

Three paths, one per way bytes can get from the NIC into a chip's DRAM banks:

``nic-direct``  (mode ``direct``) the NIC writes the KV cache's own pages, through tt-kmd TLB
                windows aimed at each bank and exported as dma-bufs (a window per bank must
                cover the whole KV cache's span of it: 4 GiB windows on a Blackhole);
``nic-staged``  (mode ``staged``) the NIC writes per-bank receive buffers through such
                windows (small: 2 MiB windows on a Blackhole, 16 MiB on a Wormhole), then
                intra-bank copies move the bytes into the KV pages;
``host-staged`` (mode ``staged``) no NIC path into device memory: the NIC writes receive
                buffers' host stand-ins (a few MiB per bank, never the KV cache) and the host
                writes them to DRAM through tt-metal; what runs on Tenstorrent's simulator.

:func:`choose_route` takes the mode asked for and returns the path that runs, and when it
is not the one asked for, the reason (a window plan refused, no device node, a driver
without dma-buf export, tt-metal's simulator). Only the chip topology and tt-kmd are
consulted: stdlib and :mod:`vllm_hawk.npu.tt_kmd`. Chips without a PCIe BAR (a T3K's
remote chips, reached over Ethernet) cannot be NIC targets: direct mode is refused naming
them. The route on hardware is NOT exercised in CI (no device here); its branches are
tested with a fake tt-kmd below the ioctl boundary.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_hawk.npu.tt_kmd.device import TtDeviceNotFoundError, TtKmdDevice, TtKmdError
from vllm_hawk.npu.tt_kmd.sysfs import device_holders
from vllm_hawk.npu.tt_kmd.window_plan import RouteWindows, WindowsRefused, format_bytes, plan_route_windows

__all__ = ["PATHS", "ChipLink", "LandingRoute", "RouteRefused", "choose_route"]

#: path -> the sink mode it runs
PATHS = {"nic-direct": "direct", "nic-staged": "staged", "host-staged": "staged"}


class RouteRefused(ValueError):
    """No route can serve the mode asked for on this mesh; the message says what to change."""


@dataclass(frozen=True)
class ChipLink:
    """Mesh chip ``index`` and the tt-kmd device it is reached through: ``pci`` is N of
    ``/dev/tenstorrent/N`` (tt-umd's ``chips_with_mmio``), None for a chip without a PCIe
    BAR (remote: reached over Ethernet through another chip)."""

    index: int
    pci: int | None


@dataclass(frozen=True)
class LandingRoute:
    """The path that runs (:data:`PATHS`), the mode asked for, why it differs (``''``: it
    does not) and, on a NIC path, the windows planned per chip."""

    path: str
    requested_mode: str
    reason: str = ""
    windows: RouteWindows | None = None

    @property
    def mode(self) -> str:
        return PATHS[self.path]

    def describe(self) -> str:
        text = f"{self.path} (mode {self.mode}"
        text += f", {self.windows.describe()} per chip)" if self.windows else ")"
        if self.reason:
            text += f"; mode {self.requested_mode} was asked for: {self.reason}"
        return text


def _host(requested: str, reason: str) -> LandingRoute:
    return LandingRoute("host-staged", requested, reason)


def choose_route(
    requested_mode: str,
    arch: str,
    num_banks: int,
    chips: Sequence[ChipLink],
    *,
    kv_span_per_bank: int,
    recv_bytes_per_bank: int,
    kv_base_per_bank: int = 0,
    recv_base_per_bank: int = 0,
    simulator: str | None = None,
    dev_root: str = "/",
    open_device: Callable[[int, str], TtKmdDevice] | None = None,
) -> LandingRoute:
    """The landing route for a decode asking for ``requested_mode`` (``staged``/``direct``).

    ``arch``: ``blackhole``/``wormhole``; ``kv_span_per_bank``: bytes of each bank from the
    KV cache's first byte (at ``kv_base_per_bank``) to its last (what direct windows must
    cover); ``recv_bytes_per_bank``: the staged receive buffer per bank, from
    ``recv_base_per_bank`` (where it may start: windows are aligned to their size, so an
    unaligned start can take one window more); ``simulator``: tt-metal's
    ``TT_METAL_SIMULATOR`` (set: there is no device to map). ``open_device(pci, dev_root)``
    opens ``/dev/tenstorrent/<pci>`` (default :meth:`TtKmdDevice.open`)."""
    if requested_mode not in ("staged", "direct"):
        raise ValueError(f"mode {requested_mode!r}: choose 'staged' or 'direct'")
    remote = [c.index for c in chips if c.pci is None]
    if remote and requested_mode == "direct":
        raise RouteRefused(
            f"mode 'direct': mesh chip(s) {remote} have no PCIe BAR (reached over Ethernet through another "
            "chip), so no NIC can write their DRAM; use mode 'staged' (the host stages their bytes), or a "
            "mesh of PCIe-attached chips only (e.g. one n300 card's local chip, MESH_DEVICE=N150)"
        )
    if simulator:
        return _host(
            requested_mode,
            f"tt-metal runs on its simulator (TT_METAL_SIMULATOR={simulator}): no PCIe device to map, and "
            "tt-umd refuses dma-buf exports of simulation devices ('Exporting a dma-buf is not supported for "
            "simulation devices.')",
        )
    if remote:
        return _host(requested_mode, f"mesh chip(s) {remote} have no PCIe BAR: the NIC cannot reach their DRAM")
    opener = open_device or _open
    why = _driver_refusal(chips, dev_root, opener)
    if why:
        return _host(requested_mode, why)

    def fits(mode: str, span: int) -> RouteWindows:
        base = kv_base_per_bank if mode == "direct" else recv_base_per_bank
        windows = plan_route_windows(arch, mode, num_banks, span, base_per_bank=base)
        if arch != "blackhole":
            raise WindowsRefused(
                f"{windows.describe()} would fit, but HAWK's tt-kmd backend (TtKmdBankBuffers) maps "
                "Blackhole DRAM banks only"
            )
        _probe_windows(chips, windows, dev_root, opener)
        return windows

    return _plan(requested_mode, fits, kv_span_per_bank, recv_bytes_per_bank)


def _plan(requested: str, fits, kv_span: int, recv: int) -> LandingRoute:
    """Direct if asked for and its windows fit, else staged through windows, else the host
    (each refusal kept in the reason). ``fits(mode, span)``: the windows, or WindowsRefused."""
    reasons = []
    if requested == "direct":
        try:
            return LandingRoute("nic-direct", requested, windows=fits("direct", kv_span))
        except WindowsRefused as e:
            reasons.append(f"direct windows refused: {e}")
    try:
        return LandingRoute("nic-staged", requested, "; ".join(reasons), fits("staged", recv))
    except WindowsRefused as e:
        reasons.append(f"staged windows refused: {e}")
    return _host(requested, "; ".join(reasons))


def _open(pci: int, dev_root: str) -> TtKmdDevice:
    return TtKmdDevice.open(pci, dev_root)


def _driver_refusal(chips: Sequence[ChipLink], dev_root: str, open_device) -> str:
    """'' when every chip's tt-kmd device opens and can export TLB windows as dma-bufs,
    else what refused (the first chip that did)."""
    for c in chips:
        try:
            dev = open_device(c.pci, dev_root)
        except TtDeviceNotFoundError as e:
            return f"mesh chip {c.index}: {e.strerror or e}"
        except TtKmdError as e:
            return f"mesh chip {c.index}: /dev/tenstorrent/{c.pci}: {e.strerror or e}"
        try:
            info = dev.driver_info()
        except TtKmdError as e:
            return f"mesh chip {c.index}: GET_DRIVER_INFO failed ({e.strerror or e})"
        finally:
            dev.close()
        if not info.supports_dmabuf_export:
            v = ".".join(map(str, info.version))
            return (
                f"mesh chip {c.index}: tt-kmd {v} cannot export TLB windows as dma-bufs "
                "(EXPORT_TLB_DMABUF needs tt-kmd >= 2.10.0)"
            )
    return ""


def _probe_windows(chips: Sequence[ChipLink], windows: RouteWindows, dev_root: str, open_device) -> None:
    """Allocate (then free) the planned windows on every chip: tt-kmd answers ENOMEM when
    other processes (tt-metal's own static windows) hold them; raised as WindowsRefused
    with the driver's text (which names the holders)."""
    for c in chips:
        dev = open_device(c.pci, dev_root)
        got = []
        try:
            for _ in range(windows.total):
                got.append(dev.allocate_tlb(windows.window_bytes))
        except TtKmdError as e:
            if e.errno != errno.ENOMEM:
                raise
            path = getattr(dev, "path", None)
            names = ", ".join(f"{comm} (pid {pid})" for pid, comm in device_holders(path)) if path else ""
            raise WindowsRefused(
                f"mesh chip {c.index}: only {len(got)} of the {windows.total} windows of "
                f"{format_bytes(windows.window_bytes)} could be allocated on {path or 'the device'} (ENOMEM: "
                f"more are held than tt-metal's own); processes holding the device open: {names or 'none found'}"
            ) from None
        finally:
            for w in got:
                dev.free_tlb(w)
            dev.close()
