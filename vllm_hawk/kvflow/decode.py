"""The decode endpoints of Algorithm 1 (D1-D8), independent of vLLM.

:class:`DecodeEndpoint` (GN-HAWK) owns a Tenstorrent paged KV pool on a device that
implements the bank-buffer API plus :class:`DecodeDevice`'s few extras (the emulated
p150a here), a pool of per-bank receive buffers (:class:`BankBufferPool`), a transport
and a protocol client. ``fetch``:

* D1 ``KVRequest`` (destination layout + destination block ids) -> P7 ``KVReady``;
  the segments are checked against the decode's own transfer plan (bank, size, offset)
  and against the ring's registered range before anything is read;
* ``mode="staged"``: D2-D5 pair each bank's segment with that bank's receive buffer and
  submit ALL pairs as ONE batch of READs; D6-D7 intra-bank copies into the KV pages;
* ``mode="direct"``: the batch's READs target the KV pages themselves (the pool's bank
  regions are mapped and registered), no copy step;
* ``mode="per_tile"``: the mapping the paper rejects (one READ per tile, direct), for the
  benchmark; ``time_cap_s`` stops it early and reports the fraction done;
* D8 free the receive buffers, ``Release`` the prefill's ring range.

Host addresses of KV pages and receive buffers come from the bank-buffer API only
(``map_buffer_dma`` + ``get_buffer_address_bank``), see :class:`KVPageAddresses`.

The KV pool is registered with the transport (made readable/writable by the transport's
peers) only when direct or per-tile mode is used, lazily at the first such fetch
(``register_pool=None``, the default), at construction (``True``) or never (``False``:
those modes then raise). Staged mode registers only the receive buffers. Mooncake's
engine listens on all interfaces without authentication: registering the whole KV pool
exposes it to anyone who can reach that port.

Deadlines. The read of a request's G' must end before the prefill's lease on its ring
range (``KVReady.lease_ms``, counted from its arrival, less a margin): the prefill frees
and reuses the range after it. On any failure (prefill refuses, dies, misses the
deadline or the lease) ``fetch`` raises :class:`PeerFailed` and frees everything it took:
receive buffers once the transport has settled the batch (in the background when that
is late; buffers whose batch never settles within :data:`SETTLE_LIMIT_S` stay held,
see ``DecodeEndpoint.quarantined``). A failed fetch returns at the latest
``timeout_s + RELEASE_TIMEOUT_S`` after it started (``Release(ok=False)`` round trip),
plus up to :data:`SETTLE_WAIT_S` in direct/per-tile mode, where the READs write the KV
pages themselves: it waits for them to drain and, when they do not, raises
:class:`TransferUnsettled` listing the destination blocks that are unsafe.

:class:`VllmDecodeEndpoint` is the baselines' decode: a vLLM-layout cache in torch
(:class:`PagedKVCache`), block runs read as coalesced entries (GG-Host over the
host-staged transport, GG-Direct over Mooncake), and optionally the layout fix after
arrival (GN-Host: transform on the decode side, then write into the device's KV pool).
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from vllm_hawk.kvflow.bank_pool import BankBufferPool
from vllm_hawk.kvflow.errors import BufferFull, KVFlowError, PeerFailed, TransferUnsettled
from vllm_hawk.kvflow.paged_cache import LAYOUT_NAME, PagedKVCache, block_runs
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.npu.bank_buffer import BankBufferAPI, BankBufferError, DeviceBuffer
from vllm_hawk.protocol import (CompatFields, HelloAck, KVReady, KVRequest, LayoutDesc, ProtocolClient,
                                ProtocolTimeout, RemoteError)
from vllm_hawk.transform import make_plan, transform_kv
from vllm_hawk.transport import TransferFailed, TransferTimeout

logger = logging.getLogger(__name__)

FETCH_MODES = ("staged", "direct", "per_tile")

RELEASE_TIMEOUT_S = 0.5  # Release(ok=False) on a failure path: the prefill's lease frees it anyway
SETTLE_WAIT_S = 1.0  # after a failed direct/per-tile batch: wait this long for its READs to drain
SETTLE_LIMIT_S = 60.0  # staged: background free of receive buffers gives up (quarantines) after this
LEASE_MARGIN_S = 1.0  # reads end this long before the prefill's lease does (at most a quarter of it)


class DecodeDevice(BankBufferAPI, Protocol):
    """What :class:`DecodeEndpoint` needs from a device besides the bank-buffer API
    (which alone gives every host address it uses)."""

    profile: object  # DeviceProfile: dram_alignment_bytes (receive-pool slices)

    def allocate_kv_cache(self, spec: TTKVCacheSpec) -> tuple[TTKVCacheLayout, list[DeviceBuffer]]:
        """The paged KV pool: K and V buffers per layer (K0, V0, K1, ...); nothing held on failure."""

    def allocate_bank_buffers(self, size_per_bank: int) -> DeviceBuffer:
        """One interleaved buffer with ``size_per_bank`` bytes in every bank (receive pool)."""

    def free_buffer(self, buf: DeviceBuffer) -> None: ...

    def copy_in_bank(self, bank: int, src_offset: np.ndarray, dst_offset: np.ndarray, nbytes: np.ndarray) -> None:
        """Staged mode's D6-D7: copies inside one bank (byte offsets in the bank)."""

    def read_tiles(self, layout: TTKVCacheLayout, layer: int, kv: int, tiles: np.ndarray):
        """Bytes of tiles of tensor (layer, K=0|V=1): uint8 [len(tiles), tile_nbytes] (checks)."""


