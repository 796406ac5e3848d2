"""Which TLB windows a NIC route needs per DRAM bank, next to the windows tt-metal holds (pure).

A NIC reaches a Tenstorrent chip's DRAM only through TLB windows of the chip's PCIe BARs.
tt-kmd hands each device's windows out from one pool per size, first come first served,
to every fd of every process; tt-metal running in the same process has already taken its
own at device open. All sizes and addresses below are bytes.

Sources (read, not copied; details and the full evidence in docs/tenstorrent-route-evidence.md):

- tt-kmd ttkmd-2.10.0-6-g4af7192 (commit 4af71921ac02): ``blackhole.c`` 202 windows of 2 MiB
  (``TLB_2M_WINDOW_COUNT``; ``blackhole_init`` claims the last for the kernel) and 8 of
  4 GiB (``TLB_4G_WINDOW_COUNT``, as many as BAR4 holds); ``wormhole.c`` 156 x 1 MiB,
  10 x 2 MiB, 20 x 16 MiB (the last, ``KERNEL_TLB_INDEX``, is the kernel's); ``tlb.c``
  ``tenstorrent_device_allocate_tlb`` answers ENOMEM when a size's pool is empty.
- tt-metal ``tt_metal/llrt/tlb_config.cpp`` (commit 040a27c12558) ``configure_static_tlbs``:
  one window of ``get_static_tlb_size()`` (Blackhole 2 MiB, Wormhole 1 MiB) per Tensix and
  per Ethernet core, and on a Blackhole with all 8 DRAM channels one 4 GiB window per
  channel (none when a channel is harvested, e.g. p100).
- tt-umd v0.9.9-119-g3ed9cb6d0 (commit 3ed9cb6d0533): ``PcieProtocol::get_cached_wc_tlb_window``
  / ``get_cached_uc_tlb_window`` take two more windows of ``get_cached_tlb_size()``
  (Blackhole 2 MiB, Wormhole 1 MiB); Blackhole grid 14 x 10 Tensix and 14 Ethernet cores,
  Wormhole 8 x 10 Tensix and 16 Ethernet (``*_implementation.hpp``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_hawk.layout.device_profiles import DeviceProfile
from vllm_hawk.npu.tt_kmd.topology import BLACKHOLE_MAX_4G_WINDOWS, BLACKHOLE_NUM_DRAM_CHANNELS, GiB, MiB

#: arch ("blackhole"/"wormhole") -> window bytes -> windows tt-kmd offers per device
#: (the kernel's own window left out; Blackhole's 4 GiB count assumes a BAR4 of >= 32 GiB).
DEVICE_WINDOWS: dict[str, dict[int, int]] = {
    "blackhole": {2 * MiB: 201, 4 * GiB: BLACKHOLE_MAX_4G_WINDOWS},
    "wormhole": {1 * MiB: 156, 2 * MiB: 10, 16 * MiB: 19},
}

#: Unharvested Tensix and Ethernet cores (tt-umd ``T6_X_LOCATIONS`` x ``T6_Y_LOCATIONS``,
#: ``ETH_LOCATIONS``): an upper bound of the per-core windows configure_static_tlbs maps.
_STATIC_CORES = {"blackhole": 14 * 10 + 14, "wormhole": 8 * 10 + 16}
_STATIC_WINDOW = {"blackhole": 2 * MiB, "wormhole": 1 * MiB}
_UMD_CACHED_WINDOWS = 2  # tt-umd's write-combined and uncached I/O windows per chip

MODES = ("staged", "direct")


def _arch(arch: str) -> str:
    """``blackhole`` / ``wormhole`` from an arch name (profiles spell Wormhole ``wormhole_b0``)."""
    name = str(getattr(arch, "value", arch)).lower()
    if name.startswith("wormhole"):
        return "wormhole"
    if name == "blackhole":
        return "blackhole"
    raise ValueError(f"arch {arch!r}: TLB windows are known for blackhole and wormhole only")


def tt_metal_held_windows(arch: str, num_dram_banks: int) -> dict[int, int]:
    """Window bytes -> windows tt-metal holds on one MMIO chip once a device is open.

    ``configure_static_tlbs`` (tt-metal ``tt_metal/llrt/tlb_config.cpp``) maps one window
    per Tensix and Ethernet core (counted unharvested, an upper bound) and, on a Blackhole
    with all 8 DRAM channels (``num_dram_banks == 8``), one 4 GiB window per channel;
    tt-umd adds its two cached I/O windows. Remote (Ethernet-reached) chips hold none.
    """
    name = _arch(arch)
    held = dict.fromkeys(DEVICE_WINDOWS[name], 0)
    held[_STATIC_WINDOW[name]] += _STATIC_CORES[name] + _UMD_CACHED_WINDOWS
    if name == "blackhole" and num_dram_banks == BLACKHOLE_NUM_DRAM_CHANNELS:
        held[4 * GiB] = BLACKHOLE_NUM_DRAM_CHANNELS
    return held


class WindowsRefused(Exception):
    """No window size covers the route with the windows left; ``str(e)`` says which limit
    (the arch's window sizes or windows tt-metal's ``configure_static_tlbs`` holds) and
    what to do."""


def format_bytes(nbytes: int) -> str:
    """``4 GiB``, ``16 MiB``, else bytes in hex."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB")):
        if nbytes % unit == 0:
            return f"{nbytes // unit} {name}"
    return f"{nbytes:#x} bytes"


