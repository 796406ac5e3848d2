"""DRAM bank interleaving and the lockstep allocator, with tt-metal's semantics.

An interleaved buffer of ``num_pages`` pages puts page i in bank ``i % nb`` at byte
``address + (i // nb) * aligned_page`` of that bank (tt-metal ``Buffer::page_address``).
The allocator is lockstep (tt-metal ``BankManager``): ONE free list covers all banks, so
a buffer occupies the same address range in every bank, ``ceil(num_pages / nb) *
aligned_page`` bytes per bank, even in banks that hold fewer of its pages. This is why
a buffer that fills one bank more than the others starves every later allocation.

DRAM is allocated bottom-up, first fit: the lowest-address free block that fits, at its
low end; freed blocks merge with free neighbours. Checked address for address, through
Out of Memory and reuse, against tt-metal (ttnn 0.81.1) on ttsim (tests/ttsim). (tt-metal's
sources also carry a size-segregated "best" search in ``FreeListOpt``; 0.81.1 does not
place DRAM buffers that way: a 2 MiB buffer goes into a low 11 MiB hole, not a higher
3 MiB one.) The device allocator manages ``[profile.dram_unreserved_base, bank size)`` of
every bank (:meth:`LockstepAllocator.for_device`). Units: bytes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from vllm_hawk.layout.device_profiles import DeviceProfile


def pages_per_bank(num_pages: int, num_banks: int) -> int:
    return -(-num_pages // num_banks)


def page_location(page: int, num_banks: int, aligned_page: int) -> tuple[int, int]:
    """Page index -> (bank, byte offset from the buffer's address in that bank)."""
    return page % num_banks, (page // num_banks) * aligned_page


class OutOfDeviceMemory(MemoryError):
    """An interleaved allocation did not fit; the message says what was asked and what is free."""


@dataclass(frozen=True)
class Allocation:
    address: int  # byte offset inside every bank
    size_per_bank: int  # bytes reserved in every bank


class LockstepAllocator:
    """tt-metal's DRAM free list shared by all banks of one device (bytes).

    Manages ``[base, bank_size)`` in every bank (``bank_size`` defaults to the profile's);
    returned addresses are absolute byte offsets in each bank.
    """

    def __init__(self, profile: DeviceProfile, bank_size_bytes: int | None = None, *, base: int = 0):
        self.profile = profile
        self.num_banks = profile.num_banks
        self.alignment = profile.dram_alignment_bytes
        self.bank_size = bank_size_bytes if bank_size_bytes is not None else profile.bank_size_bytes
        if not 0 <= base < self.bank_size:
            raise ValueError(f"LockstepAllocator: base {base:#x} outside a {self.bank_size:#x}-byte bank")
        self.base = base
        self.capacity = self.bank_size - base  # bytes managed per bank
        self._free: list[tuple[int, int]] = [(base, self.capacity)]  # sorted (start, size)
        self._used: dict[int, int] = {}  # address -> size_per_bank

    @classmethod
    def for_device(cls, profile: DeviceProfile, bank_size_bytes: int | None = None) -> LockstepAllocator:
        """The allocator of a device's DRAM, as tt-metal's: it manages
        ``[profile.dram_unreserved_base, bank_size_bytes or profile.bank_size_bytes)``."""
        return cls(profile, bank_size_bytes, base=profile.dram_unreserved_base)

    def allocate(self, num_pages: int, page_nbytes: int) -> Allocation:
        """Reserve an interleaved buffer; raises :class:`OutOfDeviceMemory` if it does not fit."""
        if num_pages <= 0 or page_nbytes <= 0:
            raise ValueError(f"allocate: num_pages and page_nbytes must be positive, got {num_pages}, {page_nbytes}")
        size = pages_per_bank(num_pages, self.num_banks) * self.profile.aligned_page(page_nbytes)
        return self.allocate_per_bank(size)

    def allocate_per_bank(self, size_per_bank: int) -> Allocation:
        """Reserve ``size_per_bank`` bytes (rounded up to alignment) at one address in all banks."""
        size = max(-(-size_per_bank // self.alignment) * self.alignment, self.alignment)
        i = next((k for k, (_, free) in enumerate(self._free) if free >= size), None)
        if i is None:
            raise OutOfDeviceMemory(
                f"{self.profile.name}: cannot allocate {size} B per bank x {self.num_banks} banks "
                f"(lockstep): largest free block is {self.largest_free()} B in every bank, "
                f"{self.free_bytes()} B free per bank of {self.capacity} B"
            )
        start, free = self._free[i]
        if free == size:
            del self._free[i]
        else:
            self._free[i] = (start + size, free - size)
        self._used[start] = size
        return Allocation(start, size)

    def free(self, address: int) -> None:
        size = self._used.pop(address, None)
        if size is None:
            raise ValueError(f"free: no allocation at address {address:#x}")
        i = bisect.bisect(self._free, (address, 0))
        self._free.insert(i, (address, size))
        # merge with neighbours
        if i + 1 < len(self._free) and address + size == self._free[i + 1][0]:
            self._free[i] = (address, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == address:
            s, z = self._free.pop(i - 1)
            self._free[i - 1] = (s, z + self._free[i - 1][1])

    def free_bytes(self) -> int:
        """Free bytes per bank (the same in every bank)."""
        return sum(z for _, z in self._free)

    def largest_free(self) -> int:
        return max((z for _, z in self._free), default=0)

    def used_bytes(self) -> int:
        return sum(self._used.values())

    def blocks(self) -> list[tuple[int, int, bool]]:
        """Every block in address order: (address, size, allocated), as tt-metal's
        memory view lists them (addresses absolute)."""
        out = [(a, z, False) for a, z in self._free] + [(a, z, True) for a, z in self._used.items()]
        return sorted(out)
