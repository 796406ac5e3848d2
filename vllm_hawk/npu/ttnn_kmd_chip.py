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

from vllm_hawk.layout.device_profiles import DeviceProfile
from vllm_hawk.npu.bank_buffer import DeviceBuffer
from vllm_hawk.npu.tt_kmd.bank_buffers import TtKmdBankBuffers
from vllm_hawk.npu.ttnn_chip import TTNNChip

__all__ = ["TTNNKmdChip"]


class TTNNKmdChip(TTNNChip):
    """:class:`TTNNChip` (allocation, reads, page locations) with the bank-buffer mapping
    calls served by ``windows``, the chip's tt-kmd windows (see module doc)."""

    def __init__(self, mesh, profile: DeviceProfile | str, chip: int, windows: TtKmdBankBuffers) -> None:
        super().__init__(mesh, profile, chip)
        self.windows = windows

    def map_buffer_dma(self, buffer: DeviceBuffer) -> None:
        self.windows.map_buffer_dma(self._known(buffer))

    def get_buffer_address_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        """Host address of ``buffer``'s region in ``bank``: inside the bank's window mapping."""
        return self.windows.get_buffer_address_bank(self._known(buffer), bank)

    def get_buffer_size_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        return self.windows.get_buffer_size_bank(self._known(buffer), bank)

    def unmap_buffer_dma(self, buffer: DeviceBuffer) -> None:
        self.windows.unmap_buffer_dma(self._known(buffer))

    def dma_written(self, bank, offset, nbytes) -> int:
        """Nothing to move: the NIC wrote DRAM through the windows."""
        return 0

    def copy_in_banks(self, ops) -> int:
        """The staged mode's intra-bank copies, through the windows (see TtKmdBankBuffers)."""
        return self.windows.copy_in_banks(ops)

    def dram_write_barrier(self) -> None:
        """The NIC's writes reached DRAM (see TtKmdBankBuffers.dram_write_barrier)."""
        self.windows.dram_write_barrier()

    def free_buffer(self, buf: DeviceBuffer) -> None:
        if buf in self.windows.mapped_buffers():
            self.windows.unmap_buffer_dma(buf)
        super().free_buffer(buf)

    def close(self) -> None:
        self.windows.close()
        super().close()