@dataclass(frozen=True)
class RouteWindows:
    """The windows a route maps: ``windows_per_bank`` windows of ``window_bytes`` in each of
    ``num_banks`` banks, for ``mode`` (staged: the receive buffers; direct: the KV cache)."""

    arch: str
    mode: str
    window_bytes: int
    windows_per_bank: int
    num_banks: int

    @property
    def total(self) -> int:
        """Windows the route allocates on the device."""
        return self.windows_per_bank * self.num_banks

    def describe(self) -> str:
        """E.g. ``8 banks x 1 window of 4 GiB (direct)``."""
        plural = "" if self.windows_per_bank == 1 else "s"
        return (
            f"{self.num_banks} banks x {self.windows_per_bank} window{plural} of "
            f"{format_bytes(self.window_bytes)} ({self.mode})"
        )


def windows_covering(base: int, nbytes: int, window_bytes: int) -> int:
    """Windows of ``window_bytes`` (each aimed at a size-aligned base) covering ``[base, base + nbytes)``."""
    first = base // window_bytes
    last = (base + nbytes - 1) // window_bytes
    return last - first + 1


def plan_route_windows(
    arch: str,
    mode: str,
    num_banks: int,
    span_per_bank: int,
    held: Mapping[int, int] | None = None,
    base_per_bank: int = 0,
) -> RouteWindows:
    """The window size with the fewest windows (ties: the smaller size) that covers
    ``[base_per_bank, base_per_bank + span_per_bank)`` of every bank within the windows
    tt-kmd offers less ``held`` (default :func:`tt_metal_held_windows`).

    ``span_per_bank``: bytes of each bank the NIC must reach (direct: lowest to highest
    KV-cache byte in a bank; staged: the receive buffer's bytes per bank);
    ``base_per_bank``: the first of them (a NOC byte address inside the bank).
    Raises :class:`WindowsRefused` naming the limit, ValueError on bad arguments.
    """
    name = _arch(arch)
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} must be one of {MODES}")
    if num_banks <= 0 or span_per_bank <= 0 or base_per_bank < 0:
        raise ValueError(
            f"need num_banks > 0, span_per_bank > 0 and base_per_bank >= 0, got {num_banks}, "
            f"{span_per_bank}, {base_per_bank}"
        )
    offered = DEVICE_WINDOWS[name]
    taken = tt_metal_held_windows(name, num_banks) if held is None else held
    plans = sorted(
        (
            RouteWindows(name, mode, size, windows_covering(base_per_bank, span_per_bank, size), num_banks)
            for size in offered
        ),
        key=lambda p: (p.total, p.window_bytes),
    )
    free = {size: max(count - int(taken.get(size, 0)), 0) for size, count in offered.items()}
    for plan in plans:
        if plan.total <= free[plan.window_bytes]:
            return plan
    raise WindowsRefused(_refusal(plans, offered, free, span_per_bank))


