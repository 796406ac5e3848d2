"""The decode side's per-bank receive buffers (Algorithm 1, D2-D5 and D8).

At start the pool allocates ONE interleaved device buffer with ``size_per_bank`` bytes
in every DRAM bank (``allocate_bank_buffers``), maps it with the bank-buffer API
(``map_buffer_dma``), and registers each bank's region (``get_buffer_address_bank`` /
``get_buffer_size_bank``) with the transport, once. Requests then take slices of it
from the pool's own lockstep allocator: a slice has the same byte offset in every
bank (like the device's interleaved buffers) and ``nbytes_per_bank`` bytes in each.
With ``registration="per_request"`` (default) only the slices handed out are registered
with the transport (one region per bank, from ``acquire`` to ``release``); ``"whole"``
registers each bank's region once, at start.
The buffers are written once at creation (first touch: page faults of host-backed
memory happen then, not inside a transfer). ``acquire`` waits up to a deadline for room
(backpressure) and raises
:class:`BufferFull` after it; nothing is ever handed out twice.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
import time

from vllm_hawk.kvflow.errors import BufferFull
from vllm_hawk.kvflow.exposure import check_registration
from vllm_hawk.layout.interleave import LockstepAllocator, OutOfDeviceMemory


@dataclasses.dataclass(frozen=True)
class RecvSlice:
    """One request's receive buffers: ``nbytes_per_bank`` bytes at ``offset`` (bytes from
    the pool buffer's start) in every bank. ``addr(bank)`` is the host virtual address."""

    key: str
    offset: int
    nbytes_per_bank: int
    bank_addrs: tuple[int, ...]  # host virtual address of the slice in each bank
    device_offset: int  # byte offset of the slice inside each bank (for copy_in_bank)

    def addr(self, bank: int) -> int:
        return self.bank_addrs[bank]


class BankBufferPool:
    """Receive buffers on a device implementing the bank-buffer API (emulated or real).

    device: a :class:`~vllm_hawk.npu.bank_buffer.BankBufferAPI` that can also
    ``allocate_bank_buffers`` / ``free_buffer``. size_per_bank: bytes per bank.
    transport: registers each bank's region (optional). align: slice alignment (bytes).
    """

    def __init__(
        self, device, size_per_bank: int, transport=None, align: int | None = None, registration: str = "per_request"
    ) -> None:
        self.device = device
        self.registration = check_registration(registration)
        self._slice_regs: dict[str, list[int]] = {}
        self.num_banks = device.get_device_num_bank()
        self.buffer = device.allocate_bank_buffers(size_per_bank)
        self._transport = transport
        self._registered: list[int] = []
        try:
            device.map_buffer_dma(self.buffer)
            self.bank_addrs = tuple(device.get_buffer_address_bank(self.buffer, b) for b in range(self.num_banks))
            self.size_per_bank = min(device.get_buffer_size_bank(self.buffer, b) for b in range(self.num_banks))
            for a in self.bank_addrs:  # first touch now, so page faults stay out of the transfers
                ctypes.memset(a, 0, self.size_per_bank)
            if transport is not None and registration == "whole":
                for a in self.bank_addrs:
                    transport.register(a, self.size_per_bank)
                    self._registered.append(a)
        except Exception:
            self.close()
            raise
        profile = dataclasses.replace(device.profile, dram_alignment_bytes=align or device.profile.dram_alignment_bytes)
        self._alloc = LockstepAllocator(profile, self.size_per_bank)
        self._cond = threading.Condition()
        self._live: dict[str, RecvSlice] = {}

    def acquire(self, key: str, nbytes_per_bank: int, timeout_s: float = 0.0) -> RecvSlice:
        """A slice of ``nbytes_per_bank`` bytes in every bank for request ``key``."""
        if nbytes_per_bank <= 0:
            raise ValueError(f"bank pool: nbytes_per_bank must be > 0, got {nbytes_per_bank}")
        if nbytes_per_bank > self.size_per_bank:
            raise BufferFull(
                f"bank pool: request {key!r} needs {nbytes_per_bank} bytes per bank, the "
                f"pool has {self.size_per_bank}; raise the receive-buffer size",
                key,
            )
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            if key in self._live:
                raise ValueError(f"bank pool: request {key!r} already holds receive buffers")
            while True:
                try:
                    a = self._alloc.allocate_per_bank(nbytes_per_bank)
                    break
                except OutOfDeviceMemory:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BufferFull(
                            f"bank pool full: request {key!r} needs {nbytes_per_bank} bytes per bank, "
                            f"largest free run {self._alloc.largest_free()} of {self.size_per_bank} "
                            f"({len(self._live)} live requests) after waiting {timeout_s:.3f} s",
                            key,
                        ) from None
                    self._cond.wait(left)
            s = RecvSlice(
                key,
                a.address,
                nbytes_per_bank,
                tuple(x + a.address for x in self.bank_addrs),
                self.buffer.address + a.address,
            )
            if self._transport is not None and self.registration == "per_request":
                regs: list[int] = []
                try:
                    for addr in s.bank_addrs:
                        self._transport.register(addr, nbytes_per_bank)
                        regs.append(addr)
                except BaseException:
                    self._unregister(regs)
                    self._alloc.free(a.address)
                    raise
                self._slice_regs[key] = regs
            self._live[key] = s
            return s

    def _unregister(self, addrs) -> None:
        for addr in addrs:
            with contextlib.suppress(Exception):  # transport closed already
                self._transport.unregister(addr)

    def release(self, key: str) -> None:
        with self._cond:
            s = self._live.pop(key, None)
            if s is None:
                raise KeyError(f"bank pool: no receive buffers held by request {key!r}")
            self._unregister(self._slice_regs.pop(key, ()))
            self._alloc.free(s.offset)
            self._cond.notify_all()

    def live(self) -> list[str]:
        with self._cond:
            return list(self._live)

    def free_bytes_per_bank(self) -> int:
        with self._cond:
            return self._alloc.free_bytes()

    def is_idle(self) -> bool:
        """No slice handed out and the whole region free."""
        with self._cond:
            return not self._live and self._alloc.free_bytes() == self.size_per_bank

    def close(self) -> None:
        for regs in self._slice_regs.values():
            self._unregister(regs)
        self._slice_regs = {}
        for a in self._registered:
            with contextlib.suppress(Exception):  # best effort
                self._transport.unregister(a)
        self._registered = []
        if self.buffer is not None:
            with contextlib.suppress(Exception):  # not mapped
                self.device.unmap_buffer_dma(self.buffer)
            self.device.free_buffer(self.buffer)
            self.buffer = None