@dataclass
class FetchResult:
    """Timings (seconds, monotonic) of one fetch and what moved.

    request_s: D1 -> P7 (includes the prefill's transform); transfer_s: batch submit ->
    done; copy_s: intra-bank copies (staged) or the layout fix (GN-Host); total_s: D1 ->
    KV in the pool; release_s: D8 round trip (not in total_s). nbytes: bytes moved by the
    transport; entries: transfer entries; fraction: share of the entries moved (< 1 only
    when a per-tile run hit its time cap; times are then for that share).
    """

    req_id: str
    mode: str
    nbytes: int = 0
    entries: int = 0
    request_s: float = 0.0
    transfer_s: float = 0.0
    copy_s: float = 0.0
    total_s: float = 0.0
    release_s: float = 0.0
    fraction: float = 1.0
    extra: dict = field(default_factory=dict)


def layout_desc(layout: TTKVCacheLayout, name: str = "tt-paged") -> LayoutDesc:
    s = layout.spec
    return LayoutDesc(name=name, dtype=s.dtype, block_size=s.block_size, num_layers=s.num_layers,
                      num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, num_banks=layout.num_banks,
                      tile_nbytes=s.tile_nbytes, page_nbytes=layout.aligned_page)


def merged_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(addr, nbytes) ranges merged where adjacent or overlapping, sorted."""
    out: list[list[int]] = []
    for a, n in sorted(ranges):
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n - out[-1][0])
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]


class KVPageAddresses:
    """Host virtual addresses of a Tenstorrent KV pool's pages, via the bank-buffer API.

    ``buffers``: the pool's device buffers (K0, V0, K1, ...). Each is mapped with
    ``map_buffer_dma`` unless it already is (those mapped here are unmapped by
    :meth:`close`); a byte at device offset ``o`` of bank ``b`` inside buffer ``buf``
    lives at ``get_buffer_address_bank(buf, b) + (o - buf.address)``. Not for
    concurrent use with another mapper of the same buffers.
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
            self.host = np.array([[device.get_buffer_address_bank(buf, b) for b in range(nb)] for buf in bufs],
                                 dtype=np.int64).reshape(len(bufs), nb)
            self.sizes = np.array([[device.get_buffer_size_bank(buf, b) for b in range(nb)] for buf in bufs],
                                  dtype=np.int64).reshape(len(bufs), nb)
        except BaseException:
            self.close()
            raise

    def regions(self) -> list[tuple[int, int]]:
        """(host address, nbytes) of every buffer's region in every bank."""
        return list(zip(self.host.reshape(-1).tolist(), self.sizes.reshape(-1).tolist()))

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
            raise ValueError(f"KV page op {i} (bank {int(bank[i])}, offset {int(off[i])}, {int(n[i])} bytes) "
                             "lies outside the KV pool's buffers")
        return self.host[kk, bb] + (off - self.starts[kk])

    def close(self) -> None:
        for buf in self._mapped_here:
            try:
                self.device.unmap_buffer_dma(buf)
            except Exception:  # noqa: BLE001 - freed already
                pass
        self._mapped_here = []


def _read_deadline(ready: KVReady, t_ready: float, deadline: float) -> tuple[float, str]:
    """The deadline for reading ``ready``'s ring range: the caller's, capped by the
    prefill's lease (counted from KVReady's arrival, less a margin); and a note for errors."""
    if not ready.lease_ms:
        return deadline, ""
    lease = ready.lease_ms / 1000.0
    margin = min(LEASE_MARGIN_S, lease / 4)
    end = t_ready + lease - margin
    if end >= deadline:
        return deadline, ""
    return end, (f" (read deadline capped by the prefill's lease of {ready.lease_ms} ms less {margin:.2f} s: "
                 "after the lease the prefill frees the ring range and may reuse it)")


