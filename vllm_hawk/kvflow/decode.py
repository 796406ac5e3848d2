"""The decode endpoints of Algorithm 1 (D1-D8), independent of vLLM.

:class:`DecodeEndpoint` (GN-HAWK) owns a Tenstorrent paged KV pool on a device that
implements the bank-buffer API (the emulated p150a here), a pool of per-bank receive
buffers (:class:`BankBufferPool`), a transport and a protocol client. ``fetch``:

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

On any failure (prefill refuses, dies, or misses the deadline) ``fetch`` raises
:class:`PeerFailed` within its deadline and frees everything it took (receive buffers
once the transport has settled the batch, i.e. no entry can still write them).

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

import numpy as np

from vllm_hawk.kvflow.bank_pool import BankBufferPool
from vllm_hawk.kvflow.errors import BufferFull, KVFlowError, PeerFailed
from vllm_hawk.kvflow.paged_cache import LAYOUT_NAME, PagedKVCache, block_runs
from vllm_hawk.layout.tt_kv_cache import TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.protocol import (CompatFields, KVReady, KVRequest, LayoutDesc, ProtocolClient,
                                ProtocolTimeout, RemoteError)
from vllm_hawk.transform import make_plan, transform_kv
from vllm_hawk.transport import TransferFailed, TransferTimeout

logger = logging.getLogger(__name__)

FETCH_MODES = ("staged", "direct", "per_tile")


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


class _Client:
    """Shared handshake + release helpers of both decode endpoints."""

    client: ProtocolClient

    def _connect(self, endpoint: str, compat: CompatFields, secret, timeout_s: float) -> None:
        self.client = ProtocolClient(endpoint, compat, secret=secret, timeout_s=timeout_s)
        try:
            hello = self.client.handshake(timeout_s)
        except Exception:
            self.client.close()
            raise
        self.peer = hello.transfer_endpoint
        self.export_base, self.export_nbytes = hello.ring_base_addr, hello.ring_nbytes

    def _request(self, msg: KVRequest, timeout: float) -> KVReady:
        try:
            return self.client.request_kv(msg, timeout_s=max(timeout, 1e-3))
        except (ProtocolTimeout, RemoteError) as e:
            self._release_quietly(msg.req_id, ok=False, timeout_s=0.5)
            raise PeerFailed(f"request {msg.req_id}: {e}", msg.req_id) from e

    def _release_quietly(self, req_id: str, ok: bool, timeout_s: float) -> None:
        try:
            self.client.release(req_id, ok=ok, timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001 - the prefill's lease frees it anyway
            logger.debug("release of %s failed: %s", req_id, e)

    def _wait(self, h, req_id: str, deadline: float, on_fail) -> None:
        try:
            self.transport.wait(h, max(0.0, deadline - time.monotonic()))
        except (TransferFailed, TransferTimeout) as e:
            on_fail()
            self._release_quietly(req_id, ok=False, timeout_s=0.5)
            raise PeerFailed(f"request {req_id}: transfer from {self.peer} failed: {e}", req_id) from e


class DecodeEndpoint(_Client):
    """GN-HAWK decode side. ``device`` implements the bank-buffer API and ``allocate_kv_cache``.

    spec: the KV pool's shape and dtype; transport: started transport; endpoint/compat/
    secret: the prefill's protocol server; recv_nbytes_per_bank: receive-buffer pool
    size (bytes per bank; 0 = none, direct mode only); pool: share another endpoint's
    receive pool instead; register_pool: map and register the KV pool for direct mode.
    """

    def __init__(self, device, spec: TTKVCacheSpec, transport, endpoint: str, compat: CompatFields, *,
                 secret: bytes | None = None, recv_nbytes_per_bank: int = 16 << 20,
                 pool: BankBufferPool | None = None, register_pool: bool = True,
                 timeout_s: float = 10.0, layout_name: str = "tt-paged") -> None:
        self.device, self.transport, self.timeout_s = device, transport, timeout_s
        self.layout, self.kv_buffers = device.allocate_kv_cache(spec)
        self.desc = layout_desc(self.layout, layout_name)
        self._own_pool = pool is None and recv_nbytes_per_bank > 0
        self.pool = pool if pool is not None else (
            BankBufferPool(device, recv_nbytes_per_bank, transport) if recv_nbytes_per_bank else None)
        self._kv_regions: list[int] = []
        self._mapped: list = []
        self._closed = False
        self._pending_frees = 0
        self._lock = threading.Lock()
        try:
            if register_pool:
                ranges = []
                for buf in self.kv_buffers:
                    device.map_buffer_dma(buf)
                    self._mapped.append(buf)
                    ranges += [(device.get_buffer_address_bank(buf, b), device.get_buffer_size_bank(buf, b))
                               for b in range(device.get_device_num_bank())]
                for a, n in merged_ranges(ranges):
                    transport.register(a, n)
                    self._kv_regions.append(a)
            self._connect(endpoint, compat, secret, timeout_s)
        except Exception:
            self.close()
            raise

    # ------------------------------------------------------------------ Algorithm 1, decode side
    def fetch(self, req_id: str, num_tokens: int, dst_blocks, mode: str = "staged", *,
              timeout_s: float | None = None, release: bool = True, time_cap_s: float | None = None) -> FetchResult:
        """Move request ``req_id``'s KV into KV-pool blocks ``dst_blocks`` (ids into dim 0).

        Returns when the KV is in the pool (and, with ``release``, the prefill freed its
        range). Raises :class:`PeerFailed` / :class:`BufferFull` with nothing left held."""
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
        res = FetchResult(req_id, mode)
        msg = KVRequest(req_id=req_id, dst_layout=self.desc, num_tokens=num_tokens,
                        dst_block_ids=[int(b) for b in dst], deadline_ms=int((time.time() + timeout) * 1000))
        ready = self._request(msg, deadline - time.monotonic())  # D1 -> P7
        t1 = time.monotonic()
        res.request_s = t1 - t0
        try:
            self._check_ready(ready, plan)
        except KVFlowError:
            self._release_quietly(req_id, ok=False, timeout_s=0.5)
            raise
        try:
            recv, entries = self._entries(req_id, ready, plan, mode, deadline)
        except BufferFull:
            self._release_quietly(req_id, ok=False, timeout_s=0.5)
            raise
        res.entries, res.nbytes = len(entries), sum(e[2] for e in entries)

        def free_recv():
            if recv is not None:
                self._free_when_settled(h, req_id)

        t2 = time.monotonic()
        if mode == "per_tile" and time_cap_s is not None:
            done = 0
            chunk = 4096
            while done < len(entries):
                h = self.transport.submit("read", self.peer, entries[done:done + chunk])
                self._wait(h, req_id, deadline, free_recv)
                done += min(chunk, len(entries) - done)
                if time.monotonic() - t2 > time_cap_s:
                    break
            res.fraction = done / len(entries)
        else:
            try:
                h = self.transport.submit("read", self.peer, entries)  # ONE batch of READs
            except Exception:
                if recv is not None:
                    self.pool.release(req_id)
                self._release_quietly(req_id, ok=False, timeout_s=0.5)
                raise
            self._wait(h, req_id, deadline, free_recv)
        t3 = time.monotonic()
        res.transfer_s = t3 - t2
        if recv is not None:  # D6-D7: intra-bank copies into the KV pages
            self._copy_in(plan, recv)
            self.pool.release(req_id)
        t4 = time.monotonic()
        res.copy_s, res.total_s = t4 - t3, t4 - t0
        if release:  # D8
            try:
                self.client.release(req_id, ok=True, timeout_s=max(0.5, deadline - time.monotonic()))
            except (ProtocolTimeout, RemoteError) as e:
                raise PeerFailed(f"request {req_id}: KV is in the pool but Release failed: {e}", req_id) from e
            res.release_s = time.monotonic() - t4
        return res

    def _entries(self, req_id: str, ready: KVReady, plan, mode: str, deadline: float):
        """D2-D5: (receive slice or None, [(local, remote, nbytes)]) for one checked KVReady."""
        if mode == "staged":  # pair each segment with its bank's receive buffer
            if self.pool is None:
                raise KVFlowError("staged mode needs a receive-buffer pool", req_id)
            recv = self.pool.acquire(req_id, plan.recv_nbytes_per_bank, max(0.0, deadline - time.monotonic()))
            return recv, [(recv.addr(s.bank), self.export_base + s.offset_bytes, s.nbytes) for s in ready.segments]
        ops = plan.rdma if mode == "direct" else plan.per_tile_ops()
        bank_base = np.array([self.device.bank_address(b) for b in range(self.layout.num_banks)], dtype=np.int64)
        local = (bank_base[ops.bank] + ops.dst_offset).tolist()
        remote = (self.export_base + ready.ring_offset + ops.src_offset).tolist()
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
        registered on its own (consecutive token ranges of one sequence). All D1s go out
        at once; the prefill transforms them in order, and each chunk's READ batch is
        submitted as soon as its KVReady arrives. Same cleanup guarantees as ``fetch``."""
        if mode not in ("staged", "direct"):
            raise ValueError(f"pipelined mode must be staged or direct, got {mode!r}")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        deadline = t0 + timeout
        plans, futs = [], []
        for rid, n, dst in chunks:
            dst = np.asarray(dst, dtype=np.int64).reshape(-1)
            plans.append(make_plan(self.layout, dst, mode))
            futs.append(self.client.call_async(KVRequest(
                req_id=rid, dst_layout=self.desc, num_tokens=int(n), dst_block_ids=[int(b) for b in dst],
                deadline_ms=int((time.time() + timeout) * 1000))))
        res = FetchResult(",".join(c[0] for c in chunks), f"{mode}-pipelined")
        started: list = []  # (rid, plan, recv, handle)
        try:
            for (rid, _n, _d), plan, fut in zip(chunks, plans, futs):
                try:
                    ready = fut.result(max(1e-3, deadline - time.monotonic()))
                except Exception as e:  # noqa: BLE001 - timeout or cancelled
                    raise PeerFailed(f"request {rid}: no KVReady in time ({type(e).__name__})", rid) from e
                if not isinstance(ready, KVReady) or ready.req_id != rid:
                    raise PeerFailed(f"request {rid}: prefill answered {ready!r:.300}", rid)
                if not res.request_s:
                    res.request_s = time.monotonic() - t0  # first KVReady
                self._check_ready(ready, plan)
                recv, entries = self._entries(rid, ready, plan, mode, deadline)
                try:
                    h = self.transport.submit("read", self.peer, entries)
                except Exception:
                    if recv is not None:
                        self.pool.release(rid)
                    raise
                started.append((rid, plan, recv, h))
                res.entries += len(entries)
                res.nbytes += sum(e[2] for e in entries)
            for rid, _p, _r, h in started:
                self.transport.wait(h, max(0.0, deadline - time.monotonic()))
        except Exception as e:
            for rid, _p, recv, h in started:
                if recv is not None:
                    self._free_when_settled(h, rid)
            for f in futs:
                f.cancel()
            for rid, _n, _d in chunks:
                self._release_quietly(rid, ok=False, timeout_s=0.5)
            if isinstance(e, KVFlowError):
                raise
            raise PeerFailed(f"pipelined fetch {res.req_id}: {e}", chunks[0][0]) from e
        t3 = time.monotonic()
        res.transfer_s = t3 - t0 - res.request_s  # first KVReady -> last batch done
        for rid, plan, recv, _h in started:
            if recv is not None:
                self._copy_in(plan, recv)
                self.pool.release(rid)
        t4 = time.monotonic()
        res.copy_s, res.total_s = t4 - t3, t4 - t0
        if release:
            for rid, _n, _d in chunks:
                try:
                    self.client.release(rid, ok=True, timeout_s=max(0.5, deadline - time.monotonic()))
                except (ProtocolTimeout, RemoteError) as e:
                    raise PeerFailed(f"request {rid}: KV is in the pool but Release failed: {e}", rid) from e
            res.release_s = time.monotonic() - t4
        return res

    def _check_ready(self, ready: KVReady, plan) -> None:
        """The prefill's segments must be exactly our plan's: one per non-empty bank, in
        bank order, contiguous from ``ring_offset``, inside the registered ring."""
        want = [(int(b), ready.ring_offset + int(plan.segment_offset[b]), int(plan.segment_nbytes[b]))
                for b in range(self.layout.num_banks) if plan.segment_nbytes[b]]
        got = [(s.bank, s.offset_bytes, s.nbytes) for s in ready.segments]
        if got != want or ready.total_nbytes != plan.total_nbytes:
            raise PeerFailed(f"request {ready.req_id}: KVReady segments do not match the transfer plan "
                             f"(got {got[:3]}..., want {want[:3]}...)", ready.req_id)
        if ready.ring_offset + ready.total_nbytes > self.export_nbytes:
            raise PeerFailed(f"request {ready.req_id}: KVReady range lies outside the registered ring",
                             ready.req_id)

    def _free_when_settled(self, h, req_id: str) -> None:
        """Free a request's receive buffers once no entry of ``h`` can still write them."""
        if h.settled.wait(1.0):
            self.pool.release(req_id)
            return
        with self._lock:
            self._pending_frees += 1

        def later():
            h.settled.wait()
            self.pool.release(req_id)
            with self._lock:
                self._pending_frees -= 1

        threading.Thread(target=later, daemon=True, name=f"hawk-free-{req_id}").start()

    def read_blocks(self, layer: int, kv: int, blocks) -> "np.ndarray":
        """Bytes of whole KV-pool blocks of tensor (layer, K=0|V=1): uint8 [tiles, tile_nbytes]."""
        return self.device.read_tiles(self.layout, layer, kv, self.layout.block_tiles(blocks))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if getattr(self, "client", None) is not None:
            self.client.close()
        for a in self._kv_regions:
            try:
                self.transport.unregister(a)
            except Exception:  # noqa: BLE001
                pass
        for buf in self._mapped:
            self.device.unmap_buffer_dma(buf)
        if self._own_pool and self.pool is not None:
            self.pool.close()
        for buf in self.kv_buffers:
            self.device.free_buffer(buf)
        self.kv_buffers = []