def _refusal(plans: list[RouteWindows], offered: dict[int, int], free: dict[int, int], span: int) -> str:
    """Why no plan fits: windows held elsewhere, or the arch's window sizes."""
    best = plans[0]
    head = f"{best.mode} mode on {best.arch} ({format_bytes(span)} per bank, {best.num_banks} banks): "
    left = ", ".join(f"{free[s]} of {format_bytes(s)}" for s in sorted(offered))
    fits_device = [p for p in plans if p.total <= offered[p.window_bytes]]
    if fits_device:
        need = fits_device[0]
        size = format_bytes(need.window_bytes)
        held = offered[need.window_bytes] - free[need.window_bytes]
        holder = (
            "tt-metal (configure_static_tlbs maps one per DRAM channel)"
            if need.window_bytes == 4 * GiB
            else "tt-metal (configure_static_tlbs maps one per Tensix and Ethernet core) and tt-umd's I/O windows"
        )
        fix = (
            "tt-metal's own static DRAM windows would have to be exported as dma-bufs (a user-mode "
            "driver change), or use mode staged"
            if best.mode == "direct"
            else "use smaller receive buffers per bank (ring_nbytes)"
        )
        return (
            f"{head}needs {need.describe()}, but {held} of the {offered[need.window_bytes]} windows of "
            f"{size} are held by {holder}; free: {left}. {fix}"
        )
    largest = max(offered)
    if best.arch == "wormhole" and best.mode == "direct":
        return (
            f"{head}a Wormhole's largest window is 16 MiB, its banks hold 1 GiB: direct mode cannot map the "
            f"KV cache (it would take {best.describe()}, the device offers {offered[best.window_bytes]}); "
            "use mode staged"
        )
    return (
        f"{head}{best.arch}'s TLB windows cannot cover it: the fewest are {best.describe()}, the device offers "
        f"{offered[best.window_bytes]} of {format_bytes(best.window_bytes)} (largest window "
        f"{format_bytes(largest)}). Use smaller receive buffers per bank, or mode staged"
    )


#: The device profiles the route's window plan is tabulated for (vllm_hawk/layout/profiles/devices).
PLAN_PROFILES = ("p150a", "p100", "n150", "n300")


@dataclass(frozen=True)
class PlanRow:
    """One profile x mode of :func:`plan_table`: the windows planned, or why they are refused.

    ``span_per_bank``/``base_per_bank`` are the bytes planned for (direct: every allocatable
    byte of a bank; staged: ``staged_nbytes`` split over the banks from the first allocatable
    byte). ``chips_reached``: chips of the board with a PCIe BAR (n300: 1 of 2)."""

    profile: str
    mode: str
    span_per_bank: int
    base_per_bank: int
    plan: RouteWindows | None
    refusal: str | None
    chips: int
    chips_reached: int

    def cell(self) -> str:
        return self.plan.describe() if self.plan is not None else f"refused: {self.refusal}"


def plan_table(profiles: Sequence[DeviceProfile], staged_nbytes: int = 64 * MiB) -> list[PlanRow]:
    """Plan both modes for each profile (load them with ``load_profile(name)`` for ``PLAN_PROFILES``).

    ``staged_nbytes``: the receive buffers' bytes over all banks (``ring_nbytes``'s default).
    Each chip of a multi-chip board is planned alone; only its first chip has a PCIe BAR
    (an n300's second chip is reached over Ethernet), so ``chips_reached`` is 1.
    """
    rows: list[PlanRow] = []
    for prof in profiles:
        for mode in MODES:
            base = prof.dram_unreserved_base
            if mode == "direct":
                span = prof.bank_size_bytes - base
            else:
                per_bank = -(-staged_nbytes // prof.num_banks)
                span = -(-per_bank // prof.dram_alignment_bytes) * prof.dram_alignment_bytes
            try:
                plan, refusal = plan_route_windows(prof.arch, mode, prof.num_banks, span, base_per_bank=base), None
            except WindowsRefused as exc:
                plan, refusal = None, str(exc)
            rows.append(PlanRow(prof.name, mode, span, base, plan, refusal, prof.chips, 1))
    return rows
