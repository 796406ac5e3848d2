"""Pure Tenstorrent topology facts and TLB-window arithmetic (no I/O, no device).

Sources (read, not copied):

- tt-kmd ttkmd-2.10.0-6-g4af7192 (commit 4af71921ac02): PCI ids (``enumerate.h``), TLB
  window sizes per arch (``blackhole.c``: 2 MiB in BAR0 and 4 GiB in BAR4, at most 8 and
  only as many as BAR4 holds; ``wormhole.c``: 1/2/16 MiB), the size-aligned window base
  (``blackhole_configure_tlb_4G``), the mmap/export rules (``memory.c``), and the
  NIC -> Blackhole demo ``tools/rdma/nic_bh_p2p_dma.c`` that aims a 4 GiB window at the
  GDDR tile at translated NOC (17, 12) = DRAM channel 0, port 0.
- tt-umd v0.9.9-119-g3ed9cb6d0 (commit 3ed9cb6d0533): ``blackhole_implementation.hpp``
  (``DRAM_CORES_NOC0``: 8 channels x 3 NOC ports; translated DRAM origin x=17, y=12),
  ``blackhole_coordinate_manager.cpp`` (``fill_dram_noc0_translated_mapping``: the
  translated layout with and without one harvested channel), ``pcie_protocol.cpp``
  (``export_dmabuf`` aims windows with *translated* coordinates, static_vc off on
  Blackhole).
- tt-metal ``tt_metal/soc_descriptors/blackhole_140_arch.yaml`` (commit 049e2880a0c5):
  same DRAM NOC0 table, ``dram_bank_size`` 0xFF000000 usable bytes per bank,
  ``dram_address_offsets`` all 0 (bank b is channel b at NOC address 0),
  ``dram_preferred_worker_endpoint`` = port 2, ``translation_id_enabled: True``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

PCI_VENDOR_ID_TENSTORRENT = 0x1E52
PCI_DEVICE_ID_WORMHOLE = 0x401E
PCI_DEVICE_ID_BLACKHOLE = 0xB140

MiB = 1 << 20
GiB = 1 << 30

#: Blackhole BAR4 TLB window size in bytes and the most such windows a device has.
BLACKHOLE_TLB_4G_WINDOW_BYTES = 4 * GiB
BLACKHOLE_MAX_4G_WINDOWS = 8
#: TLB window sizes (bytes) tt-kmd's ALLOCATE_TLB accepts, per arch.
TLB_WINDOW_SIZES: dict[str, tuple[int, ...]] = {
    "blackhole": (2 * MiB, 4 * GiB),
    "wormhole": (1 * MiB, 2 * MiB, 16 * MiB),
}

#: Blackhole DRAM: 8 channels, one interleaving bank per channel; 3 NOC ports each.
BLACKHOLE_NUM_DRAM_CHANNELS = 8
BLACKHOLE_DRAM_PORTS_PER_CHANNEL = 3
#: Usable bytes per Blackhole DRAM bank for tt-metal buffers (the channel spans 4 GiB).
BLACKHOLE_DRAM_BANK_BYTES = 0xFF000000
#: NOC0 (x, y) of each Blackhole DRAM channel's three ports, [channel][port].
BLACKHOLE_DRAM_NOC0: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, 0), (0, 1), (0, 11)),
    ((0, 2), (0, 10), (0, 3)),
    ((0, 9), (0, 4), (0, 8)),
    ((0, 5), (0, 7), (0, 6)),
    ((9, 0), (9, 1), (9, 11)),
    ((9, 2), (9, 10), (9, 3)),
    ((9, 9), (9, 4), (9, 8)),
    ((9, 5), (9, 7), (9, 6)),
)
#: Translated-coordinate origin of Blackhole DRAM (west column x=17, east x=18).
BLACKHOLE_DRAM_TRANSLATED_X0 = 17
BLACKHOLE_DRAM_TRANSLATED_Y0 = 12
#: The DRAM port tt-metal prefers for worker traffic; the tt-kmd demo uses port 0.
#: All three ports reach the same memory, so the choice only affects NOC routing.
BLACKHOLE_DEFAULT_DRAM_PORT = 0


class Arch(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and format() of members
    """Tenstorrent chip architecture as identified by its PCI device id."""

    WORMHOLE = "wormhole"
    BLACKHOLE = "blackhole"


class UnsupportedArchError(RuntimeError):
    """The call needs a Blackhole (its DRAM bank endpoints or 4 GiB windows)."""


class CoordSystem(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and format() of members
    """Which NOC coordinates a TLB window is programmed with."""

    #: Firmware-enabled NOC translation (the Blackhole default; what tt-umd uses).
    TRANSLATED = "translated"
    #: Physical NOC0 coordinates (only when NOC translation is disabled).
    NOC0 = "noc0"


@dataclass(frozen=True)
class NocEndpoint:
    """A NOC endpoint (x, y) on NOC ``noc`` (0 or 1) in coordinate system ``coords``."""

    x: int
    y: int
    noc: int = 0
    coords: CoordSystem = CoordSystem.TRANSLATED


def arch_from_pci_device_id(device_id: int) -> Arch:
    """Map a PCI device id (0x401E, 0xB140) to its :class:`Arch`; ValueError otherwise."""
    if device_id == PCI_DEVICE_ID_BLACKHOLE:
        return Arch.BLACKHOLE
    if device_id == PCI_DEVICE_ID_WORMHOLE:
        return Arch.WORMHOLE
    raise ValueError(f"unknown Tenstorrent PCI device id {device_id:#06x}")


def require_blackhole(arch: Arch, what: str = "per-bank DMA windows") -> None:
    """Raise :class:`UnsupportedArchError` naming ``arch`` unless it is Blackhole."""
    if arch is not Arch.BLACKHOLE:
        name = arch.value.capitalize()
        sizes = ", ".join(f"{s // MiB} MiB" for s in TLB_WINDOW_SIZES[arch.value])
        raise UnsupportedArchError(
            f"{what} need Blackhole: this device is {name}. tt-kmd exports {name} TLB windows as "
            f"dma-bufs too, but its windows are {sizes} (BAR0) against DRAM banks of 1 GiB: no window "
            "reaches a whole bank, so direct mode cannot map a KV cache; staged receive buffers of at "
            "most 16 MiB per bank fit one window each (window_plan.plan_route_windows), and this "
            "backend maps Blackhole DRAM banks only. Use a Blackhole (p150/p100) for direct mode, "
            "or the host-staged transport."
        )


def _harvested_channels(harvest_mask: int) -> list[int]:
    if harvest_mask < 0 or harvest_mask >> BLACKHOLE_NUM_DRAM_CHANNELS:
        raise ValueError(f"DRAM harvesting mask {harvest_mask:#x} has bits beyond 8 channels")
    harvested = [c for c in range(BLACKHOLE_NUM_DRAM_CHANNELS) if harvest_mask >> c & 1]
    if len(harvested) > 1:
        raise ValueError(
            f"DRAM harvesting mask {harvest_mask:#x} harvests {len(harvested)} channels; Blackhole harvests at most one"
        )
    return harvested


def blackhole_bank_channels(harvest_mask: int = 0) -> list[int]:
    """Physical DRAM channel of each interleaving bank: bank i is the i-th unharvested channel."""
    harvested = set(_harvested_channels(harvest_mask))
    return [c for c in range(BLACKHOLE_NUM_DRAM_CHANNELS) if c not in harvested]


def blackhole_dram_translated(harvest_mask: int = 0) -> list[tuple[tuple[int, int], ...]]:
    """Translated (x, y) of each bank's 3 ports, [bank][port], for a DRAM harvesting mask.

    Follows tt-umd ``BlackholeCoordinateManager::fill_dram_noc0_translated_mapping``:
    banks are laid out in runs of 3 consecutive y (one per port) starting at y=12, in
    column x=17 or x=18. Without harvesting banks 0-3 are x=17 and 4-7 are x=18. With one
    harvested channel, 3 banks move to x=18 and 4 fill x=17 (the bank that mirrors the
    harvested one goes last), and the harvested channel keeps the x=18 slot y=21..23.
    """
    harvested = _harvested_channels(harvest_mask)
    n_banks = BLACKHOLE_NUM_DRAM_CHANNELS - len(harvested)
    ports = BLACKHOLE_DRAM_PORTS_PER_CHANNEL
    x0, y0 = BLACKHOLE_DRAM_TRANSLATED_X0, BLACKHOLE_DRAM_TRANSLATED_Y0
    half = BLACKHOLE_NUM_DRAM_CHANNELS // 2
    out: list[tuple[tuple[int, int], ...] | None] = [None] * n_banks

    def place(start: int, end: int, x: int, y: int = y0) -> None:
        for bank in range(start, end):
            out[bank] = tuple((x, y + port) for port in range(ports))
            y += ports

    if not harvested:
        place(0, half, x0)
        place(half, BLACKHOLE_NUM_DRAM_CHANNELS, x0 + 1)
    elif harvested[0] < half:
        mirror_east = harvested[0] + half - 1  # a logical bank index
        place(0, half - 1, x0 + 1)
        place(half - 1, mirror_east, x0)
        place(mirror_east + 1, n_banks, x0, y0 + (mirror_east - (half - 1)) * ports)
        place(mirror_east, mirror_east + 1, x0, y0 + (half - 1) * ports)
    else:
        mirror_west = harvested[0] - half
        place(0, mirror_west, x0)
        place(mirror_west + 1, half, x0, y0 + mirror_west * ports)
        place(mirror_west, mirror_west + 1, x0, y0 + (half - 1) * ports)
        place(half, n_banks, x0 + 1)
    assert all(entry is not None for entry in out)
    return out  # type: ignore[return-value]


def blackhole_bank_endpoint(
    bank: int,
    *,
    port: int = BLACKHOLE_DEFAULT_DRAM_PORT,
    coords: CoordSystem = CoordSystem.TRANSLATED,
    harvest_mask: int = 0,
    noc: int = 0,
) -> NocEndpoint:
    """The NOC endpoint a TLB window must target to reach interleaving bank ``bank``.

    ``port`` picks one of the channel's three NOC ports (all reach the same memory).
    NOC1 coordinates are not modelled: tt-kmd's CONFIGURE_TLB takes NOC0-frame or
    translated coordinates with ``noc`` only selecting the network, as tt-umd does.
    """
    channels = blackhole_bank_channels(harvest_mask)
    if not 0 <= bank < len(channels):
        raise ValueError(f"bank {bank} out of range: this Blackhole has {len(channels)} DRAM banks")
    if not 0 <= port < BLACKHOLE_DRAM_PORTS_PER_CHANNEL:
        raise ValueError(f"DRAM port {port} out of range 0..{BLACKHOLE_DRAM_PORTS_PER_CHANNEL - 1}")
    if noc not in (0, 1):
        raise ValueError(f"noc must be 0 or 1, got {noc}")
    if coords is CoordSystem.TRANSLATED:
        x, y = blackhole_dram_translated(harvest_mask)[bank][port]
    else:
        x, y = BLACKHOLE_DRAM_NOC0[channels[bank]][port]
    return NocEndpoint(x=x, y=y, noc=noc, coords=coords)


@dataclass(frozen=True)
class WindowPlan:
    """How one TLB window covers ``[noc_address, noc_address + nbytes)`` of one endpoint.

    All fields are bytes. ``window_base`` is the NOC address the window is aimed at
    (aligned to ``window_size``); ``offset`` is where the range starts inside the window
    (= its offset from the mmap'd host address); ``map_length`` is the page-rounded mmap
    length measured from the window start; ``export_offset``/``export_size`` are the
    page-aligned sub-range handed to EXPORT_TLB_DMABUF, and ``dmabuf_offset`` is where
    the range starts inside that dma-buf.
    """

    window_size: int
    window_base: int
    offset: int
    nbytes: int
    map_length: int
    export_offset: int
    export_size: int

    @property
    def dmabuf_offset(self) -> int:
        """Byte offset of the range's first byte inside the exported dma-buf."""
        return self.offset - self.export_offset


def _align_down(value: int, align: int) -> int:
    return value - value % align


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


def plan_tlb_window(noc_address: int, nbytes: int, window_size: int, page_size: int) -> WindowPlan:
    """Plan a ``window_size`` TLB window over ``nbytes`` at NOC byte address ``noc_address``.

    tt-kmd only accepts a window base aligned to the window size, so the window starts at
    ``noc_address`` rounded down; the range must end inside that one window. mmap starts
    at the window start (tt-kmd rejects other offsets) and dma-buf exports are
    page-aligned, so both round outward to ``page_size``.
    """
    if noc_address < 0 or nbytes <= 0:
        raise ValueError(f"need noc_address >= 0 and nbytes > 0, got {noc_address:#x}, {nbytes}")
    if window_size <= 0 or window_size & (window_size - 1):
        raise ValueError(f"window size {window_size} is not a power of two")
    if page_size <= 0 or page_size & (page_size - 1) or window_size % page_size:
        raise ValueError(f"page size {page_size} must be a power of two dividing the window")
    base = _align_down(noc_address, window_size)
    offset = noc_address - base
    end = offset + nbytes
    if end > window_size:
        raise ValueError(
            f"range [{noc_address:#x}, {noc_address + nbytes:#x}) crosses the {window_size:#x}-byte "
            f"TLB window at {base:#x}; one window must cover each bank's region"
        )
    export_offset = _align_down(offset, page_size)
    map_length = _align_up(end, page_size)
    return WindowPlan(
        window_size=window_size,
        window_base=base,
        offset=offset,
        nbytes=nbytes,
        map_length=map_length,
        export_offset=export_offset,
        export_size=map_length - export_offset,
    )


def plan_tlb_windows(noc_address: int, nbytes: int, window_size: int, page_size: int) -> tuple[WindowPlan, ...]:
    """Plan the consecutive ``window_size`` windows covering ``[noc_address, noc_address + nbytes)``.

    One :class:`WindowPlan` per window, in address order, each over the range's part inside
    that window (:func:`plan_tlb_window`): all but the first start at their window's byte 0,
    all but the last end at its last byte. Mapped at consecutive host addresses (each
    window mmap'd whole except the last), the range is contiguous in host memory."""
    if window_size <= 0 or window_size & (window_size - 1):
        raise ValueError(f"window size {window_size} is not a power of two")
    if noc_address < 0 or nbytes <= 0:
        raise ValueError(f"need noc_address >= 0 and nbytes > 0, got {noc_address:#x}, {nbytes}")
    plans = []
    start, end = noc_address, noc_address + nbytes
    while start < end:
        part = min(end, _align_down(start, window_size) + window_size) - start
        plans.append(plan_tlb_window(start, part, window_size, page_size))
        start += part
    return tuple(plans)


def bar4_window_count(bar4_bytes: int) -> int:
    """How many 4 GiB windows tt-kmd exposes for a BAR4 of ``bar4_bytes`` (partial ones: none)."""
    return min(bar4_bytes // BLACKHOLE_TLB_4G_WINDOW_BYTES, BLACKHOLE_MAX_4G_WINDOWS)
