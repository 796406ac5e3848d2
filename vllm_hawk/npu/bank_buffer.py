"""The bank-buffer API: per-DRAM-bank RDMA buffers on a Tenstorrent device.

Named after the UMD additions of the HAWK paper (Table 6). A *device buffer* is an
interleaved DRAM buffer allocated in lockstep: it has the same address in every bank
and ``size_per_bank`` bytes in each. ``map_buffer_dma`` makes each bank's region of that
buffer reachable by the NIC and by this process (a host virtual address a transport can
register); the per-bank address and size are then queried one bank at a time.

Every device backend implements :class:`BankBufferAPI`: the emulated device
(``vllm_hawk.npu.emulated``) and the real one over tt-kmd (``vllm_hawk.npu.tt_kmd``).
Callers never branch on which one they hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class DeviceBuffer:
    """An interleaved DRAM buffer, identical address range in every bank.

    address: byte offset inside each bank (the same in all banks, lockstep allocator).
    size_per_bank: bytes reserved in each bank = ceil(num_pages / num_banks) * aligned page.
    page_size: bytes per page before alignment; num_pages: pages in the buffer.
    Page i lives in bank ``i % num_banks`` at ``address + (i // num_banks) * aligned_page``.
    """

    buffer_id: int
    address: int
    size_per_bank: int
    page_size: int
    num_pages: int
    aligned_page_size: int
    num_banks: int


class BankBufferError(RuntimeError):
    """A bank-buffer call was given a buffer or bank it cannot serve."""


def check_bank(bank: int, num_banks: int, device: str) -> int:
    """``bank`` if ``0 <= bank < num_banks``, else BankBufferError naming ``device``'s count."""
    if not 0 <= bank < num_banks:
        raise BankBufferError(f"bank {bank} out of range: {device} has {num_banks} banks")
    return bank


def known_buffer(buffers: dict[int, DeviceBuffer], buffer: DeviceBuffer) -> DeviceBuffer:
    """``buffer`` if ``buffers`` (id -> buffer, the live ones) holds it, else BankBufferError."""
    if buffers.get(buffer.buffer_id) != buffer:
        raise BankBufferError(f"unknown or freed buffer id {buffer.buffer_id}")
    return buffer


@runtime_checkable
class BankBufferAPI(Protocol):
    """Per-bank DMA mapping of interleaved device buffers (paper Table 6)."""

    def get_device_num_bank(self) -> int:
        """Number of DRAM banks that interleaved buffers span (p150a: 8, n150: 12)."""

    def map_buffer_dma(self, buffer: DeviceBuffer) -> None:
        """Make every bank's region of ``buffer`` reachable for RDMA and host access.

        Raises BankBufferError if the buffer is unknown or already mapped."""

    def get_buffer_address_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        """Host virtual address (bytes) of ``buffer``'s region in ``bank``; valid until
        ``unmap_buffer_dma``. This is the address a transport registers and targets."""

    def get_buffer_size_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        """Bytes of ``buffer`` in ``bank`` (== buffer.size_per_bank for interleaved)."""

    def unmap_buffer_dma(self, buffer: DeviceBuffer) -> None:
        """Undo ``map_buffer_dma``; the buffer itself stays allocated."""
