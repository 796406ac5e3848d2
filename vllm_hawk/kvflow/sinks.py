"""Decode-side sinks of Algorithm 1: where a request's KV lands (D2-D7).

:class:`~vllm_hawk.kvflow.decode.DecodeEndpoint` owns the protocol, deadlines, the
READ batch and every failure path; a sink only knows its memory. Three sinks:

* :class:`VllmPagedSink` (GG-Direct): a vLLM paged cache; the READs land in its blocks.
* :class:`VllmStagedSink` (staged, GG-Host): a vLLM paged cache behind a registered
  receive ring; the READs land in the ring, then copies move the bytes into the blocks.

  Both take a prefill whose blocks are smaller (the decode's a multiple of them): the
  prefill's blocks land whole as sub-blocks of the decode's, then
  :class:`~vllm_hawk.kvflow.regroup.Regroup` rearranges them (D6-D7; ``plan_regroup``).
* :class:`TTSink` (GN-HAWK): a Tenstorrent KV pool through the bank-buffer API: per-bank
  receive buffers then intra-bank copies (``staged``), READs straight into the KV pages
  (``direct``), or one READ per tile (``per_tile``, the design the paper rejects).

``land`` returns a :class:`Landing`: the batch's entries, ``complete`` (D6-D7, then the
receive buffers are free) and ``free`` (receive buffers only, for a failed batch once it
has settled) — ``free`` is None when the READs write KV pages directly, and then
``dst_blocks`` are the pages a failed batch may still write.

Registration (``registration``, :mod:`~vllm_hawk.kvflow.exposure`): with ``per_request``
(default) a sink registers only what one fetch lands in, for that fetch: receive-ring
ranges and bank-buffer slices while held, and for direct sinks the destination blocks'
byte runs from ``land`` until the endpoint calls ``Landing.unexpose`` (after the batch);
a layer-group fetch (:meth:`TTSink.land_groups`) registers every group's pages once,
from D2 until ``GroupLanding.unexpose`` after the last group's batch.
``whole`` registers the cache / pool / ring once at start.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import time
from collections.abc import Callable, Sequence

import numpy as np

from vllm_hawk.kvflow.bank_pool import BankBufferPool
from vllm_hawk.kvflow.base import Capabilities, Entry, KVSink, Landing
from vllm_hawk.kvflow.exposure import Exposure, check_registration
from vllm_hawk.kvflow.regroup import Regroup, SubBlockPlan, sub_block_plan
from vllm_hawk.kvflow.ring import RingBuffer
from vllm_hawk.kvflow.streams import KVRegionMap, LayerRegion, pair_stream, ring_segments
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout
from vllm_hawk.npu.bank_buffer import BankBufferAPI, BankBufferError, DeviceBuffer
from vllm_hawk.protocol import KVReady, LayoutDesc
from vllm_hawk.transform import make_plan

SINK_MODES = ("staged", "direct", "per_tile")


def merged_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(addr, nbytes) ranges merged where adjacent or overlapping, sorted."""
    out: list[list[int]] = []
    for a, n in sorted(ranges):
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n - out[-1][0])
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]


class _Registered:
    """Regions registered with a transport by a sink, unregistered on close."""

    def __init__(self, transport) -> None:
        self.transport, self.addrs = transport, []

    def add(self, ranges) -> None:
        for a, n in merged_ranges(list(ranges)):
            self.transport.register(a, n)
            self.addrs.append(a)

    def close(self) -> None:
        for a in self.addrs:
            with contextlib.suppress(Exception):  # transport closed already
                self.transport.unregister(a)
        self.addrs = []


# --------------------------------------------------------------------------- vLLM caches


