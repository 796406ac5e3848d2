"""DRAM bank interleaving and the lockstep allocator, with tt-metal's semantics.

An interleaved buffer of ``num_pages`` pages puts page i in bank ``i % nb`` at byte
``address + (i // nb) * aligned_page`` of that bank (tt-metal ``Buffer::page_address``).
The allocator is lockstep (tt-metal ``BankManager``): ONE free list covers all banks, so
a buffer occupies the same address range in every bank, ``ceil(num_pages / nb) *
aligned_page`` bytes per bank, even in banks that hold fewer of its pages. This is why
a buffer that fills one bank more than the others starves every later allocation.

Which free block a DRAM buffer gets follows tt-metal's ``FreeListOpt`` with its default
``SearchPolicy::BEST`` (checked address for address against tt-metal on ttsim, see
tests/ttsim): free blocks sit in size classes ``min(floor(log2(size // 1024)), n - 1)``
(``n = clamp(bitlength(region // 1024), 2, 18)``), each class ordered by address; an
allocation takes the lowest-address block that fits in the LOWEST class holding one,
bottom-up (the low end of the block). So a small buffer goes into a small hole even when
a big hole sits below it: not plain first fit. Freed blocks merge with free neighbours.
The device allocator manages ``[profile.dram_unreserved_base, bank size)`` of every bank
(:meth:`LockstepAllocator.for_device`). Units: bytes.
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


SIZE_CLASS_BASE = 1024  # tt-metal FreeListOpt size_segregated_base (bytes)
MAX_SIZE_CLASSES = 18  # bitlength(128 MiB / 1024): FreeListOpt's cap on size classes


def size_class_count(region_bytes: int) -> int:
    """Number of FreeListOpt size classes for a region of ``region_bytes``."""
    return min(max((region_bytes // SIZE_CLASS_BASE).bit_length(), 2), MAX_SIZE_CLASSES)


class LockstepAllocator:
    """tt-metal's DRAM free list shared by all banks of one device (bytes).

    Manages ``[base, bank_size)`` in every bank; returned addresses are absolute byte
    offsets in each bank. ``policy``: ``"tt-metal"`` (FreeListOpt BEST, see module
    docstring) or ``"first-fit"`` (lowest address that fits, for host-side sub-allocators).
    """

    POLICIES = ("tt-metal", "first-fit")

    def __init__(self, profile: DeviceProfile, bank_size_bytes: int | None = None, *,
                 base: int = 0, policy: str = "tt-metal"):
        if policy not in self.POLICIES:
            raise ValueError(f"LockstepAllocator: policy must be one of {self.POLICIES}, got {policy!r}")
        self.profile = profile
        self.num_banks = profile.num_banks
        self.alignment = profile.dram_alignment_bytes
        self.bank_size = bank_size_bytes if bank_size_bytes is not None else profile.bank_size_bytes
        if not 0 <= base < self.bank_size:
            raise ValueError(f"LockstepAllocator: base {base:#x} outside a {self.bank_size:#x}-byte bank")
        self.base = base
        self.policy = policy
        self.capacity = self.bank_size - base  # bytes managed per bank
        self._classes = size_class_count(self.capacity)
        self._free: list[tuple[int, int]] = [(base, self.capacity)]  # sorted (start, size)
        self._used: dict[int, int] = {}  # address -> size_per_bank

    @classmethod
    def for_device(cls, profile: DeviceProfile, bank_size_bytes: int | None = None) -> "LockstepAllocator":
        """The allocator of a device's DRAM: tt-metal's policy over
        ``[profile.dram_unreserved_base, bank_size_bytes or profile.bank_size_bytes)``."""
        return cls(profile, bank_size_bytes, base=profile.dram_unreserved_base, policy="tt-metal")

    def allocate(self, num_pages: int, page_nbytes: int) -> Allocation:
        """Reserve an interleaved buffer; raises :class:`OutOfDeviceMemory` if it does not fit."""
        if num_pages <= 0 or page_nbytes <= 0:
            raise ValueError(f"allocate: num_pages and page_nbytes must be positive, got {num_pages}, {page_nbytes}")
        size = pages_per_bank(num_pages, self.num_banks) * self.profile.aligned_page(page_nbytes)
        return self.allocate_per_bank(size)

    def _size_class(self, size: int) -> int:
        return min(max((size // SIZE_CLASS_BASE).bit_length() - 1, 0), self._classes - 1)

    def _pick(self, size: int) -> int | None:
        """Index in ``self._free`` of the block the policy takes for ``size`` bytes."""
        fits = [i for i, (_, free) in enumerate(self._free) if free >= size]
        if not fits:
            return None
        if self.policy == "first-fit":
            return fits[0]
        return min(fits, key=lambda i: (self._size_class(self._free[i][1]), self._free[i][0]))

    def allocate_per_bank(self, size_per_bank: int) -> Allocation:
        """Reserve ``size_per_bank`` bytes (rounded up to alignment) at one address in all banks."""
        size = max(-(-size_per_bank // self.alignment) * self.alignment, self.alignment)
        i = self._pick(size)
        if i is None:
            raise OutOfDeviceMemory(
                f"{self.profile.name}: cannot allocate {size} B per bank x {self.num_banks} banks "
                f"(lockstep): largest free block is {self.largest_free()} B in every bank, "
                f"{self.free_bytes()} B free per bank of {self.capacity} B")
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