class _Client:
    """Shared handshake + release helpers of both decode endpoints.

    ``peer`` / ``export_base`` / ``export_nbytes`` are read from the client's latest
    HelloAck each time: after the prefill restarts, ``ProtocolClient.call`` handshakes
    again and the new ring (and transfer endpoint) apply to the following fetches."""

    client: ProtocolClient

    def _connect(self, endpoint: str, compat: CompatFields, secret, timeout_s: float) -> None:
        self.client = ProtocolClient(endpoint, compat, secret=secret, timeout_s=timeout_s)
        try:
            self.client.handshake(timeout_s)
        except Exception:
            self.client.close()
            raise

    @property
    def hello(self) -> HelloAck:
        return self.client.hello

    @property
    def peer(self) -> str:
        return self.client.hello.transfer_endpoint

    @property
    def export_base(self) -> int:
        return self.client.hello.ring_base_addr

    @property
    def export_nbytes(self) -> int:
        return self.client.hello.ring_nbytes

    def _request(self, msg: KVRequest, timeout: float) -> tuple[KVReady, float, HelloAck]:
        """D1 -> P7: (KVReady, its arrival time, the HelloAck it refers to)."""
        try:
            ready = self.client.request_kv(msg, timeout_s=max(timeout, 1e-3))
        except (ProtocolTimeout, RemoteError) as e:
            # Also cancels a request the prefill is still serving (it frees the range at once).
            self._release_quietly(msg.req_id, ok=False)
            raise PeerFailed(f"request {msg.req_id}: {e}", msg.req_id) from e
        return ready, time.monotonic(), self.client.hello

    def _release_quietly(self, req_id: str, ok: bool, timeout_s: float | None = None) -> None:
        try:
            self.client.release(req_id, ok=ok, timeout_s=RELEASE_TIMEOUT_S if timeout_s is None else timeout_s)
        except Exception as e:  # noqa: BLE001 - the prefill's lease frees it anyway
            logger.debug("release of %s failed: %s", req_id, e)

    def _release_done(self, req_id: str, ready: KVReady, t_ready: float, deadline: float, blocks) -> None:
        """D8 after the KV is in place. A prefill that no longer knows the request
        (``unknown_request``: its lease ran out) may have reused the range mid-read."""
        try:
            self.client.release(req_id, ok=True, timeout_s=max(RELEASE_TIMEOUT_S, deadline - time.monotonic()))
        except RemoteError as e:
            if e.code == "unknown_request":
                age = time.monotonic() - t_ready
                lease = (f"its lease of {ready.lease_ms} ms ran out ({age:.2f} s since KVReady)"
                         if ready.lease_ms else "it dropped the request")
                raise PeerFailed(f"request {req_id}: Release refused ({e}): {lease}, so it may have freed and "
                                 f"reused the ring range while it was being read; the KV in destination blocks "
                                 f"{[int(b) for b in blocks]} may be corrupt", req_id) from e
            raise PeerFailed(f"request {req_id}: KV is in the pool but Release failed: {e}", req_id) from e
        except ProtocolTimeout as e:
            raise PeerFailed(f"request {req_id}: KV is in the pool but Release failed: {e}", req_id) from e

    def _submit(self, peer: str, entries, req_id: str, on_fail=None):
        """Submit one READ batch; on a refused submit free what was taken and Release."""
        try:
            return self.transport.submit("read", peer, entries)
        except Exception:
            if on_fail is not None:
                on_fail()
            self._release_quietly(req_id, ok=False)
            raise

    def _wait(self, h, req_id: str, peer: str, deadline: float, on_fail, note: str = "") -> None:
        """Wait for batch ``h``; on failure ``on_fail(h)`` cleans up and returns the
        destination blocks the batch may still write (empty when settled), then Release."""
        try:
            self.transport.wait(h, max(0.0, deadline - time.monotonic()))
        except (TransferFailed, TransferTimeout) as e:
            unsafe = on_fail(h)
            self._release_quietly(req_id, ok=False)
            msg = f"request {req_id}: transfer from {peer} failed: {e}{note}"
            if unsafe:
                raise TransferUnsettled(f"{msg}; its READs did not drain within {SETTLE_WAIT_S} s and may "
                                        f"still write destination blocks {list(unsafe)}: do not use them",
                                        req_id, unsafe) from e
            raise PeerFailed(msg, req_id) from e

    @staticmethod
    def _settle(h, blocks, settle_end: float) -> tuple[int, ...]:
        """Wait (until ``settle_end``) for a failed batch that targets pages to drain;
        the destination blocks that are unsafe when it did not."""
        if h.settled.wait(max(0.0, settle_end - time.monotonic())):
            return ()
        return tuple(int(b) for b in blocks)