class VllmDecodeEndpoint(_Client):
    """Baseline decode side: a vLLM-layout cache (bytes arrive unchanged, block runs coalesced).

    The prefill must serve in mode ``"vllm"`` with the same model shapes and block size.
    ``fetch(..., fix=(device, layout))`` adds GN-Host's layout fix: after arrival the
    received blocks are tilized/packed (the HAWK transform, run on the decode side) and
    written into the device's KV pool at ``dst_blocks``.
    """

    def __init__(self, cache: PagedKVCache, transport, endpoint: str, compat: CompatFields, *,
                 secret: bytes | None = None, timeout_s: float = 10.0) -> None:
        self.cache, self.transport, self.timeout_s = cache, transport, timeout_s
        transport.register(cache.base_addr, cache.nbytes)
        self._closed = False
        self.desc = LayoutDesc(name=LAYOUT_NAME, dtype="bfloat16", block_size=cache.block_size,
                               num_layers=cache.num_layers, num_kv_heads=cache.num_kv_heads,
                               head_dim=cache.head_dim, num_banks=1, tile_nbytes=cache.block_nbytes,
                               page_nbytes=cache.block_nbytes)
        try:
            self._connect(endpoint, compat, secret, timeout_s)
        except Exception:
            transport.unregister(cache.base_addr)
            raise
        self.src_layer_nbytes = self.export_nbytes // cache.num_layers

    def fetch(self, req_id: str, num_tokens: int, dst_blocks, *, timeout_s: float | None = None,
              release: bool = True, fix: tuple | None = None) -> FetchResult:
        """Read the request's blocks into this cache's ``dst_blocks``; ``fix=(device,
        TTKVCacheLayout, tt_dst_blocks)`` also runs GN-Host's layout fix."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        deadline = t0 + timeout
        c = self.cache
        dst = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
        if dst.size != -(-num_tokens // c.block_size):
            raise ValueError(f"fetch {req_id}: {dst.size} blocks for {num_tokens} tokens")
        res = FetchResult(req_id, "vllm" if fix is None else "vllm+fix")
        msg = KVRequest(req_id=req_id, dst_layout=self.desc, num_tokens=num_tokens,
                        dst_block_ids=[int(b) for b in dst], deadline_ms=int((time.time() + timeout) * 1000))
        ready = self._request(msg, deadline - time.monotonic())
        t1 = time.monotonic()
        res.request_s = t1 - t0
        entries = []
        try:
            pos = 0
            for s in ready.segments:  # block runs of the source, layer 0, in token order
                if s.offset_bytes % c.block_nbytes or s.nbytes % c.block_nbytes:
                    raise PeerFailed(f"request {req_id}: segment not on block boundaries", req_id)
                n = s.nbytes // c.block_nbytes
                if pos + n > dst.size or s.offset_bytes + s.nbytes > self.src_layer_nbytes:
                    raise PeerFailed(f"request {req_id}: segments exceed the request or the layer", req_id)
                for p, first, k in block_runs(dst[pos:pos + n]):  # split where dst is not consecutive
                    src_off = s.offset_bytes + p * c.block_nbytes
                    for layer in range(c.num_layers):
                        entries.append((c.base_addr + c.block_offset(layer, first),
                                        self.export_base + layer * self.src_layer_nbytes + src_off,
                                        k * c.block_nbytes))
                pos += n
            if pos != dst.size:
                raise PeerFailed(f"request {req_id}: {pos} source blocks for {dst.size} destination blocks", req_id)
        except PeerFailed:
            self._release_quietly(req_id, ok=False, timeout_s=0.5)
            raise
        res.entries, res.nbytes = len(entries), sum(e[2] for e in entries)
        t2 = time.monotonic()
        h = self.transport.submit("read", self.peer, entries)
        self._wait(h, req_id, deadline, lambda: None)
        t3 = time.monotonic()
        res.transfer_s = t3 - t2
        if fix is not None:  # GN-Host: layout fix after arrival, then into the device's pool
            device, layout, tt_blocks = fix
            plan = make_plan(layout, tt_blocks, "direct")
            g = transform_kv(c.kv_views(), dst, c.block_size, plan)
            t_tf = time.monotonic()
            gaddr = g.data_ptr()
            bank_base = [device.bank_address(b) for b in range(layout.num_banks)]
            ops = plan.rdma
            for s_, b_, d_, n_ in zip(ops.src_offset.tolist(), ops.bank.tolist(), ops.dst_offset.tolist(),
                                      ops.nbytes.tolist()):
                ctypes.memmove(bank_base[b_] + d_, gaddr + s_, n_)
            res.extra = {"fix_transform_s": t_tf - t3, "fix_write_s": time.monotonic() - t_tf}
        t4 = time.monotonic()
        res.copy_s, res.total_s = t4 - t3, t4 - t0
        if release:
            try:
                self.client.release(req_id, ok=True, timeout_s=max(0.5, deadline - time.monotonic()))
            except (ProtocolTimeout, RemoteError) as e:
                raise PeerFailed(f"request {req_id}: Release failed: {e}", req_id) from e
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
