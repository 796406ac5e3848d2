"""A device's TLB windows aimed at DRAM banks and their host mappings (bytes throughout).

NOT exercised in CI: no Tenstorrent device here; tested against a fake tt-kmd below the
ioctl boundary (``tests/tt_kmd_fakes.py``).

A bank region ``[address, address + nbytes)`` is covered by the consecutive windows of
``window_bytes`` aimed at its size-aligned bases (``topology.plan_tlb_windows``): one window
when it lies inside one, several otherwise (2 MiB windows on a Blackhole, staged mode).

- **TLB windows** (the scarce resource: one pool per size per device, tt-kmd ``tlb.c``) are
  allocated and configured once per (bank, window base) and shared, reference counted, by
  every run that contains them; the last run out frees the window.
- **Runs** are the host mappings: one window mmap'd alone (its first ``map_bytes``), or
  several mapped whole at consecutive addresses inside one reserved address range
  (``reserve_va`` + ``map_window(..., at=)``), so a region is one contiguous host range.
  Runs of the same windows are shared (reference counted). tt-kmd maps a window only from
  its first byte, never splits a window's mapping, and allows a window several mappings
  (tt-kmd ``memory.c`` ``map_tlb_window``, ``tlb_vma_may_split``, ``tlb_refs``), so two
  different runs over a common window each map it.
- Teardown per run: munmap every window's mapping, release the reservation, then FREE_TLB
  of windows no run uses (tt-kmd answers EBUSY to FREE_TLB while a window is mapped).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from vllm_hawk.npu.tt_kmd.device import TlbDevice, TlbWindow, TtKmdError, release_va, reserve_va
from vllm_hawk.npu.tt_kmd.topology import NocEndpoint, WindowPlan


@dataclass(frozen=True)
class WindowSegment:
    """The part of a bank region inside one TLB window.

    ``plan``: the part's offset and bytes inside the window and its page-rounded export
    range; ``host_address``: the part's first byte in host memory; ``dmabuf_fd`` (None when
    not exported) covers ``[plan.export_offset, plan.export_offset + plan.export_size)`` of
    the window, and the part starts ``dmabuf_offset`` bytes into it."""

    window: TlbWindow
    plan: WindowPlan
    host_address: int
    dmabuf_fd: int | None

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    @property
    def dmabuf_offset(self) -> int:
        return self.plan.dmabuf_offset

    @property
    def export_address(self) -> int:
        """Host address of the dma-buf's first byte (page aligned)."""
        return self.host_address - self.plan.dmabuf_offset


@dataclass(frozen=True)
class BankMapping:
    """One bank's mapped region of a buffer: ``segments`` (one per TLB window, in address
    order) at consecutive host addresses from ``host_address``. ``window_va`` is the host
    address of the first window's byte 0. ``window``, ``plan``, ``dmabuf_fd`` and
    ``dmabuf_offset`` describe a region inside one window; with several windows read
    ``segments`` (each has its own dma-buf: register them one by one)."""

    bank: int
    endpoint: NocEndpoint
    window_va: int
    segments: tuple[WindowSegment, ...]

    @property
    def host_address(self) -> int:
        return self.segments[0].host_address

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def _single(self, what: str) -> WindowSegment:
        if len(self.segments) != 1:
            raise ValueError(
                f"bank {self.bank}'s region spans {len(self.segments)} TLB windows, each with its own "
                f"dma-buf: read {what} per window from BankMapping.segments"
            )
        return self.segments[0]

    @property
    def window(self) -> TlbWindow:
        return self._single("window").window

    @property
    def plan(self) -> WindowPlan:
        return self._single("plan").plan

    @property
    def dmabuf_fd(self) -> int | None:
        return self._single("dmabuf_fd").dmabuf_fd

    @property
    def dmabuf_offset(self) -> int:
        return self._single("dmabuf_offset").dmabuf_offset


@dataclass
class _Window:
    """A TLB window aimed at bank ``bank`` from NOC ``base``; ``refs``: runs containing it."""

    window: TlbWindow
    bank: int
    base: int
    refs: int = 0


@dataclass
class _Run:
    """``windows`` of one bank mapped at ``va`` + i x window bytes; ``reserved``: ``va`` is a
    reserve_va range of ``len(windows)`` whole windows (else one window, ``map_bytes`` long)."""

    bank: int
    windows: list[_Window]
    va: int
    reserved: bool
    refs: int = 0