class DecodeEndpoint(_Client):
    """GN-HAWK decode side on a :class:`DecodeDevice` (bank-buffer API + a few extras).

    spec: the KV pool's shape and dtype; transport: started transport; endpoint/compat/
    secret: the prefill's protocol server; recv_nbytes_per_bank: receive-buffer pool
    size (bytes per bank; 0 = none, direct mode only); pool: share another endpoint's
    receive pool instead; register_pool: when to map and register the KV pool with the
    transport for direct/per-tile mode: ``None`` (default) at the first such fetch,
    ``True`` now, ``False`` never (those modes then raise). A registered KV pool is
    exposed to the transport's peers (Mooncake: unauthenticated, all interfaces).
    A failing ``__init__`` leaves nothing allocated, mapped or registered.
    """

    def __init__(self, device: DecodeDevice, spec: TTKVCacheSpec, transport, endpoint: str,
                 compat: CompatFields, *, secret: bytes | None = None, recv_nbytes_per_bank: int = 16 << 20,
                 pool: BankBufferPool | None = None, register_pool: bool | None = None,
                 timeout_s: float = 10.0, layout_name: str = "tt-paged") -> None:
        self.device, self.transport, self.timeout_s = device, transport, timeout_s
        self.register_pool = register_pool
        self.kv_buffers: list[DeviceBuffer] = []
        self.pool: BankBufferPool | None = pool
        self._own_pool = False
        self._pages: KVPageAddresses | None = None
        self._kv_regions: list[int] = []
        self._closed = False
        self._pending_frees = 0
        self.quarantined: list[str] = []  # receive slices whose batch never settled (kept held)
        self._lock = threading.Lock()
        self.client = None  # type: ignore[assignment]
        try:
            self.layout, self.kv_buffers = device.allocate_kv_cache(spec)
            self.desc = layout_desc(self.layout, layout_name)
            if pool is None and recv_nbytes_per_bank > 0:
                self.pool = BankBufferPool(device, recv_nbytes_per_bank, transport)
                self._own_pool = True
            if register_pool:
                self._direct_pages()
            self._connect(endpoint, compat, secret, timeout_s)
        except BaseException:
            self.close()
            raise

    def _direct_pages(self) -> KVPageAddresses:
        """The KV pool mapped and registered (direct / per-tile modes), once."""
        with self._lock:
            if self._pages is not None:
                return self._pages
            if self._closed:
                raise KVFlowError("decode endpoint is closed")
            if self.register_pool is False:
                raise KVFlowError("direct and per-tile modes need the KV pool registered with the transport; "
                                  "this endpoint was built with register_pool=False")
            pages = KVPageAddresses(self.device, self.kv_buffers)
            try:
                for a, n in merged_ranges(pages.regions()):
                    self.transport.register(a, n)
                    self._kv_regions.append(a)
            except BaseException:
                self._unregister_kv_locked()
                pages.close()
                raise
            self._pages = pages
            return pages

    def _unregister_kv_locked(self) -> None:
        for a in self._kv_regions:
            try:
                self.transport.unregister(a)
            except Exception:  # noqa: BLE001
                pass
        self._kv_regions = []

    # ------------------------------------------------------------------ Algorithm 1, decode side
    def fetch(self, req_id: str, num_tokens: int, dst_blocks, mode: str = "staged", *,
              timeout_s: float | None = None, release: bool = True, time_cap_s: float | None = None) -> FetchResult:
        """Move request ``req_id``'s KV into KV-pool blocks ``dst_blocks`` (ids into dim 0).

        Returns when the KV is in the pool (and, with ``release``, the prefill freed its
        range). Raises :class:`PeerFailed` / :class:`BufferFull` with nothing left held
        (:class:`TransferUnsettled` when a direct/per-tile batch did not drain: see the
        module doc for the time bounds)."""
        if mode not in FETCH_MODES:
            raise ValueError(f"fetch mode must be one of {FETCH_MODES}, got {mode!r}")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        deadline = t0 + timeout
        dst = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
        bs = self.layout.spec.block_size
        if dst.size != -(-num_tokens // bs):
            raise ValueError(f"fetch {req_id}: {dst.size} destination blocks for {num_tokens} tokens "
                             f"of block size {bs}")
        plan = make_plan(self.layout, dst, "staged" if mode == "staged" else "direct")
        if mode != "staged":
            self._direct_pages()  # before D1: nothing to undo if the KV pool cannot be registered
        res = FetchResult(req_id, mode)
        msg = KVRequest(req_id=req_id, dst_layout=self.desc, num_tokens=num_tokens,
                        dst_block_ids=[int(b) for b in dst], deadline_ms=int((time.time() + timeout) * 1000))
        ready, t1, hello = self._request(msg, deadline - time.monotonic())  # D1 -> P7
        res.request_s = t1 - t0
        rdeadline, note = _read_deadline(ready, t1, deadline)
        peer = hello.transfer_endpoint
        try:
            self._check_ready(ready, plan, hello)
            recv, entries = self._entries(req_id, ready, plan, mode, rdeadline, hello)
        except (KVFlowError, ValueError) as e:
            self._release_quietly(req_id, ok=False)
            if isinstance(e, BufferFull) and note and time.monotonic() >= rdeadline:
                raise BufferFull(f"{e}{note}", req_id) from e
            raise
        res.entries, res.nbytes = len(entries), sum(e[2] for e in entries)

        def on_fail(h):  # a failed batch: nothing may write our memory once we return
            if recv is not None:  # receive buffers: freed once settled, in the background if late
                self._free_when_settled(h, req_id, deadline)
                return ()
            return self._settle(h, dst, time.monotonic() + SETTLE_WAIT_S)  # KV pages

        def free_recv():
            if recv is not None:
                self.pool.release(req_id)

        t2 = time.monotonic()
        if mode == "per_tile" and time_cap_s is not None:
            done = 0
            chunk = 4096
            while done < len(entries):
                h = self._submit(peer, entries[done:done + chunk], req_id)
                self._wait(h, req_id, peer, rdeadline, on_fail, note)
                done += min(chunk, len(entries) - done)
                if time.monotonic() - t2 > time_cap_s:
                    break
            res.fraction = done / len(entries)
        else:
            h = self._submit(peer, entries, req_id, free_recv)  # ONE batch of READs
            self._wait(h, req_id, peer, rdeadline, on_fail, note)
        t3 = time.monotonic()
        res.transfer_s = t3 - t2
        if recv is not None:  # D6-D7: intra-bank copies into the KV pages
            try:
                self._copy_in(plan, recv)
            finally:
                self.pool.release(req_id)
        t4 = time.monotonic()
        res.copy_s, res.total_s = t4 - t3, t4 - t0
        if release:  # D8
            self._release_done(req_id, ready, t1, deadline, dst)
            res.release_s = time.monotonic() - t4
        return res

    def _entries(self, req_id: str, ready: KVReady, plan, mode: str, deadline: float, hello: HelloAck):
        """D2-D5: (receive slice or None, [(local, remote, nbytes)]) for one checked KVReady."""
        base = hello.ring_base_addr
        if mode == "staged":  # pair each segment with its bank's receive buffer
            if self.pool is None:
                raise KVFlowError("staged mode needs a receive-buffer pool", req_id)
            recv = self.pool.acquire(req_id, plan.recv_nbytes_per_bank, max(0.0, deadline - time.monotonic()))
            return recv, [(recv.addr(s.bank), base + s.offset_bytes, s.nbytes) for s in ready.segments]
        ops = plan.rdma if mode == "direct" else plan.per_tile_ops()
        local = self._direct_pages().addresses(ops.bank, ops.dst_offset, ops.nbytes).tolist()
        remote = (base + ready.ring_offset + ops.src_offset).tolist()
        return None, list(zip(local, remote, ops.nbytes.tolist()))

    def _copy_in(self, plan, recv) -> None:
        """D6-D7: intra-bank copies from the receive slice into the KV pages."""
        for b in range(self.layout.num_banks):
            o = plan.intra_bank.for_bank(b)
            if len(o):
                self.device.copy_in_bank(b, o.src_offset + recv.device_offset, o.dst_offset, o.nbytes)

    def fetch_pipelined(self, chunks, mode: str = "staged", *, timeout_s: float | None = None,
                        release: bool = True) -> FetchResult:
        """Overlap the prefill's transform of chunk i+1 with the transfer of chunk i.

        ``chunks``: [(req_id, num_tokens, dst_blocks)], each a request the prefill
        registered on its own (consecutive token ranges of one sequence). Every chunk is
        planned (and checked) before any D1 goes out; then all D1s go out at once, the
        prefill transforms them in order, and each chunk's READ batch is submitted as
        soon as its KVReady arrives. Same cleanup guarantees as ``fetch``."""
        if mode not in ("staged", "direct"):
            raise ValueError(f"pipelined mode must be staged or direct, got {mode!r}")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        deadline = t0 + timeout
        bs = self.layout.spec.block_size
        chunks = [(rid, int(n), np.asarray(dst, dtype=np.int64).reshape(-1)) for rid, n, dst in chunks]
        if not chunks or len({c[0] for c in chunks}) != len(chunks):
            raise ValueError("pipelined fetch needs at least one chunk and distinct request ids")
        plans = []
        for rid, n, dst in chunks:
            if dst.size != -(-n // bs):
                raise ValueError(f"fetch {rid}: {dst.size} destination blocks for {n} tokens of block size {bs}")
            plans.append(make_plan(self.layout, dst, mode))
        all_dst = np.concatenate([c[2] for c in chunks])
        if np.unique(all_dst).size != all_dst.size:
            raise ValueError("pipelined fetch: the chunks' destination blocks must be distinct")
        if mode == "direct":
            self._direct_pages()
        res = FetchResult(",".join(c[0] for c in chunks), f"{mode}-pipelined")
        sent: list[str] = []
        futs = []
        started: list[_Started] = []
        try:
            for rid, n, dst in chunks:
                futs.append(self.client.call_async(KVRequest(
                    req_id=rid, dst_layout=self.desc, num_tokens=n, dst_block_ids=[int(b) for b in dst],
                    deadline_ms=int((time.time() + timeout) * 1000))))
                sent.append(rid)
            for (rid, _n, dst), plan, fut in zip(chunks, plans, futs):
                try:
                    ready = fut.result(max(1e-3, deadline - time.monotonic()))
                except Exception as e:  # noqa: BLE001 - timeout or cancelled
                    raise PeerFailed(f"request {rid}: no KVReady in time ({type(e).__name__})", rid) from e
                if not isinstance(ready, KVReady) or ready.req_id != rid:
                    raise PeerFailed(f"request {rid}: prefill answered {ready!r:.300}", rid)
                t_ready, hello = time.monotonic(), self.client.hello
                if not res.request_s:
                    res.request_s = t_ready - t0  # first KVReady
                rdeadline, note = _read_deadline(ready, t_ready, deadline)
                self._check_ready(ready, plan, hello)
                recv, entries = self._entries(rid, ready, plan, mode, rdeadline, hello)
                try:
                    h = self.transport.submit("read", hello.transfer_endpoint, entries)
                except Exception:
                    if recv is not None:
                        self.pool.release(rid)
                    raise
                started.append(_Started(rid, dst, plan, recv, h, ready, t_ready, rdeadline, note))
                res.entries += len(entries)
                res.nbytes += sum(e[2] for e in entries)
            for c in started:
                try:
                    self.transport.wait(c.handle, max(0.0, c.read_deadline - time.monotonic()))
                except (TransferFailed, TransferTimeout) as e:
                    raise PeerFailed(f"request {c.rid}: transfer failed: {e}{c.note}", c.rid) from e
        except Exception as e:
            settle_end = time.monotonic() + SETTLE_WAIT_S
            unsafe: list[int] = []
            for c in started:
                if c.recv is not None:
                    self._free_when_settled(c.handle, c.rid, deadline)
                else:
                    unsafe += self._settle(c.handle, c.dst, settle_end)
            for f in futs:
                f.cancel()
            for rid in sent:  # also cancels chunks the prefill is still serving
                self._release_quietly(rid, ok=False)
            if unsafe:
                raise TransferUnsettled(f"pipelined fetch {res.req_id}: {e}; READs did not drain within "
                                        f"{SETTLE_WAIT_S} s and may still write destination blocks {unsafe}: "
                                        "do not use them", chunks[0][0], tuple(unsafe)) from e
            if isinstance(e, KVFlowError):
                raise
            raise PeerFailed(f"pipelined fetch {res.req_id}: {e}", chunks[0][0]) from e
        t3 = time.monotonic()
        res.transfer_s = t3 - t0 - res.request_s  # first KVReady -> last batch done
        try:
            for c in started:
                if c.recv is not None:
                    self._copy_in(c.plan, c.recv)
        finally:
            for c in started:
                if c.recv is not None:
                    self.pool.release(c.rid)
        t4 = time.monotonic()
        res.copy_s, res.total_s = t4 - t3, t4 - t0
        if release:
            for c in started:
                self._release_done(c.rid, c.ready, c.t_ready, deadline, c.dst)
            res.release_s = time.monotonic() - t4
        return res

    def _check_ready(self, ready: KVReady, plan, hello: HelloAck) -> None:
        """The prefill's segments must be exactly our plan's: one per non-empty bank, in
        bank order, contiguous from ``ring_offset``, inside the registered ring."""
        want = [(int(b), ready.ring_offset + int(plan.segment_offset[b]), int(plan.segment_nbytes[b]))
                for b in range(self.layout.num_banks) if plan.segment_nbytes[b]]
        got = [(s.bank, s.offset_bytes, s.nbytes) for s in ready.segments]
        if got != want or ready.total_nbytes != plan.total_nbytes:
            raise PeerFailed(f"request {ready.req_id}: KVReady segments do not match the transfer plan "
                             f"(got {got[:3]}..., want {want[:3]}...)", ready.req_id)
        if ready.ring_offset + ready.total_nbytes > hello.ring_nbytes:
            raise PeerFailed(f"request {ready.req_id}: KVReady range lies outside the registered ring",
                             ready.req_id)

    def _free_when_settled(self, h, req_id: str, deadline: float) -> None:
        """Free a request's receive buffers once no entry of ``h`` can still write them.

        Waits at most until ``deadline`` (and :data:`SETTLE_WAIT_S`) here; then a
        background thread waits up to :data:`SETTLE_LIMIT_S` more. A batch that never
        settles leaves its slice held for good (``quarantined``): reusing it could let a
        late READ overwrite another request's bytes."""
        if h.settled.wait(min(SETTLE_WAIT_S, max(0.0, deadline - time.monotonic()))):
            self.pool.release(req_id)
            return
        limit = SETTLE_LIMIT_S
        with self._lock:
            self._pending_frees += 1

        def later():
            try:
                if h.settled.wait(limit):
                    self.pool.release(req_id)
                else:
                    logger.error("request %s: its READ batch did not settle within %.1f s; its receive "
                                 "buffers stay held (quarantined)", req_id, limit)
                    with self._lock:
                        self.quarantined.append(req_id)
            finally:
                with self._lock:
                    self._pending_frees -= 1

        threading.Thread(target=later, daemon=True, name=f"hawk-free-{req_id}").start()

    def pending_frees(self) -> int:
        """Receive slices waiting (in the background) for their batch to settle."""
        with self._lock:
            return self._pending_frees

    def read_blocks(self, layer: int, kv: int, blocks) -> "np.ndarray":
        """Bytes of whole KV-pool blocks of tensor (layer, K=0|V=1): uint8 [tiles, tile_nbytes]."""
        return self.device.read_tiles(self.layout, layer, kv, self.layout.block_tiles(blocks))

    def close(self) -> None:
        """Free everything; safe on a partly constructed endpoint."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pages, self._pages = self._pages, None
            self._unregister_kv_locked()
        if self.client is not None:
            self.client.close()
        if pages is not None:
            pages.close()
        if self._own_pool and self.pool is not None:
            self.pool.close()
        for buf in self.kv_buffers:
            self.device.free_buffer(buf)
        self.kv_buffers = []


@dataclass
class _Started:
    """One pipelined chunk whose READ batch is in flight."""

    rid: str
    dst: np.ndarray
    plan: object
    recv: object
    handle: object
    ready: KVReady
    t_ready: float
    read_deadline: float
    note: str


class VllmDecodeEndpoint(_Client):
    """Baseline decode side: a vLLM-layout cache (bytes arrive unchanged, block runs coalesced).

    The prefill must serve in mode ``"vllm"`` with the same model shapes and block size.
    ``fetch(..., fix=(device, layout, kv_buffers, tt_dst_blocks))`` adds GN-Host's layout
    fix: after arrival the received blocks are tilized/packed (the HAWK transform, run on
    the decode side) and written into the device's KV pool (``kv_buffers``, K0, V0, K1,
    ...) at ``tt_dst_blocks``, at host addresses from the bank-buffer API.
    """

    def __init__(self, cache: PagedKVCache, transport, endpoint: str, compat: CompatFields, *,
                 secret: bytes | None = None, timeout_s: float = 10.0) -> None:
        self.cache, self.transport, self.timeout_s = cache, transport, timeout_s
        transport.register(cache.base_addr, cache.nbytes)
        self._closed = False
        self.desc = LayoutDesc(name=LAYOUT_NAME, dtype=str(cache.dtype).removeprefix("torch."),
                               block_size=cache.block_size, num_layers=cache.num_layers,
                               num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, num_banks=1,
                               tile_nbytes=cache.block_nbytes, page_nbytes=cache.block_nbytes)
        try:
            self._connect(endpoint, compat, secret, timeout_s)
        except BaseException:
            transport.unregister(cache.base_addr)
            raise

    @property
    def src_layer_nbytes(self) -> int:
        """Bytes of one layer of the prefill's exported cache (from the latest HelloAck)."""
        return self.export_nbytes // self.cache.num_layers

    def fetch(self, req_id: str, num_tokens: int, dst_blocks, *, timeout_s: float | None = None,
              release: bool = True, fix: tuple | None = None) -> FetchResult:
        """Read the request's blocks into this cache's ``dst_blocks``; ``fix=(device,
        TTKVCacheLayout, kv_buffers, tt_dst_blocks)`` also runs GN-Host's layout fix."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        deadline = t0 + timeout
        c = self.cache
        dst = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
        if dst.size != -(-num_tokens // c.block_size):
            raise ValueError(f"fetch {req_id}: {dst.size} blocks for {num_tokens} tokens")
        if fix is not None and len(fix) != 4:
            raise ValueError("fix must be (device, TTKVCacheLayout, kv_buffers, tt_dst_blocks)")
        res = FetchResult(req_id, "vllm" if fix is None else "vllm+fix")
        msg = KVRequest(req_id=req_id, dst_layout=self.desc, num_tokens=num_tokens,
                        dst_block_ids=[int(b) for b in dst], deadline_ms=int((time.time() + timeout) * 1000))
        ready, t1, hello = self._request(msg, deadline - time.monotonic())
        res.request_s = t1 - t0
        rdeadline, note = _read_deadline(ready, t1, deadline)
        base, layer_nbytes, peer = hello.ring_base_addr, hello.ring_nbytes // c.num_layers, hello.transfer_endpoint
        entries = []
        try:
            pos = 0
            for s in ready.segments:  # block runs of the source, layer 0, in token order
                if s.offset_bytes % c.block_nbytes or s.nbytes % c.block_nbytes:
                    raise PeerFailed(f"request {req_id}: segment not on block boundaries", req_id)
                n = s.nbytes // c.block_nbytes
                if pos + n > dst.size or s.offset_bytes + s.nbytes > layer_nbytes:
                    raise PeerFailed(f"request {req_id}: segments exceed the request or the layer", req_id)
                for p, first, k in block_runs(dst[pos:pos + n]):  # split where dst is not consecutive
                    src_off = s.offset_bytes + p * c.block_nbytes
                    for layer in range(c.num_layers):
                        entries.append((c.base_addr + c.block_offset(layer, first),
                                        base + layer * layer_nbytes + src_off, k * c.block_nbytes))
                pos += n
            if pos != dst.size:
                raise PeerFailed(f"request {req_id}: {pos} source blocks for {dst.size} destination blocks", req_id)
        except PeerFailed:
            self._release_quietly(req_id, ok=False)
            raise
        res.entries, res.nbytes = len(entries), sum(e[2] for e in entries)
        t2 = time.monotonic()
        h = self._submit(peer, entries, req_id)
        # The READs write this cache's pages: a failed batch must drain before we return.
        self._wait(h, req_id, peer, rdeadline, lambda h_: self._settle(h_, dst, time.monotonic() + SETTLE_WAIT_S),
                   note)
        t3 = time.monotonic()
        res.transfer_s = t3 - t2
        if fix is not None:  # GN-Host: layout fix after arrival, then into the device's pool
            device, layout, kv_buffers, tt_blocks = fix
            plan = make_plan(layout, tt_blocks, "direct")
            g = transform_kv(c.kv_views(), dst, c.block_size, plan)
            t_tf = time.monotonic()
            gaddr = g.data_ptr()
            ops = plan.rdma
            pages = KVPageAddresses(device, kv_buffers)
            try:
                local = pages.addresses(ops.bank, ops.dst_offset, ops.nbytes).tolist()
                for s_, d_, n_ in zip(ops.src_offset.tolist(), local, ops.nbytes.tolist()):
                    ctypes.memmove(d_, gaddr + s_, n_)
            finally:
                pages.close()
            res.extra = {"fix_transform_s": t_tf - t3, "fix_write_s": time.monotonic() - t_tf}
        t4 = time.monotonic()
        res.copy_s, res.total_s = t4 - t3, t4 - t0
        if release:
            self._release_done(req_id, ready, t1, deadline, dst)
            res.release_s = time.monotonic() - t4
        return res

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.client.close()
        try:
            self.transport.unregister(self.cache.base_addr)
        except Exception:  # noqa: BLE001
            pass