def _vllm_check(ready: KVReady, region_map: KVRegionMap, plan: SubBlockPlan, export_nbytes: int) -> str:
    if any(s.offset_bytes + s.nbytes > export_nbytes for s in ready.segments):
        return "a segment lies outside the prefill's exported region"
    want = plan.num_src * (region_map.block_nbytes // plan.ratio)
    if ready.total_nbytes != want:
        return f"KVReady covers {ready.total_nbytes} bytes, {plan.num_src} source blocks need {want}"
    return ""


def _sub_blocks(plan: SubBlockPlan) -> tuple[int, int] | None:
    """``pair_stream``'s ``sub_blocks`` for ``plan`` (None: equal block sizes)."""
    return (plan.num_src, plan.ratio) if plan.ratio > 1 else None


class VllmPagedSink(KVSink):
    """GG-Direct: READs into a vLLM paged cache's blocks. region_map: the cache;
    storages: its buffers ``(addr, nbytes)``, registered with ``transport`` now;
    regroup: the cache's layer tensors and layouts, for a prefill with smaller blocks
    (None: equal block sizes only)."""

    mode = "direct"
    caps = Capabilities(head_shares=True, regroup=True)

    def __init__(
        self,
        region_map: KVRegionMap,
        layout: LayoutDesc,
        transport,
        storages: Sequence[tuple[int, int]],
        registration: str = "per_request",
        regroup: Regroup | None = None,
    ) -> None:
        self.region_map, self.layout, self.storages = region_map, layout, list(storages)
        self.regroup = regroup
        self.registration = check_registration(registration)
        self._reg = _Registered(transport)
        self.exposure = Exposure(transport)
        try:
            if registration == "whole":
                self._reg.add(storages)
        except BaseException:
            self._reg.close()
            raise

    def plan(self, dst_blocks: np.ndarray) -> SubBlockPlan:
        self.region_map.check_blocks(dst_blocks.tolist())
        return SubBlockPlan(dst_blocks, 1, len(dst_blocks), self.layout.block_size)

    def plan_regroup(
        self, dst_blocks: np.ndarray, src_block_size: int, num_tokens: int, first_block: int
    ) -> SubBlockPlan:
        """The plan of a pull from a prefill with ``src_block_size``-token blocks (raises
        ValueError naming both sizes unless this sink's are a multiple of them)."""
        if self.regroup is None:
            raise ValueError(
                f"the prefill's blocks hold {src_block_size} tokens, this decode's {self.layout.block_size}, "
                "and this sink was built without its caches' layouts: start both engines with the same --block-size"
            )
        self.region_map.check_blocks(dst_blocks.tolist())
        return sub_block_plan(dst_blocks, self.layout.block_size, src_block_size, num_tokens, first_block)

    def check_ready(self, ready: KVReady, plan, export_nbytes: int) -> str:
        return _vllm_check(ready, self.region_map, plan, export_nbytes)

    def for_heads(self, region_map: KVRegionMap, layout: LayoutDesc, head_start: int) -> VllmPagedSink:
        """This sink restricted to KV heads ``head_start ..`` (``region_map``/``layout`` of
        those heads; a share of a request, see :class:`~vllm_hawk.kvflow.decode.Share`). It
        shares this sink's registrations and receive memory (keys are share keys) and is
        closed with it."""
        view = copy.copy(self)
        view.region_map, view.layout = region_map, layout
        if self.regroup is not None:
            view.regroup = self.regroup.heads(head_start, layout.num_kv_heads)
        view.close = lambda: None  # the parent owns what is registered
        return view

    def _complete_in_place(self, plan: SubBlockPlan) -> Callable[[], dict]:
        """D6-D7 of a direct landing: nothing, or the regroup of smaller source blocks."""
        if plan.ratio == 1:
            return lambda: {}

        def complete() -> dict:
            t0 = time.monotonic()
            self.regroup.apply(plan)
            return {"regroup_s": time.monotonic() - t0, "regrouped": len(plan)}

        return complete

    def land(self, req_id, ready, plan, remote_base, claim_wait_s) -> Landing:
        entries = pair_stream(ready.segments, remote_base, self.region_map, plan.blocks.tolist(), 0, _sub_blocks(plan))
        return Landing(
            entries,
            self._complete_in_place(plan),
            None,
            tuple(int(b) for b in plan.blocks),
            _figures(plan),
            unexpose=_expose(self.exposure, self.registration, req_id, entries, self.storages),
        )

    def close(self) -> None:
        self.exposure.close()
        self._reg.close()


def _figures(plan: SubBlockPlan) -> dict:
    """A landing's figures: the prefill's block size when its blocks were regrouped."""
    return {"src_block_size": plan.src_block_size} if plan.ratio > 1 else {}


def _stream_buffer_map(dmap: KVRegionMap, n: int, base: int) -> KVRegionMap:
    """A map whose ``n`` blocks are the layer streams laid contiguously from ``base``."""
    layers, off = [], base
    for r in dmap.layers:
        bn = r.block_nbytes
        layers.append(LayerRegion(off, bn, ((0, bn),)))
        off += n * bn
    return KVRegionMap(tuple(layers), n)


class VllmStagedSink(VllmPagedSink):
    """Staged: READs into a registered receive ring (``recv_nbytes`` bytes), then copies
    into the cache's blocks. The cache itself is not registered."""

    mode = "staged"

    def __init__(
        self,
        region_map: KVRegionMap,
        layout: LayoutDesc,
        transport,
        recv_nbytes: int,
        registration: str = "per_request",
        regroup: Regroup | None = None,
    ) -> None:
        super().__init__(region_map, layout, transport, (), registration, regroup)
        self.recv = RingBuffer(recv_nbytes, transport, registration=registration)

    def land(self, req_id, ready, plan, remote_base, claim_wait_s) -> Landing:
        dmap, n = self.region_map, len(plan)
        off = self.recv.reserve(req_id, n * dmap.block_nbytes, claim_wait_s)
        try:
            base = self.recv.base_addr + off
            bmap = _stream_buffer_map(dmap, n, base)
            entries = pair_stream(ready.segments, remote_base, bmap, list(range(n)), 0, _sub_blocks(plan))
        except BaseException:
            self.recv.release(req_id)
            raise

        def complete() -> dict:
            t0 = time.monotonic()
            try:
                if plan.ratio > 1:  # regroup from the ring's layer streams into the blocks
                    self.regroup.apply(plan, self._streams(off, n))
                    figures = {"regrouped": n}
                else:
                    copies = pair_stream(ring_segments(dmap, n, 0), base, dmap, plan.blocks.tolist(), 0)
                    for dst, src, nb in copies:
                        ctypes.memmove(dst, src, nb)
                    figures = {"copies": len(copies)}
            finally:
                self.recv.release(req_id)
            return {"copy_s": time.monotonic() - t0, **figures}

        return Landing(entries, complete, lambda: self.recv.release(req_id), figures=_figures(plan))

    def _streams(self, off: int, n: int) -> list:
        """Per layer, the receive ring's stream of ``n`` blocks from ring offset ``off`` as
        uint8 ``[n, block bytes]``."""
        segments = ring_segments(self.region_map, n, off)
        return [
            self.recv.view(s.offset_bytes, s.nbytes).view(n, r.block_nbytes)
            for s, r in zip(segments, self.region_map.layers, strict=True)
        ]

    def close(self) -> None:
        self.recv.close()
        super().close()


def vllm_sink(
    region_map: KVRegionMap,
    layout: LayoutDesc,
    transport,
    mode: str,
    storages,
    recv_nbytes: int,
    registration: str = "per_request",
    regroup: Regroup | None = None,
):
    """The sink for a vLLM decode cache in ``mode`` (``direct`` | ``staged``); ``regroup``:
    its caches' layouts, so that it takes a prefill with smaller blocks."""
    if mode == "staged":
        return VllmStagedSink(region_map, layout, transport, recv_nbytes, registration, regroup)
    return VllmPagedSink(region_map, layout, transport, storages, registration, regroup)


def _expose(exposure: Exposure, registration: str, key: str, entries, domains) -> Callable[[], None] | None:
    """Register the local side of ``entries`` for ``key`` (per_request, coarsened inside
    ``domains``: the cache's tensors or the banks' mappings); the undo, or None."""
    if registration != "per_request":
        return None
    exposure.acquire(key, [(loc, n) for loc, _rem, n in entries], domains=domains)
    return lambda: exposure.release(key)


# --------------------------------------------------------------------------- Tenstorrent


def layout_desc(layout: TTKVCacheLayout, name: str = "tt-paged") -> LayoutDesc:
    s = layout.spec
    return LayoutDesc(
        name=name,
        dtype=s.dtype,
        block_size=s.block_size,
        num_layers=s.num_layers,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        num_banks=layout.num_banks,
        tile_nbytes=s.tile_nbytes,
        page_nbytes=layout.aligned_page,
    )


class KVPageAddresses:
    """Host virtual addresses of a Tenstorrent KV pool's pages, via the bank-buffer API.

    ``buffers``: the pool's device buffers (K0, V0, K1, ...). Each is mapped with
    ``map_buffer_dma`` unless it already is (those mapped here are unmapped by
    :meth:`close`); a byte at device offset ``o`` of bank ``b`` inside buffer ``buf``
    lives at ``get_buffer_address_bank(buf, b) + (o - buf.address)``.
    """

    def __init__(self, device: BankBufferAPI, buffers) -> None:
        self.device = device
        self._mapped_here: list[DeviceBuffer] = []
        bufs = sorted(buffers, key=lambda b: b.address)
        nb = device.get_device_num_bank()
        try:
            for buf in bufs:
                try:
                    device.get_buffer_address_bank(buf, 0)
                except BankBufferError:  # not mapped yet
                    device.map_buffer_dma(buf)
                    self._mapped_here.append(buf)
            self.starts = np.array([b.address for b in bufs], dtype=np.int64)
            self.host = np.array(
                [[device.get_buffer_address_bank(buf, b) for b in range(nb)] for buf in bufs], dtype=np.int64
            ).reshape(len(bufs), nb)
            self.sizes = np.array(
                [[device.get_buffer_size_bank(buf, b) for b in range(nb)] for buf in bufs], dtype=np.int64
            ).reshape(len(bufs), nb)
        except BaseException:
            self.close()
            raise

    def regions(self) -> list[tuple[int, int]]:
        """(host address, nbytes) of every buffer's region in every bank."""
        return list(zip(self.host.reshape(-1).tolist(), self.sizes.reshape(-1).tolist(), strict=False))

    def addresses(self, bank: np.ndarray, dst_offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Host addresses of ops ``(bank, device offset in the bank, nbytes)``; each op must
        lie inside one buffer (raises ``ValueError`` otherwise)."""
        bank, off, n = (np.asarray(x, dtype=np.int64) for x in (bank, dst_offset, nbytes))
        k = np.searchsorted(self.starts, off, side="right") - 1
        kk = np.maximum(k, 0)
        ok = (k >= 0) & (bank >= 0) & (bank < self.host.shape[1])
        bb = np.where(ok, bank, 0)
        ok &= off + n <= self.starts[kk] + self.sizes[kk, bb]
        if not ok.all():
            i = int(np.argmin(ok))
            raise ValueError(
                f"KV page op {i} (bank {int(bank[i])}, offset {int(off[i])}, {int(n[i])} bytes) "
                "lies outside the KV pool's buffers"
            )
        return self.host[kk, bb] + (off - self.starts[kk])

    def close(self) -> None:
        for buf in self._mapped_here:
            with contextlib.suppress(Exception):  # freed already
                self.device.unmap_buffer_dma(buf)
        self._mapped_here = []


def staged_copies(device, plan, recv_offset: int) -> int:
    """D6-D7 with the DRAM write barrier around them: the NIC's writes into the receive
    buffers are in DRAM before they are copied, the copies before the receive is reported
    finished. Returns the number of copies."""
    device.dram_write_barrier()
    n = intra_bank_copies(device, plan, recv_offset)
    device.dram_write_barrier()
    return n


def intra_bank_copies(device, plan, recv_offset: int) -> int:
    """D6-D7 of the staged mode: each bank's copies from its receive buffer (at byte
    ``recv_offset`` in every bank) into the KV pages, all banks at once; returns the count."""
    ops = [
        (b, o.src_offset + recv_offset, o.dst_offset, o.nbytes)
        for b in range(device.num_banks)
        if len(o := plan.intra_bank.for_bank(b))
    ]
    return device.copy_in_banks(ops)


class TTSink(KVSink):
    """GN-HAWK: a Tenstorrent KV pool (``layout``, ``kv_buffers`` K0, V0, K1, ...) on a
    device with the bank-buffer API plus ``copy_in_banks``, ``dma_written`` and ``live_buffers``.

    mode ``staged``: a :class:`BankBufferPool` of ``recv_nbytes_per_bank`` bytes per bank
    (or ``pool``, shared) is registered; ``direct`` / ``per_tile``: the KV pool's bank
    regions are mapped and registered with ``transport`` now. A registered KV pool is
    exposed to the transport's peers. A failing ``__init__`` leaves nothing registered."""

    caps = Capabilities(group_landing=True, snapshot=True)
    wire_kind = "tt-tiles"

    def __init__(
        self,
        device,
        layout: TTKVCacheLayout,
        kv_buffers,
        transport,
        mode: str = "staged",
        *,
        recv_nbytes_per_bank: int = 16 << 20,
        pool: BankBufferPool | None = None,
        registration: str = "per_request",
    ) -> None:
        if mode not in SINK_MODES:
            raise ValueError(f"Tenstorrent sink mode must be one of {SINK_MODES}, got {mode!r}")
        self.device, self.tt_layout, self.kv_buffers, self.mode = device, layout, list(kv_buffers), mode
        self.layout = layout_desc(layout)
        self.num_banks = layout.num_banks
        self.pool, self._own_pool = pool, False
        self.pages: KVPageAddresses | None = None
        self._domains: list[tuple[int, int]] = []
        self.registration = check_registration(registration)
        self._reg = _Registered(transport)
        self.exposure = Exposure(transport)
        try:
            if mode == "staged":
                if pool is None:
                    self.pool = BankBufferPool(device, recv_nbytes_per_bank, transport, registration=registration)
                    self._own_pool = True
            else:
                self.pages = KVPageAddresses(device, self.kv_buffers)
                self._domains = merged_ranges(self.pages.regions())  # per bank when the buffers are adjacent
                if registration == "whole":
                    self._reg.add(self.pages.regions())
        except BaseException:
            self.close()
            raise

    def plan(self, dst_blocks: np.ndarray):
        return make_plan(self.tt_layout, dst_blocks, "staged" if self.mode == "staged" else "direct")

    def check_ready(self, ready: KVReady, plan, export_nbytes: int) -> str:
        """The segments must be exactly the plan's: one per non-empty bank, in bank order,
        contiguous from ``ring_offset``, inside the exported ring."""
        want = [
            (int(b), ready.ring_offset + int(plan.segment_offset[b]), int(plan.segment_nbytes[b]))
            for b in range(self.num_banks)
            if plan.segment_nbytes[b]
        ]
        got = [(s.bank, s.offset_bytes, s.nbytes) for s in ready.segments]
        if got != want or ready.total_nbytes != plan.total_nbytes:
            return f"KVReady segments do not match the transfer plan (got {got[:3]}..., want {want[:3]}...)"
        if ready.ring_offset + ready.total_nbytes > export_nbytes:
            return "KVReady range lies outside the prefill's exported ring"
        return ""

    def land(self, req_id, ready, plan, remote_base, claim_wait_s) -> Landing:
        per_bank = [0] * self.num_banks
        for s in ready.segments:
            per_bank[s.bank] += s.nbytes
        figures = {"bytes_per_bank": per_bank, "tile_dtype": self.layout.dtype, "banks": self.num_banks}
        if self.mode == "staged":  # pair each segment with its bank's receive buffer
            recv = self.pool.acquire(req_id, plan.recv_nbytes_per_bank, claim_wait_s)
            entries = [(recv.addr(s.bank), remote_base + s.offset_bytes, s.nbytes) for s in ready.segments]

            def complete() -> dict:  # D6-D7: intra-bank copies into the KV pages
                t0 = time.monotonic()
                try:
                    n_copy = staged_copies(self.device, plan, recv.device_offset)
                finally:
                    self.pool.release(req_id)
                return {"copy_s": time.monotonic() - t0, "intra_bank_ops": n_copy}

            return Landing(entries, complete, lambda: self.pool.release(req_id), figures=figures)
        ops = plan.rdma if self.mode == "direct" else plan.per_tile_ops()
        local = self.pages.addresses(ops.bank, ops.dst_offset, ops.nbytes).tolist()
        remote = (remote_base + ready.ring_offset + ops.src_offset).tolist()
        entries = list(zip(local, remote, ops.nbytes.tolist(), strict=False))
        return Landing(
            entries,
            lambda: self._written(ops),
            None,
            tuple(int(b) for b in plan.dst_blocks),
            figures,
            unexpose=_expose(self.exposure, self.registration, req_id, entries, self._domains),
            check_after_complete=True,
        )

    # ------------------------------------------------------------------ layer groups

    def group_ranges(self, plan, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(bank, byte offset in G', nbytes) of layers lo..hi-1 in each bank's segment."""
        tb = self.tt_layout.spec.tile_nbytes
        out = []
        for b in range(self.num_banks):
            per_slot = int(plan.bank_counts[b]) * tb
            if per_slot:
                out.append((b, int(plan.segment_offset[b]) + 2 * lo * per_slot, 2 * (hi - lo) * per_slot))
        return out

    def check_group(self, ready: KVReady, plan, export_nbytes: int, lo: int, hi: int, ring_offset: int) -> str:
        """'' when a layer group's KVReady is exactly that group's slice of the plan, at
        the request's ring offset (the same for every group), inside the exported ring."""
        if ready.ring_offset != ring_offset:
            return f"layer group {lo}..{hi - 1} at ring offset {ready.ring_offset}, the request's is {ring_offset}"
        want = [(b, ring_offset + o, n) for b, o, n in self.group_ranges(plan, lo, hi)]
        got = [(s.bank, s.offset_bytes, s.nbytes) for s in ready.segments]
        if got != want:
            return f"KVReady segments do not match layer group {lo}..{hi - 1} (got {got[:3]}..., want {want[:3]}...)"
        if ring_offset + plan.total_nbytes > export_nbytes:
            return "KVReady range lies outside the prefill's exported ring"
        return ""

    def land_groups(self, req_id: str, plan, claim_wait_s: float) -> GroupLanding:
        """D2 once for a request fetched by layer groups: claim receive memory (staged)."""
        return GroupLanding(self, req_id, plan, claim_wait_s)

    def _written(self, ops) -> dict:
        """After a direct batch: the device's ``dma_written`` (a no-op where the READs wrote
        device memory; on a simulator the host moves the bytes from the mapped shadows), then
        its DRAM write barrier, before the receive is reported finished."""
        self.device.dma_written(ops.bank, ops.dst_offset, ops.nbytes)
        self.device.dram_write_barrier()
        return {}

    def idle(self) -> bool:
        return self.pool is None or self.pool.is_idle()

    def holds(self) -> dict:
        return {
            "recv_live": len(self.pool.live()) if self.pool else 0,
            "device_buffers": len(self.device.live_buffers()),
        }

    def close(self) -> None:
        self.exposure.close()
        self._reg.close()
        if self.pages is not None:
            self.pages.close()
            self.pages = None
        if self._own_pool and self.pool is not None:
            self.pool.close()
        self.pool = None


class GroupLanding:
    """One request landed layer group by layer group (see :meth:`TTSink.land_groups`):
    ``entries(ready, remote_base, lo, hi)`` pairs one group's READs (D3-D5),
    ``complete`` / ``free`` / ``dst_blocks`` / ``figures`` as in :class:`Landing`."""

    def __init__(self, sink: TTSink, req_id: str, plan, claim_wait_s: float) -> None:
        self.sink, self.req_id, self.plan = sink, req_id, plan
        self.figures = {
            "tile_dtype": sink.layout.dtype,
            "banks": sink.num_banks,
            "bytes_per_bank": [int(n) for n in plan.segment_nbytes],
        }
        self.recv = None
        self.unexpose: Callable[[], None] | None = None  # direct, per_request: the endpoint calls it after the READs
        self.check_after_complete = sink.mode != "staged"  # direct: the bytes are in the KV pages after complete()
        if sink.mode == "staged":  # the pool registers the slice (per_request) until it is released
            self.recv = sink.pool.acquire(req_id, plan.recv_nbytes_per_bank, claim_wait_s)
            self.free = lambda: sink.pool.release(req_id)
            self.dst_blocks: tuple[int, ...] = ()
        else:
            self.free = None
            self.dst_blocks = tuple(int(b) for b in plan.dst_blocks)
            self._ops = plan.rdma if sink.mode == "direct" else plan.per_tile_ops()
            self._local = sink.pages.addresses(self._ops.bank, self._ops.dst_offset, self._ops.nbytes)
            tb = sink.tt_layout.spec.tile_nbytes
            per_slot = plan.bank_counts[self._ops.bank] * tb
            self._slot = (self._ops.src_offset - plan.segment_offset[self._ops.bank]) // np.maximum(per_slot, 1)
            # every group's pages, registered once for the whole fetch (D2 .. the last batch)
            self.unexpose = _expose(
                sink.exposure,
                sink.registration,
                req_id,
                [(a, 0, n) for a, n in zip(self._local.tolist(), self._ops.nbytes.tolist(), strict=False)],
                sink._domains,
            )

    def entries(self, ready: KVReady, remote_base: int, lo: int, hi: int) -> list[Entry]:
        if self.recv is not None:  # each bank's group slice lands at its place in the bank's receive buffer
            return [
                (self.recv.addr(b) + o - int(self.plan.segment_offset[b]), remote_base + ready.ring_offset + o, n)
                for b, o, n in self.sink.group_ranges(self.plan, lo, hi)
            ]
        sel = (self._slot >= 2 * lo) & (self._slot < 2 * hi)
        remote = remote_base + ready.ring_offset + self._ops.src_offset[sel]
        return list(zip(self._local[sel].tolist(), remote.tolist(), self._ops.nbytes[sel].tolist(), strict=False))

    def complete(self) -> dict:
        """D6-D7 once every group has landed (staged: intra-bank copies, then free)."""
        if self.recv is None:
            return self.sink._written(self._ops)
        sink, t0 = self.sink, time.monotonic()
        try:
            n_copy = staged_copies(sink.device, self.plan, self.recv.device_offset)
        finally:
            sink.pool.release(self.req_id)
        return {"copy_s": time.monotonic() - t0, "intra_bank_ops": n_copy}
