"""The bank-buffer API: per-DRAM-bank RDMA buffers on a Tenstorrent device.

Named after the UMD additions of the HAWK paper (Table 6). A *device buffer* is an
interleaved DRAM buffer allocated in lockstep: it has the same address in every bank
and ``size_per_bank`` bytes in each. ``map_buffer_dma`` makes each bank's region of that
buffer reachable by the NIC and by this process (a host virtual address a transport can
register); the per-bank address and size are then queried one bank at a time.

Every device backend implements :class:`BankBufferAPI`, which declares every call the
connector's sinks (:mod:`vllm_hawk.kvflow.sinks`) and receive-buffer pool
(:mod:`vllm_hawk.kvflow.bank_pool`) make: the emulated device (:mod:`vllm_hawk.npu.emulated`),
one chip of a ttnn mesh (:mod:`vllm_hawk.npu.ttnn_chip`) and a Blackhole over tt-kmd
(:mod:`vllm_hawk.npu.tt_kmd`). Callers never branch on which one they hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from vllm_hawk.layout.device_profiles import DeviceProfile


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
    """Per-bank DMA mapping of interleaved device buffers (paper Table 6), plus the
    receive-buffer allocation and data movement the sinks need. Units: bytes; offsets are
    device (lockstep) addresses inside a bank."""

    profile: DeviceProfile  # bank count, DRAM alignment (the receive pool's allocator reads it)

    @property
    def num_banks(self) -> int:
        """Number of DRAM banks (== :meth:`get_device_num_bank`)."""

    def get_device_num_bank(self) -> int:
        """Number of DRAM banks that interleaved buffers span (p150a: 8, n150: 12)."""

    def allocate_bank_buffers(self, size_per_bank: int) -> DeviceBuffer:
        """One ``size_per_bank``-byte region per bank, the same address in every bank (a
        receive buffer)."""

    def free_buffer(self, buffer: DeviceBuffer) -> None:
        """Release a buffer (BankBufferError if unknown)."""

    def live_buffers(self) -> list[DeviceBuffer]:
        """The buffers this backend holds now (allocated or adopted, not yet freed)."""

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

    def dma_written(self, bank: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> int:
        """After a READ batch wrote ranges ``(bank, offset, nbytes)`` (one entry per range)
        through mapped regions: make them device memory. Returns the bytes moved (0 where
        the mapped regions are the device's DRAM)."""

    def copy_in_banks(self, ops: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> int:
        """Intra-bank copies (the staged mode's D6-D7): ``ops`` holds ``(bank, src_offset,
        dst_offset, nbytes)`` per bank. Returns the number of copies."""

    def dram_write_barrier(self) -> None:
        """Every write into DRAM so far (the NIC's, the copies') is visible to the device;
        a sink calls it before it reports a receive finished."""


def recv_nbytes_per_bank(ring_nbytes: int, num_banks: int, alignment: int) -> int:
    """A Tenstorrent sink's receive buffer per bank (bytes): ``ring_nbytes`` over the banks,
    rounded down to the DRAM alignment (at least one aligned unit)."""
    return max(alignment, ring_nbytes // num_banks // alignment * alignment)
