"""An emulated Tenstorrent device (Blackhole or Wormhole) that runs on the CPU.

Each DRAM bank is one separately mapped host memory region (anonymous mmap), so each
bank can be registered with a transport on its own, as the real per-bank TLB windows
are. Interleaved buffers come from the lockstep allocator; the byte formats, bank
interleaving and KV tensor layout are those of the real device (see
``vllm_hawk.layout``). Implements :class:`~vllm_hawk.npu.bank_buffer.BankBufferAPI`.

This is an emulation, not a model of timing: figures measured on it are CPU figures.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from vllm_hawk.layout.device_profiles import DeviceProfile, load_profile
from vllm_hawk.layout.interleave import LockstepAllocator, page_location, pages_per_bank
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.npu.bank_buffer import BankBufferError, DeviceBuffer, check_bank, known_buffer

DEFAULT_EMULATED_BANK_BYTES = 256 << 20  # emulated banks are smaller than real ones
# Copies of 8 banks x 160 runs on 2 threads against one (2 cores): 1.0x at 8 KiB per
# copy, 1.44x (slower: the GIL between copies) at 16, 0.97x at 32, 0.62x at 64, 0.57x at 128.
PARALLEL_COPY_MIN_NBYTES = 64 << 10
# Python's mmap module names MAP_NORESERVE only from 3.13; 0x4000 is its Linux value.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class EmulatedDevice:
    """A Tenstorrent chip emulated in host memory.

    bank_size_bytes: allocatable bytes per bank (default 256 MiB, at most the profile's
    ``usable_bank_bytes``; pass that for a full-size device). As on tt-metal, the
    allocator hands out ``[base, base + bank_size_bytes)`` with ``base =
    profile.dram_unreserved_base``; byte ``a`` of a bank's host region is device address
    ``a`` and the reserved bytes below ``base`` stay unused. Memory is reserved lazily by
    the OS (MAP_NORESERVE): untouched pages cost nothing.
    """

    def __init__(self, profile: DeviceProfile | str = "p150a", bank_size_bytes: int | None = None):
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        size = bank_size_bytes or min(DEFAULT_EMULATED_BANK_BYTES, self.profile.usable_bank_bytes)
        if not 0 < size <= self.profile.usable_bank_bytes:
            raise ValueError(
                f"bank_size_bytes {size} must be in (0, {self.profile.usable_bank_bytes}]: "
                f"{self.profile.name}'s usable bytes per bank (bank_size_bytes - dram_unreserved_base)"
            )
        self.bank_size = size  # allocatable bytes per bank
        self.bank_nbytes = self.profile.dram_unreserved_base + size  # mapped bytes per bank
        self.allocator = LockstepAllocator.for_device(self.profile, self.bank_nbytes)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self._maps = [mmap.mmap(-1, self.bank_nbytes, flags=flags) for _ in range(self.profile.num_banks)]
        self.banks = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]  # one uint8 array per bank
        self._buffers: dict[int, DeviceBuffer] = {}
        self._mapped: set[int] = set()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._copy_threads = min(self.profile.num_banks, os.cpu_count() or 1)
        self._copy_pool: ThreadPoolExecutor | None = None  # created on the first multi-bank copy

    # ---- device memory -------------------------------------------------------------
    @property
    def num_banks(self) -> int:
        return self.profile.num_banks

    def bank_address(self, bank: int) -> int:
        """Host virtual address of byte 0 of ``bank``."""
        return self.banks[self._check_bank(bank)].ctypes.data

    def bank_tensor(self, bank: int) -> torch.Tensor:
        """The whole bank as a uint8 torch tensor sharing memory (no copy)."""
        return torch.from_numpy(self.banks[self._check_bank(bank)])

    def allocate_buffer(self, num_pages: int, page_nbytes: int) -> DeviceBuffer:
        """An interleaved buffer of ``num_pages`` pages of ``page_nbytes`` bytes."""
        with self._lock:
            alloc = self.allocator.allocate(num_pages, page_nbytes)
            buf = DeviceBuffer(
                next(self._ids),
                alloc.address,
                alloc.size_per_bank,
                page_nbytes,
                num_pages,
                self.profile.aligned_page(page_nbytes),
                self.num_banks,
            )
            self._buffers[buf.buffer_id] = buf
            return buf

    def allocate_bank_buffers(self, size_per_bank: int) -> DeviceBuffer:
        """One ``size_per_bank``-byte region per bank: a buffer of num_banks pages."""
        return self.allocate_buffer(self.num_banks, size_per_bank)

    def free_buffer(self, buf: DeviceBuffer) -> None:
        with self._lock:
            if self._buffers.pop(buf.buffer_id, None) is None:
                raise BankBufferError(f"free_buffer: unknown buffer id {buf.buffer_id}")
            self._mapped.discard(buf.buffer_id)
            self.allocator.free(buf.address)

    def live_buffers(self) -> list[DeviceBuffer]:
        return list(self._buffers.values())

    def dma_written(self, bank, offset, nbytes) -> int:
        """Ranges a READ batch wrote through mapped regions: nothing to move, the mapped
        regions ARE the banks here (a simulated device copies them from host shadows)."""
        return 0

    def dram_write_barrier(self) -> None:
        """Nothing to wait for: the banks are host memory, written synchronously."""

    def write_page(self, buf: DeviceBuffer, page: int, data: bytes | np.ndarray) -> None:
        bank, off = self._page(buf, page)
        arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data.reshape(-1).view(np.uint8)
        if arr.size > buf.page_size:
            raise ValueError(f"write_page: {arr.size} B into a {buf.page_size} B page")
        self.banks[bank][off : off + arr.size] = arr

    def read_page(self, buf: DeviceBuffer, page: int) -> np.ndarray:
        bank, off = self._page(buf, page)
        return self.banks[bank][off : off + buf.page_size].copy()

    def copy_in_bank(self, bank: int, src_offset: np.ndarray, dst_offset: np.ndarray, nbytes: np.ndarray) -> None:
        """Intra-bank copies (the staged mode's D6-D7): byte offsets inside ``bank``."""
        b = self.banks[self._check_bank(bank)]
        for s, d, n in zip(src_offset.tolist(), dst_offset.tolist(), nbytes.tolist(), strict=False):
            b[d : d + n] = b[s : s + n]

    def copy_in_banks(self, ops: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> int:
        """Intra-bank copies of several banks: ``ops`` holds ``(bank, src_offset, dst_offset,
        nbytes)`` per bank (byte offsets inside it). Banks are separate DRAM channels, so
        their copies run at once, on at most one host thread per core (numpy copies
        without the GIL), when the mean copy is at least :data:`PARALLEL_COPY_MIN_NBYTES`;
        returns the number of copies."""
        ops = [op for op in ops if len(op[3])]
        count = sum(len(op[3]) for op in ops)
        if (
            len(ops) > 1
            and self._copy_threads > 1
            and sum(int(op[3].sum()) for op in ops) >= PARALLEL_COPY_MIN_NBYTES * count
        ):
            with self._lock:
                if self._copy_pool is None:
                    self._copy_pool = ThreadPoolExecutor(self._copy_threads, thread_name_prefix="hawk-bank-copy")
                pool = self._copy_pool
            list(pool.map(lambda op: self.copy_in_bank(*op), ops))
        else:
            for op in ops:
                self.copy_in_bank(*op)
        return count

    # ---- Tenstorrent paged KV cache ---------------------------------------------------
    def allocate_kv_cache(self, spec: TTKVCacheSpec) -> tuple[TTKVCacheLayout, list[DeviceBuffer]]:
        """Allocate K and V per layer (one tile per page, interleaved); returns the layout
        and its buffers (K0, V0, K1, V1, ...). On failure nothing stays allocated."""
        bufs: list[DeviceBuffer] = []
        try:
            for _ in range(2 * spec.num_layers):
                bufs.append(self.allocate_buffer(spec.tiles_per_tensor, spec.tile_nbytes))
        except Exception:
            for b in bufs:
                self.free_buffer(b)
            raise
        addrs = tuple((bufs[2 * i].address, bufs[2 * i + 1].address) for i in range(spec.num_layers))
        layout = TTKVCacheLayout(spec, self.num_banks, self.profile.aligned_page(spec.tile_nbytes), addrs)
        return layout, bufs

    def read_tiles(self, layout: TTKVCacheLayout, layer: int, kv: int, tiles: np.ndarray) -> torch.Tensor:
        """Bytes of the given tiles of tensor (layer, kv): uint8 [len(tiles), tile_nbytes]."""
        tb = layout.spec.tile_nbytes
        tiles = np.asarray(tiles, dtype=np.int64)
        bank, off = layout.tile_location(layer, kv, tiles)
        out = np.empty((tiles.size, tb), dtype=np.uint8)
        for b in range(self.num_banks):
            sel = np.nonzero(bank == b)[0]
            if sel.size:
                idx = off[sel, None] + np.arange(tb)[None, :]
                out[sel] = self.banks[b][idx]
        return torch.from_numpy(out)

    # ---- bank-buffer API (paper Table 6) --------------------------------------------
    def get_device_num_bank(self) -> int:
        return self.num_banks

    def map_buffer_dma(self, buffer: DeviceBuffer) -> None:
        with self._lock:
            self._known(buffer)
            if buffer.buffer_id in self._mapped:
                raise BankBufferError(f"map_buffer_dma: buffer {buffer.buffer_id} is already mapped")
            self._mapped.add(buffer.buffer_id)

    def get_buffer_address_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        self._known(buffer)
        if buffer.buffer_id not in self._mapped:
            raise BankBufferError(
                f"get_buffer_address_bank: buffer {buffer.buffer_id} is not mapped (call map_buffer_dma first)"
            )
        return self.bank_address(bank) + buffer.address

    def get_buffer_size_bank(self, buffer: DeviceBuffer, bank: int) -> int:
        self._known(buffer)
        self._check_bank(bank)
        return buffer.size_per_bank

    def unmap_buffer_dma(self, buffer: DeviceBuffer) -> None:
        with self._lock:
            self._known(buffer)
            if buffer.buffer_id not in self._mapped:
                raise BankBufferError(f"unmap_buffer_dma: buffer {buffer.buffer_id} is not mapped")
            self._mapped.discard(buffer.buffer_id)

    # ---- helpers ----------------------------------------------------------------------
    def _check_bank(self, bank: int) -> int:
        return check_bank(bank, self.num_banks, self.profile.name)

    def _known(self, buffer: DeviceBuffer) -> DeviceBuffer:
        return known_buffer(self._buffers, buffer)

    def _page(self, buf: DeviceBuffer, page: int) -> tuple[int, int]:
        self._known(buf)
        if not 0 <= page < buf.num_pages:
            raise IndexError(f"page {page} out of range for a buffer of {buf.num_pages} pages")
        bank, off = page_location(page, self.num_banks, buf.aligned_page_size)
        return bank, buf.address + off

    def close(self) -> None:
        with self._lock:
            pool, self._copy_pool = self._copy_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.banks = []
        for m in self._maps:
            with contextlib.suppress(BufferError):  # views still exported; the OS reclaims at exit
                m.close()
        self._maps = []


__all__ = ["EmulatedDevice", "pages_per_bank"]
