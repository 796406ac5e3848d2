"""A ttnn chip whose DRAM a NIC writes through tt-kmd TLB windows: the Tenstorrent decode's
NIC paths (``nic-direct``, ``nic-staged`` of :mod:`vllm_hawk.tenstorrent.route`).

HARDWARE ONLY, NOT exercised in CI: no Tenstorrent device here. tt-metal (ttnn) allocates
every buffer, as :class:`~vllm_hawk.npu.ttnn_chip.TTNNChip` does (so tt-metal's allocator
never hands the same DRAM to anything else); tt-kmd only maps: ``map_buffer_dma`` aims
windows of the route's size at the buffer's range in each bank
(:class:`~vllm_hawk.npu.tt_kmd.bank_buffers.TtKmdBankBuffers`, its own ``/dev/tenstorrent/N``
fd) and exports them as dma-bufs, the host addresses it returns are the windows' mappings,
and nothing is staged in host memory. After a receive the NIC's writes must be in DRAM
before the KV is used: :meth:`dram_write_barrier`.
"""

from __future__ import annotations

import ctypes

import numpy as np

from vllm_hawk.layout.device_profiles import DeviceProfile
from vllm_hawk.npu.bank_buffer import DeviceBuffer
from vllm_hawk.npu.tt_kmd.bank_buffers import TtKmdBankBuffers
from vllm_hawk.npu.ttnn_chip import TTNNChip

__all__ = ["TTNNKmdChip"]


class TTNNKmdChip(TTNNChip):
    """:class:`TTNNChip` (allocation, reads, page locations) with the bank-buffer mapping
    calls served by ``windows``, the chip's tt-kmd windows (see module doc): every buffer
    mapped is tt-metal's, so it is :meth:`~TtKmdBankBuffers.adopt`-ed (mapped, its DRAM left
    to ttnn) and :meth:`~TtKmdBankBuffers.release`-d on unmap."""

    def __init__(self, mesh, profile: DeviceProfile | str, chip: int, windows: TtKmdBankBuffers) -> None:
        super().__init__(mesh, profile, chip)
        self.windows = windows

    def map_buffer_dma(self, buffer: DeviceBuffer) -> None:
        """Aim windows at ``buffer``'s region in every bank and export them (a receive buffer
        in staged mode, the KV cache's tensors in direct mode)."""
        self.windows.adopt(self._known(buffer))

    def get_buffer_address_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        """Host address of ``buffer``'s region in ``bank``: inside the bank's window mappings
        (one contiguous range even when the region spans several windows)."""
        return self.windows.get_buffer_address_bank(self._known(buffer), bank)

    def get_buffer_size_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        return self.windows.get_buffer_size_bank(self._known(buffer), bank)

    def unmap_buffer_dma(self, buffer: DeviceBuffer) -> None:
        self.windows.release(self._known(buffer))

    def dma_written(self, bank, offset, nbytes) -> int:
        """Nothing to move: the NIC wrote DRAM through the windows."""
        return 0

    def copy_in_banks(self, ops) -> int:
        """The staged mode's D6-D7, ``(bank, src_offset, dst_offset, nbytes)`` per bank (byte
        offsets in the bank): each source, in a mapped receive buffer, is read through its
        window; each destination (KV-cache pages, which no window maps in staged mode) is
        written through tt-metal (:meth:`write_bank`); a data-movement kernel would keep both
        on the device. Returns the number of copies."""
        count = 0
        for bank, src, dst, nbytes in ops:
            for s, d, n in zip(*(np.asarray(x, dtype=np.int64).tolist() for x in (src, dst, nbytes)), strict=True):
                self.write_bank(bank, d, ctypes.string_at(self.windows.host_address(bank, s, n), n))
                count += 1
        return count

    def dram_write_barrier(self) -> None:
        """The NIC's writes reached DRAM (see TtKmdBankBuffers.dram_write_barrier)."""
        self.windows.dram_write_barrier()

    def free_buffer(self, buf: DeviceBuffer) -> None:
        if buf in self.windows.mapped_buffers():
            self.windows.release(buf)
        super().free_buffer(buf)

    def close(self) -> None:
        """Release every window (and the tt-kmd fd), then what :class:`TTNNChip` holds."""
        self.windows.close()
        self.windows.device.close()
        super().close()
