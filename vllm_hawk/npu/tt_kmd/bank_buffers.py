"""BankBufferAPI on a real Blackhole through tt-kmd: TLB windows of one size aimed at DRAM banks.

NOT exercised in CI: no Tenstorrent device here. The bookkeeping (window plans, rollback,
double-map / unknown-bank errors) is tested against a fake at the hardware boundary
(``tests/test_tt_kmd_bank_buffers.py``, ``FakeTlbDevice``); the tt-kmd calls themselves
run only on a Blackhole host.

Windows are ``window_bytes`` (4 GiB or 2 MiB; ``window_plan.plan_route_windows`` picks the
size next to the windows tt-metal holds). A buffer's region of bank b is covered by the
consecutive windows aimed at (bank b's NOC endpoint, the region's ``window_bytes``-aligned
bases): one 4 GiB window (a bank is smaller), or as many 2 MiB windows as the region
crosses. :class:`~vllm_hawk.npu.tt_kmd.bank_windows.BankWindows` allocates, configures and
maps them (write-combined; several windows at consecutive host addresses, so each bank's
region is one contiguous host range) and shares windows between buffers (reference
counted), because windows are few (8 of 4 GiB, as many as BAR4 holds; 201 of 2 MiB). Each
buffer additionally gets its own EXPORT_TLB_DMABUF per window over its page-rounded part
(optional). ``unmap_buffer_dma`` closes the buffer's dma-bufs; the last buffer out of a
window munmaps it and frees it.

Buffers come from one allocator per object, never two: tt-metal's (the decode allocates
with ttnn in the same process and hands each buffer to :meth:`TtKmdBankBuffers.adopt`,
which only maps it) or this object's own (:meth:`TtKmdBankBuffers.allocate_bank_buffers`,
for a device no tt-metal process uses).

What the sinks need beyond Table 6, through the same windows: ``allocate_bank_buffers``
takes receive buffers from a lockstep allocator of its own over ``[dram_unreserved_base,
min(bank_size, window_map_bytes))`` with 4 GiB windows, or whole window-aligned windows per
buffer and bank with smaller ones (tt-kmd allocates no DRAM, so no tt-metal process may
use that range on this device meanwhile); ``copy_in_banks`` copies inside a bank by host
``memmove`` between two addresses of that bank's mapped windows; ``dma_written`` has nothing
to move (the NIC wrote DRAM through the windows); ``dram_write_barrier`` reads back through
every window before a receive is reported finished.
"""

from __future__ import annotations

import ctypes
import itertools

from vllm_hawk.layout.device_profiles import DeviceProfile, load_profile
from vllm_hawk.layout.interleave import LockstepAllocator
from vllm_hawk.npu.bank_buffer import BankBufferError, DeviceBuffer, check_bank, known_buffer
from vllm_hawk.npu.tt_kmd.bank_windows import BankMapping, BankWindows, WindowSegment
from vllm_hawk.npu.tt_kmd.device import ORDERING_RELAXED, TlbDevice
from vllm_hawk.npu.tt_kmd.sysfs import device_holders
from vllm_hawk.npu.tt_kmd.topology import (
    BLACKHOLE_DEFAULT_DRAM_PORT,
    BLACKHOLE_DRAM_BANK_BYTES,
    BLACKHOLE_TLB_4G_WINDOW_BYTES,
    TLB_WINDOW_SIZES,
    CoordSystem,
    blackhole_bank_channels,
    blackhole_bank_endpoint,
    plan_tlb_windows,
    require_blackhole,
)
from vllm_hawk.npu.tt_kmd.window_plan import DEVICE_WINDOWS, format_bytes, tt_metal_held_windows

__all__ = ["BankMapping", "TtKmdBankBuffers", "WindowSegment"]