class BankWindows:
    """The TLB windows and runs of one device (see module doc).

    ``endpoints[b]``: bank b's NOC endpoint; ``map_bytes``: how much of a window a lone
    window's run maps (several windows are mapped whole); ``enomem_text(bank)``: the error
    text when a window pool is empty (names who holds the windows)."""

    def __init__(
        self,
        device: TlbDevice,
        endpoints: list[NocEndpoint],
        window_bytes: int,
        map_bytes: int,
        *,
        ordering: int,
        write_combined: bool,
        enomem_text: Callable[[int], str],
    ) -> None:
        self._dev = device
        self._endpoints = endpoints
        self._wb = window_bytes
        self._map_bytes = map_bytes
        self._ordering = ordering
        self._wc = write_combined
        self._enomem_text = enomem_text
        self._windows: dict[tuple[int, int], _Window] = {}
        self._runs: dict[tuple[int, int, int], _Run] = {}

    @property
    def live_windows(self) -> int:
        """TLB windows allocated here."""
        return len(self._windows)

    def map(self, bank: int, plans: tuple[WindowPlan, ...], export: bool) -> BankMapping:
        """Map ``plans`` (one per window, ``topology.plan_tlb_windows``) of ``bank`` and
        export each part (``export``); undone on any failure."""
        run = self._acquire_run(bank, plans[0].window_base, len(plans))
        segments: list[WindowSegment] = []
        try:
            for i, plan in enumerate(plans):
                window = run.windows[i].window
                fd = self._dev.export_dmabuf(window, plan.export_offset, plan.export_size) if export else None
                segments.append(WindowSegment(window, plan, run.va + i * self._wb + plan.offset, fd))
        except BaseException:
            _close_fds(segments)
            self._drop_run(run)
            raise
        return BankMapping(bank, self._endpoints[bank], run.va, tuple(segments))

    def release(self, mapping: BankMapping) -> None:
        """Close ``mapping``'s dma-bufs and drop its run (and windows no run uses)."""
        try:
            _close_fds(mapping.segments)
        finally:
            key = (mapping.bank, mapping.segments[0].plan.window_base, len(mapping.segments))
            self._drop_run(self._runs[key])

    def address(self, bank: int, offset: int, nbytes: int) -> int | None:
        """Host address of bytes ``[offset, offset + nbytes)`` of ``bank`` inside one run, or None."""
        for run in self._runs.values():
            base = run.windows[0].base
            end = base + (len(run.windows) - 1) * self._wb + self._map_length(run)
            if run.bank == bank and base <= offset and offset + nbytes <= end:
                return run.va + offset - base
        return None

    def one_address_per_window(self) -> Iterator[int]:
        """A host address inside each live TLB window (its first mapped byte), each window once."""
        seen: set[int] = set()
        for run in list(self._runs.values()):
            for i, win in enumerate(run.windows):
                if win.window.id not in seen:
                    seen.add(win.window.id)
                    yield run.va + i * self._wb

    # -- internals --------------------------------------------------------------------------
    def _map_length(self, run: _Run) -> int:
        return self._wb if run.reserved else self._map_bytes

    def _acquire_run(self, bank: int, first_base: int, count: int) -> _Run:
        key = (bank, first_base, count)
        run = self._runs.get(key)
        if run is None:
            run = self._map_run(bank, first_base, count)
            self._runs[key] = run
        run.refs += 1
        return run

    def _map_run(self, bank: int, first_base: int, count: int) -> _Run:
        """Acquire ``count`` windows from ``first_base`` and map them consecutively."""
        dev, wins, mapped, va = self._dev, [], [], None
        length = self._wb if count > 1 else self._map_bytes
        try:
            for i in range(count):
                wins.append(self._acquire_window(bank, first_base + i * self._wb))
            if count == 1:
                va = dev.map_window(wins[0].window, length, self._wc)
                mapped.append(va)
            else:
                va = reserve_va(count * self._wb)
                for i, win in enumerate(wins):
                    mapped.append(dev.map_window(win.window, length, self._wc, at=va + i * self._wb))
        except BaseException:
            for address in mapped:
                dev.unmap_window(address, length)
            if va is not None and count > 1:
                release_va(va, count * self._wb)
            for win in reversed(wins):
                self._drop_window(win)
            raise
        return _Run(bank, wins, va, reserved=count > 1)

    def _drop_run(self, run: _Run) -> None:
        run.refs -= 1
        if run.refs:
            return
        del self._runs[(run.bank, run.windows[0].base, len(run.windows))]
        length = self._map_length(run)
        try:
            for i in range(len(run.windows)):
                self._dev.unmap_window(run.va + i * self._wb, length)
            if run.reserved:
                release_va(run.va, len(run.windows) * self._wb)
        finally:
            for win in reversed(run.windows):
                self._drop_window(win)

    def _acquire_window(self, bank: int, base: int) -> _Window:
        win = self._windows.get((bank, base))
        if win is None:
            try:
                window = self._dev.allocate_tlb(self._wb)
            except TtKmdError as exc:
                if exc.errno != errno.ENOMEM:
                    raise
                raise TtKmdError(errno.ENOMEM, self._enomem_text(bank)) from exc
            try:
                self._dev.configure_tlb(window, self._endpoints[bank], base, self._ordering)
            except BaseException:
                self._dev.free_tlb(window)
                raise
            win = self._windows[(bank, base)] = _Window(window, bank, base)
        win.refs += 1
        return win

    def _drop_window(self, win: _Window) -> None:
        win.refs -= 1
        if win.refs == 0:
            del self._windows[(win.bank, win.base)]
            self._dev.free_tlb(win.window)


def _close_fds(segments: list[WindowSegment] | tuple[WindowSegment, ...]) -> None:
    for seg in segments:
        if seg.dmabuf_fd is not None:
            os.close(seg.dmabuf_fd)