class TtKmdBankBuffers:
    """:class:`~vllm_hawk.npu.bank_buffer.BankBufferAPI` over a Blackhole opened with tt-kmd.

    NOT exercised in CI: no Tenstorrent device here.

    device: the hardware boundary (:class:`~vllm_hawk.npu.tt_kmd.device.TtKmdDevice`).
    harvest_mask: DRAM harvesting mask (bit c = channel c absent; p100 has one bit set).
    port: which of a channel's 3 NOC ports the windows target. coords: translated (NOC
    translation on, the Blackhole default) or noc0. export_dmabuf: also export each
    buffer's per-bank range as a dma-buf (the pyverbs path and tt_peermem need it).
    window_bytes: the TLB window size, 4 GiB or 2 MiB (``window_plan.plan_route_windows``);
    a region crossing window boundaries takes consecutive windows, mapped contiguously.
    window_map_bytes: how much of each window to mmap (bytes, from its start; default the
    whole window, at most a bank's 0xFF000000 bytes).
    profile: the device profile (name or loaded; default ``p150a``, ``p100`` when harvested
    to 7 banks); its bank count must be this device's.
    """

    def __init__(
        self,
        device: TlbDevice,
        *,
        harvest_mask: int = 0,
        port: int = BLACKHOLE_DEFAULT_DRAM_PORT,
        coords: CoordSystem = CoordSystem.TRANSLATED,
        noc: int = 0,
        export_dmabuf: bool = True,
        write_combined: bool = True,
        ordering: int = ORDERING_RELAXED,
        window_bytes: int = BLACKHOLE_TLB_4G_WINDOW_BYTES,
        window_map_bytes: int | None = None,
        profile: DeviceProfile | str | None = None,
    ) -> None:
        require_blackhole(device.arch, "RDMA bank buffers (map_buffer_dma)")
        if window_bytes not in TLB_WINDOW_SIZES["blackhole"]:
            sizes = " or ".join(format_bytes(s) for s in TLB_WINDOW_SIZES["blackhole"])
            raise ValueError(f"window_bytes {window_bytes:#x}: a Blackhole's TLB windows are {sizes}")
        if window_map_bytes is None:
            window_map_bytes = min(window_bytes, BLACKHOLE_DRAM_BANK_BYTES)
        if window_map_bytes <= 0 or window_map_bytes % device.page_size or window_map_bytes > window_bytes:
            window = format_bytes(window_bytes)
            raise ValueError(f"window_map_bytes {window_map_bytes:#x} must be a page multiple <= the {window} window")
        self._device = device
        self._window_bytes = window_bytes
        self._num_banks = len(blackhole_bank_channels(harvest_mask))
        endpoints = [
            blackhole_bank_endpoint(b, port=port, coords=coords, harvest_mask=harvest_mask, noc=noc)
            for b in range(self._num_banks)
        ]
        self._export = export_dmabuf
        self._map_bytes = window_map_bytes
        self._windows = BankWindows(
            device,
            endpoints,
            window_bytes,
            window_map_bytes,
            ordering=ordering,
            write_combined=write_combined,
            enomem_text=self._windows_taken,
        )
        self._mapped: dict[int, tuple[DeviceBuffer, list[BankMapping]]] = {}
        self.profile = _profile_for(profile, self._num_banks)
        self._alloc = _receive_allocator(self.profile, window_bytes, window_map_bytes)
        self._allocated: dict[int, DeviceBuffer] = {}
        self._adopted: dict[int, DeviceBuffer] = {}
        self._ids = itertools.count(1 << 32)  # apart from ids of buffers other allocators made

    # -- BankBufferAPI --------------------------------------------------------------------
    def get_device_num_bank(self) -> int:
        """DRAM banks interleaved buffers span: 8 on p150, 7 on a harvested p100."""
        return self._num_banks

    def map_buffer_dma(self, buffer: DeviceBuffer) -> None:
        """Make every bank's region of ``buffer`` host-addressable (and dma-buf exported).

        Raises BankBufferError if the buffer is already mapped, spans a different number
        of banks, or does not fit a bank; on a driver error every bank already mapped for
        this buffer is undone before the error propagates."""
        if buffer.buffer_id in self._mapped:
            raise BankBufferError(f"buffer {buffer.buffer_id} is already mapped")
        if buffer.num_banks != self._num_banks:
            raise BankBufferError(
                f"buffer {buffer.buffer_id} spans {buffer.num_banks} banks; this device has {self._num_banks}"
            )
        if buffer.size_per_bank <= 0:
            raise BankBufferError(f"buffer {buffer.buffer_id} has no bytes per bank")
        end = buffer.address + buffer.size_per_bank
        if buffer.address < 0 or end > BLACKHOLE_DRAM_BANK_BYTES:
            raise BankBufferError(
                f"buffer {buffer.buffer_id} [{buffer.address:#x}, {end:#x}) exceeds a Blackhole DRAM bank "
                f"({BLACKHOLE_DRAM_BANK_BYTES:#x} bytes)"
            )
        try:
            plans = plan_tlb_windows(buffer.address, buffer.size_per_bank, self._window_bytes, self._device.page_size)
        except ValueError as exc:
            raise BankBufferError(f"buffer {buffer.buffer_id}: {exc}") from exc
        if len(plans) > 1 and self._map_bytes != self._window_bytes:
            raise BankBufferError(
                f"buffer {buffer.buffer_id} spans {len(plans)} TLB windows of {format_bytes(self._window_bytes)} per "
                f"bank: consecutive windows are mapped whole, so window_map_bytes ({self._map_bytes:#x}) must be "
                "the window size"
            )
        if plans[-1].map_length > self._map_bytes:
            raise BankBufferError(
                f"buffer {buffer.buffer_id} ends {plans[-1].map_length:#x} bytes into its window, past the "
                f"{self._map_bytes:#x} bytes mapped (window_map_bytes)"
            )
        done: list[BankMapping] = []
        try:
            for bank in range(self._num_banks):
                done.append(self._windows.map(bank, plans, self._export))
        except BaseException:
            for mapping in reversed(done):
                self._windows.release(mapping)
            raise
        self._mapped[buffer.buffer_id] = (buffer, done)

    def get_buffer_address_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        """Host virtual address (bytes) of ``buffer``'s region in ``bank``."""
        return self.bank_mapping(buffer, bank).host_address

    def get_buffer_size_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        """Bytes of ``buffer`` in ``bank`` (== buffer.size_per_bank)."""
        self._check_bank(bank)
        return buffer.size_per_bank

    def unmap_buffer_dma(self, buffer: DeviceBuffer) -> None:
        """Close the buffer's dma-bufs; release windows no other mapped buffer uses."""
        entry = self._mapped.pop(buffer.buffer_id, None)
        if entry is None:
            raise BankBufferError(f"buffer {buffer.buffer_id} is not mapped")
        errors: list[BaseException] = []
        for mapping in entry[1]:
            try:
                self._windows.release(mapping)
            except Exception as exc:  # keep releasing the other banks
                errors.append(exc)
        if errors:
            raise BankBufferError(f"unmapping buffer {buffer.buffer_id}: {errors[0]}") from errors[0]

    # -- receive buffers and data movement (what the sinks call) -----------------------------
    @property
    def num_banks(self) -> int:
        return self._num_banks

    def allocate_bank_buffers(self, size_per_bank: int) -> DeviceBuffer:
        """One ``size_per_bank``-byte region per bank at one address (see module doc); with
        windows smaller than a bank each buffer takes whole window-aligned windows per bank."""
        if self._adopted:
            raise BankBufferError(
                "allocate_bank_buffers: this device's DRAM is tt-metal's (buffers were adopted); "
                "allocate receive buffers through ttnn and adopt() them"
            )
        nbytes = size_per_bank
        if self._window_bytes < BLACKHOLE_DRAM_BANK_BYTES:
            nbytes = -(-size_per_bank // self._window_bytes) * self._window_bytes
        alloc = self._alloc.allocate(self._num_banks, nbytes)
        buf = DeviceBuffer(
            next(self._ids),
            alloc.address,
            alloc.size_per_bank,
            size_per_bank,
            self._num_banks,
            self.profile.aligned_page(size_per_bank),
            self._num_banks,
        )
        self._allocated[buf.buffer_id] = buf
        return buf

    def free_buffer(self, buffer: DeviceBuffer) -> None:
        """Release a buffer :meth:`allocate_bank_buffers` made (unmapping it first if mapped)."""
        if buffer.buffer_id in self._adopted:
            raise BankBufferError(
                f"buffer {buffer.buffer_id} is tt-metal's (adopted): release() it here, deallocate it through ttnn"
            )
        known_buffer(self._allocated, buffer)
        if buffer.buffer_id in self._mapped:
            self.unmap_buffer_dma(buffer)
        del self._allocated[buffer.buffer_id]
        self._alloc.free(buffer.address)

    def adopt(self, buffer: DeviceBuffer) -> DeviceBuffer:
        """Map a buffer another allocator made (tt-metal's, through ttnn) without owning its DRAM.

        The buffer must lie in ``[profile.dram_unreserved_base, bank_size)`` of every bank;
        :meth:`release` unmaps it (ttnn deallocates it). Raises BankBufferError if this object
        allocates receive buffers itself (one allocator per device) or the id is taken."""
        if self._allocated:
            raise BankBufferError(
                f"adopt(buffer {buffer.buffer_id}): this object allocates receive buffers itself "
                "(allocate_bank_buffers); two allocators would hand out the same DRAM"
            )
        if buffer.buffer_id in self._adopted:
            raise BankBufferError(f"buffer {buffer.buffer_id} is already adopted")
        low, high = self.profile.dram_unreserved_base, self.profile.bank_size_bytes
        if buffer.address < low or buffer.address + buffer.size_per_bank > high:
            raise BankBufferError(
                f"adopt(buffer {buffer.buffer_id}): [{buffer.address:#x}, "
                f"{buffer.address + buffer.size_per_bank:#x}) is outside the [{low:#x}, {high:#x}) "
                f"tt-metal's allocator hands out ({self.profile.name})"
            )
        self.map_buffer_dma(buffer)
        self._adopted[buffer.buffer_id] = buffer
        return buffer

    def release(self, buffer: DeviceBuffer) -> None:
        """Unmap an adopted buffer and forget it (its DRAM stays tt-metal's)."""
        known_buffer(self._adopted, buffer)
        del self._adopted[buffer.buffer_id]
        self.unmap_buffer_dma(buffer)

    def adopted_buffers(self) -> list[DeviceBuffer]:
        return list(self._adopted.values())

    def live_buffers(self) -> list[DeviceBuffer]:
        """Buffers allocated here or mapped here (each once)."""
        live = dict(self._allocated)
        live.update((bid, buf) for bid, (buf, _) in self._mapped.items())
        return list(live.values())

    def dma_written(self, bank, offset, nbytes) -> int:
        """Nothing to move: the NIC's writes went to DRAM through the TLB windows."""
        return 0

    def dram_write_barrier(self) -> None:
        """Make the NIC's writes through the windows visible before a receive is reported finished.

        Reads one 32-bit word through every live window (its first mapped byte, each window
        once however many buffers share it), as tt-umd's
        ``LocalChip::set_membar_flag`` reads back through its window after writing: a read
        through the window returns only after earlier writes on the same PCIe-to-NOC path have
        drained. It cannot order writes whose PCIe TLPs have not reached the device yet: the
        transport must first have seen the writes complete (RDMA WRITE completions, or an RDMA
        READ after the WRITEs on the same QP). NOT exercised on hardware."""
        for address in self._windows.one_address_per_window():
            _read_word(address)

    def copy_in_banks(self, ops) -> int:
        """Intra-bank copies ``(bank, src_offset, dst_offset, nbytes)`` per bank, byte offsets
        inside the bank, each range inside one mapped run of windows of that bank; host ``memmove``
        through the window (a data-movement kernel would keep them on the device). Returns
        the number of copies."""
        count = 0
        for bank, src, dst, nbytes in ops:
            self._check_bank(bank)
            for s, d, n in zip(*(list(map(int, x)) for x in (src, dst, nbytes)), strict=True):
                ctypes.memmove(self.host_address(bank, d, n), self.host_address(bank, s, n), n)
                count += 1
        return count

    # -- extras -----------------------------------------------------------------------------
    def bank_mapping(self, buffer: DeviceBuffer, bank: int) -> BankMapping:
        """The :class:`BankMapping` of a mapped buffer's bank (dma-buf fd, window, plan)."""
        self._check_bank(bank)
        entry = self._mapped.get(buffer.buffer_id)
        if entry is None:
            raise BankBufferError(f"buffer {buffer.buffer_id} is not mapped")
        return entry[1][bank]

    def host_address(self, bank: int, offset: int, nbytes: int) -> int:
        """Host address of device bytes ``[offset, offset + nbytes)`` of ``bank`` (byte offsets
        in the bank), which must lie in one mapped run of windows (a mapped buffer's region)."""
        self._check_bank(bank)
        address = self._windows.address(bank, offset, nbytes)
        if address is None:
            raise BankBufferError(
                f"bank {bank}: bytes [{offset:#x}, {offset + nbytes:#x}) lie in no mapped TLB window "
                "(map_buffer_dma a buffer there first)"
            )
        return address

    def mapped_buffers(self) -> list[DeviceBuffer]:
        return [buf for buf, _ in self._mapped.values()]

    @property
    def device(self) -> TlbDevice:
        """The tt-kmd fd the windows are allocated on (its owner closes it after :meth:`close`)."""
        return self._device

    @property
    def live_windows(self) -> int:
        """TLB windows currently allocated by this object."""
        return self._windows.live_windows

    def close(self) -> None:
        """Unmap every buffer still mapped (and so release every window); forget adopted ones."""
        for buffer in self.mapped_buffers():
            self.unmap_buffer_dma(buffer)
        self._adopted.clear()

    # -- internals --------------------------------------------------------------------------
    def _check_bank(self, bank: int) -> None:
        check_bank(bank, self._num_banks, "this device")

    def _windows_taken(self, bank: int) -> str:
        """The ENOMEM text: the window size, who holds such windows, and what to do."""
        size = self._window_bytes
        arch = self._device.arch.value
        held = tt_metal_held_windows(arch, self._num_banks).get(size, 0)
        path = getattr(self._device, "path", None)
        holders = device_holders(path) if path is not None else []
        names = ", ".join(f"{comm} (pid {pid})" for pid, comm in holders) or "none found"
        return (
            f"ALLOCATE_TLB({format_bytes(size)}) for bank {bank}: no window of {format_bytes(size)} is free "
            f"on {path or 'this device'} ({self.live_windows} held here). Of the {DEVICE_WINDOWS[arch][size]} "
            f"tt-kmd offers, tt-metal's configure_static_tlbs holds {held} on a {self.profile.name} "
            f"(one 4 GiB window per DRAM channel with all 8; one 2 MiB window per Tensix and Ethernet core). "
            f"Processes holding the device open: {names}. Plan the windows with "
            "window_plan.plan_route_windows (staged mode maps 2 MiB windows)."
        )


def _read_word(address: int) -> int:
    """One 32-bit load from a host address (a mapped TLB window)."""
    return ctypes.c_uint32.from_address(address).value


def _receive_allocator(profile: DeviceProfile, window_bytes: int, map_bytes: int) -> LockstepAllocator:
    """The receive buffers' allocator: up to the mapped bytes of a 4 GiB window (bank-sized
    windows), or from the first window-aligned address of a bank (smaller windows)."""
    limit = min(profile.bank_size_bytes, map_bytes)
    if window_bytes >= profile.bank_size_bytes:
        return LockstepAllocator.for_device(profile, limit)
    base = -(-profile.dram_unreserved_base // window_bytes) * window_bytes
    return LockstepAllocator(profile, profile.bank_size_bytes, base=base)


def _profile_for(profile: DeviceProfile | str | None, num_banks: int) -> DeviceProfile:
    """The device profile, checked against the bank count the harvest mask leaves."""
    if isinstance(profile, DeviceProfile):
        loaded = profile
    else:
        loaded = load_profile(profile or ("p150a" if num_banks == 8 else "p100"))
    if loaded.num_banks != num_banks:
        raise ValueError(f"device profile {loaded.name!r} has {loaded.num_banks} banks; this device has {num_banks}")
    return loaded
