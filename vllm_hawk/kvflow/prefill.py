"""The prefill endpoint of Algorithm 1 (P1-P9), independent of vLLM.

It holds a vLLM-layout paged KV cache (:class:`PagedKVCache`), a transport and a
:class:`~vllm_hawk.protocol.ProtocolServer`, and answers the decode's requests:

* mode ``"hawk"`` (GN-HAWK): D1 ``KVRequest`` -> P1-P3 look the request's source blocks
  up (registered by the engine with :meth:`add_request`) -> P4 transform into G' for the
  destination layout in the request -> P5-P6 reserve the request's range of the
  registered ring and write G' straight into it -> P7 ``KVReady`` with one segment per
  destination bank (offsets from the ring base). ``Release`` (D8) -> P8 free the ring
  range, P9 forget the request (``on_finished`` callback). The ring is the ONLY memory
  this endpoint registers, so a peer's READ of anything else is refused by the transport.
* mode ``"vllm"`` (GG-Host / GG-Direct / GN-Host baselines): no transform; the whole
  cache is registered (the "export region") and ``KVReady`` lists the request's source
  block runs as segments in layer 0 (``bank`` 0, offsets from the cache base); layer
  ``l`` of a run lies ``l * export_nbytes / num_layers`` bytes further.

Requests are served by worker threads (the server thread only queues them). A request
that cannot get ring space within ``min(reserve_timeout_s, its deadline)`` is answered
``ErrorMsg(no_space)``; a range whose decode never sends ``Release`` is reclaimed after
``lease_s`` (and the engine is told with ``on_finished(req_id, False)``). A ``Release``
that arrives while its request is still being served (the decode gave up waiting for
``KVReady``) cancels it: the worker frees the range as soon as it sees the flag (after
reserving, after transforming) and sends no ``KVReady``.

The destination layout in a ``KVRequest`` comes from the peer and is bounded before
anything is sized from it: block size == the handshake's ``block_size``, ``num_banks``
and ``page_nbytes`` == the handshake's device profile's, model shapes == this cache's.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from vllm_hawk.kvflow.errors import BufferFull, RingClosed
from vllm_hawk.kvflow.paged_cache import LAYOUT_NAME, PagedKVCache, block_runs
from vllm_hawk.kvflow.ring import RingBuffer
from vllm_hawk.layout.device_profiles import DeviceProfile, load_profile
from vllm_hawk.layout.formats import tile_format
from vllm_hawk.layout.tt_kv_cache import KV_DTYPES, TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.protocol import (Ack, CompatFields, ErrorMsg, KVReady, KVRequest, LayoutDesc,
                                ProtocolServer, Release, Segment)
from vllm_hawk.transform import make_plan, transform_kv

logger = logging.getLogger(__name__)

MODES = ("hawk", "vllm")
MAX_BANKS = 64  # bound on a peer's num_banks when the handshake's device profile is unknown here
MAX_PAGE_NBYTES = 1 << 20  # likewise for page_nbytes


@dataclass
class _Req:
    src_blocks: np.ndarray
    num_tokens: int


@dataclass
class _Served:
    ready_at: float
    lease_s: float


@dataclass
class PrefillStats:
    served: int = 0
    released: int = 0
    refused: int = 0
    expired: int = 0
    cancelled: int = 0  # Release arrived before KVReady; the range was freed, no KVReady sent
    transform_s: dict = field(default_factory=dict)  # req_id -> seconds (last 1024)


def spec_from_desc(desc: LayoutDesc, num_blocks: int) -> TTKVCacheSpec:
    return TTKVCacheSpec(desc.num_layers, num_blocks, desc.num_kv_heads, desc.block_size, desc.head_dim, desc.dtype)


class PrefillEndpoint:
    """One prefill instance's side of Algorithm 1 (see module doc).

    cache: the source KV; transport: a started transport (Mooncake, host-staged, ...);
    compat: our compatibility fields; ring_nbytes: ring size in bytes (hawk mode);
    reserve_timeout_s: longest wait for ring space (a request's own deadline can only
    shorten it); lease_s: a served range without Release is freed after this (0 = never);
    on_finished(req_id, ok): called once the request's source blocks are free for the
    engine (Release, cancel, or lease expiry with ok=False). A failing ``__init__``
    (e.g. ``bind`` in use) leaves nothing registered or running.
    """

    def __init__(self, cache: PagedKVCache, transport, compat: CompatFields, *, mode: str = "hawk",
                 ring_nbytes: int = 64 << 20, bind: str = "tcp://127.0.0.1:0", secret: bytes | None = None,
                 reserve_timeout_s: float = 5.0, lease_s: float = 60.0, workers: int = 1,
                 on_finished=None) -> None:
        if mode not in MODES:
            raise ValueError(f"prefill mode must be one of {MODES}, got {mode!r}")
        self.cache, self.transport, self.mode, self.compat = cache, transport, mode, compat
        self.reserve_timeout_s, self.lease_s = reserve_timeout_s, lease_s
        self.on_finished = on_finished
        self.stats = PrefillStats()
        self._lock = threading.Lock()
        self._requests: dict[str, _Req] = {}
        self._served: dict[str, _Served] = {}
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()  # pending requests whose decode already sent Release
        self.profile: DeviceProfile | None = None
        try:
            self.profile = load_profile(compat.device_profile)
        except (ValueError, OSError) as e:
            logger.warning("prefill: device profile %r unknown here (%s); bounding peer layouts by "
                           "%d banks / %d-byte pages", compat.device_profile, e, MAX_BANKS, MAX_PAGE_NBYTES)
        self.ring: RingBuffer | None = None
        self._exported = False
        self._stop = threading.Event()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._reaper: threading.Thread | None = None
        self.server: ProtocolServer | None = None
        try:
            if mode == "hawk":
                self.ring = RingBuffer(ring_nbytes, transport)
                self.export_base, self.export_nbytes = self.ring.base_addr, self.ring.capacity
            else:
                transport.register(cache.base_addr, cache.nbytes)
                self._exported = True
                self.export_base, self.export_nbytes = cache.base_addr, cache.nbytes
            self._views = cache.kv_views()
            self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hawk-prefill")
            self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="hawk-prefill-lease")
            self._reaper.start()
            self.server = ProtocolServer(self, compat, bind=bind, secret=secret)
        except BaseException:
            self.close()
            raise
        self.endpoint = self.server.endpoint

    # ------------------------------------------------------------------ engine side (P1-P3)
    def add_request(self, req_id: str, src_blocks, num_tokens: int) -> None:
        """The engine finished prefill of ``req_id``: its KV is in ``src_blocks`` (cache block ids)."""
        src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
        if src.size and (src.min() < 0 or src.max() >= self.cache.num_blocks):
            raise ValueError(f"add_request {req_id!r}: block ids outside [0, {self.cache.num_blocks})")
        if num_tokens <= 0 or num_tokens > src.size * self.cache.block_size:
            raise ValueError(f"add_request {req_id!r}: {num_tokens} tokens do not fit {src.size} blocks")
        with self._lock:
            self._requests[req_id] = _Req(src, num_tokens)

    def drop_request(self, req_id: str) -> None:
        with self._lock:
            self._requests.pop(req_id, None)

    def snapshot(self) -> dict:
        """Counters for tests and benchmarks: ring occupancy (bytes), live requests."""
        with self._lock:
            out = {"requests": len(self._requests), "served_live": len(self._served),
                   "pending": len(self._pending), "served": self.stats.served,
                   "released": self.stats.released, "refused": self.stats.refused,
                   "expired": self.stats.expired, "cancelled": self.stats.cancelled}
        if self.ring is not None:
            out.update(ring_capacity=self.ring.capacity, ring_used=self.ring.alloc.used_bytes(),
                       ring_live=len(self.ring.alloc.live()))
        return out

    # ------------------------------------------------------------------ ProtocolHandler
    def hello_info(self) -> tuple[str, int, int]:
        return self.transport.endpoint, self.export_base, self.export_nbytes

    def on_kv_request(self, peer: str, msg: KVRequest, reply) -> None:
        with self._lock:
            if msg.req_id in self._pending or msg.req_id in self._served:
                return ErrorMsg(code="bad_message", detail="request already in flight", req_id=msg.req_id)
            if msg.req_id not in self._requests:
                self.stats.refused += 1
                return ErrorMsg(code="unknown_request", detail="no finished prefill with this id",
                                req_id=msg.req_id)
            self._pending.add(msg.req_id)
        try:
            self._pool.submit(self._serve, msg, reply)
        except RuntimeError:  # pool shut down
            with self._lock:
                self._pending.discard(msg.req_id)
            return ErrorMsg(code="internal", detail="prefill endpoint is closing", req_id=msg.req_id)
        return None

    def on_release(self, peer: str, msg: Release, reply):
        with self._lock:
            if msg.req_id in self._pending:  # KVReady not sent yet: the worker cancels it
                self._cancelled.add(msg.req_id)
                return Ack(req_id=msg.req_id)
            served = self._served.pop(msg.req_id, None)
            if served is None:
                return ErrorMsg(code="unknown_request", detail="nothing to release (expired or never served)",
                                req_id=msg.req_id)
            self._requests.pop(msg.req_id, None)  # P9: the blocks are free for the engine
            self.stats.released += 1
        if self.ring is not None:
            self.ring.release(msg.req_id)  # P8
        if not msg.ok:
            logger.warning("decode reported a failed transfer of %s", msg.req_id)
        if self.on_finished is not None:
            self.on_finished(msg.req_id, msg.ok)
        return Ack(req_id=msg.req_id)

    # ------------------------------------------------------------------ P4-P7
    def _serve(self, msg: KVRequest, reply) -> None:
        rid = msg.req_id
        reserved = False
        try:
            with self._lock:
                req = self._requests.get(rid)
            if req is None:
                raise _Refuse("unknown_request", "request dropped by the engine")
            if self._is_cancelled(rid):
                raise _Cancelled()
            err = self._check(msg, req)
            if err:
                raise _Refuse("layout_mismatch", err)
            n_src = -(-msg.num_tokens // self.cache.block_size)
            src = req.src_blocks[:n_src]
            if self.mode == "vllm":
                segs = [Segment(0, int(first) * self.cache.block_nbytes, int(n) * self.cache.block_nbytes)
                        for _pos, first, n in block_runs(src)]
                out = KVReady(req_id=rid, ring_offset=0, total_nbytes=sum(s.nbytes for s in segs),
                              segments=segs, lease_ms=int(self.lease_s * 1000))
            else:
                desc = msg.dst_layout
                dst = np.asarray(msg.dst_block_ids, dtype=np.int64)
                layout = TTKVCacheLayout(spec_from_desc(desc, int(dst.max()) + 1), desc.num_banks,
                                         desc.page_nbytes, ((0, 0),) * desc.num_layers)
                plan = make_plan(layout, dst, "staged")
                timeout = self.reserve_timeout_s  # a far-future deadline must not hold the worker
                if msg.deadline_ms:
                    timeout = min(timeout, max(0.0, msg.deadline_ms / 1000.0 - time.time()))
                try:
                    off = self.ring.reserve(rid, plan.total_nbytes, timeout)  # P5
                except RingClosed as e:
                    raise _Refuse("internal", f"prefill endpoint is closing: {e}") from None
                except BufferFull as e:
                    raise _Refuse("no_space", str(e)) from None
                reserved = True
                if self._is_cancelled(rid):
                    raise _Cancelled()
                t0 = time.perf_counter()
                transform_kv(self._views, src, self.cache.block_size, plan,
                             out=self.ring.view(off, plan.total_nbytes))  # P4 + P6: G' lands in the ring
                self._note_transform(rid, time.perf_counter() - t0)
                segs = [Segment(int(b), off + int(plan.segment_offset[b]), int(plan.segment_nbytes[b]))
                        for b in range(desc.num_banks) if plan.segment_nbytes[b]]
                out = KVReady(req_id=rid, ring_offset=off, total_nbytes=plan.total_nbytes, segments=segs,
                              lease_ms=int(self.lease_s * 1000))
            with self._lock:  # the cancel check and the move to _served are one step
                if rid in self._cancelled:
                    raise _Cancelled()
                self._pending.discard(rid)
                self._served[rid] = _Served(time.monotonic(), self.lease_s)
                self.stats.served += 1
            reply(out)  # P7
        except Exception as e:  # noqa: BLE001 - every failure becomes a typed reply
            if reserved:
                self.ring.release(rid)  # P8
            with self._lock:
                self._pending.discard(rid)
                cancelled = rid in self._cancelled
                self._cancelled.discard(rid)
                if cancelled:  # the decode gave up and sent Release: done with it (P9)
                    self._requests.pop(rid, None)
                    self.stats.cancelled += 1
                else:
                    self.stats.refused += 1
            if cancelled:  # no reply: nobody waits for it
                logger.warning("prefill: %s released by the decode before its KVReady (%s); range freed",
                               rid, "cancelled" if isinstance(e, _Cancelled) else f"{type(e).__name__}: {e}")
                if self.on_finished is not None:
                    self.on_finished(rid, False)
                return
            if isinstance(e, _Refuse):
                reply(ErrorMsg(code=e.code, detail=str(e)[:1000], req_id=rid))
            else:
                logger.exception("prefill: serving %s failed", rid)
                reply(ErrorMsg(code="internal", detail=f"{type(e).__name__}: {str(e)[:900]}", req_id=rid))

    def _check(self, msg: KVRequest, req: _Req) -> str:
        """'' when the request can be served, else why not. Everything sized from the
        peer's layout (block size, banks, pages) is bounded here, before any plan."""
        c = self.cache
        if msg.num_tokens <= 0 or msg.num_tokens > req.num_tokens:
            return f"num_tokens {msg.num_tokens} not in [1, {req.num_tokens}] (the prefill's length)"
        d = msg.dst_layout
        if (d.num_layers, d.num_kv_heads, d.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            return (f"destination has {d.num_layers} layers x {d.num_kv_heads} KV heads x head_dim "
                    f"{d.head_dim}; this prefill has {c.num_layers} x {c.num_kv_heads} x {c.head_dim}")
        if self.mode == "vllm":
            return self._check_vllm(msg)
        if d.block_size != self.compat.block_size:
            return (f"destination block_size {d.block_size} differs from the handshake's "
                    f"{self.compat.block_size}")
        if d.dtype not in KV_DTYPES or tile_format(d.dtype).tile_nbytes != d.tile_nbytes:
            return f"destination dtype {d.dtype!r} with {d.tile_nbytes}-byte tiles is not supported"
        if d.page_nbytes < d.tile_nbytes or d.block_size % 32 or d.head_dim % 32:
            return "destination page/block/head_dim do not describe a TILE layout"
        p, name = self.profile, self.compat.device_profile
        if p is not None:
            if d.num_banks != p.num_banks:
                return f"destination has {d.num_banks} banks; device profile {name!r} has {p.num_banks}"
            if d.page_nbytes != p.aligned_page(d.tile_nbytes):
                return (f"destination page of {d.page_nbytes} bytes; device profile {name!r} pages "
                        f"{d.tile_nbytes}-byte tiles into {p.aligned_page(d.tile_nbytes)} bytes")
        elif d.num_banks > MAX_BANKS or d.page_nbytes > MAX_PAGE_NBYTES:
            return (f"destination has {d.num_banks} banks and {d.page_nbytes}-byte pages; with device "
                    f"profile {name!r} unknown here the limits are {MAX_BANKS} and {MAX_PAGE_NBYTES}")
        n_dst = -(-msg.num_tokens // d.block_size)
        if len(msg.dst_block_ids) != n_dst or len(set(msg.dst_block_ids)) != n_dst:
            return f"{len(msg.dst_block_ids)} destination block ids for {n_dst} blocks (must be distinct)"
        return ""

    def _check_vllm(self, msg: KVRequest) -> str:
        """Baseline mode: the peer reads our bytes unchanged, so its layout must be ours."""
        c, d = self.cache, msg.dst_layout
        dtype = str(c.dtype).removeprefix("torch.")
        want = (LAYOUT_NAME, dtype, c.block_size, 1, c.block_nbytes, c.block_nbytes)
        got = (d.name, d.dtype, d.block_size, d.num_banks, d.tile_nbytes, d.page_nbytes)
        if got != want:
            return (f"destination (name, dtype, block_size, num_banks, tile_nbytes, page_nbytes) {got} is "
                    f"not this prefill's vLLM layout {want}")
        n_dst = -(-msg.num_tokens // c.block_size)
        if len(msg.dst_block_ids) != n_dst:
            return f"{len(msg.dst_block_ids)} destination block ids for {n_dst} blocks"
        return ""

    def _note_transform(self, rid: str, seconds: float) -> None:
        with self._lock:
            t = self.stats.transform_s
            t[rid] = seconds
            if len(t) > 1024:
                t.pop(next(iter(t)))

    def transform_seconds(self, req_id: str) -> float | None:
        """Seconds the transform of ``req_id`` took (the last 1024 requests), or None."""
        with self._lock:
            return self.stats.transform_s.get(req_id)

    def _is_cancelled(self, rid: str) -> bool:
        """The decode sent Release for ``rid`` while it was pending (see ``on_release``)."""
        with self._lock:
            return rid in self._cancelled

    # ------------------------------------------------------------------ leases and shutdown
    def _reap_loop(self) -> None:
        while not self._stop.wait(0.5):
            if not self.lease_s:
                continue
            self.reap_expired()

    def reap_expired(self) -> list[str]:
        """Free every served range whose lease ran out (the reaper calls this every 0.5 s);
        the engine hears ``on_finished(req_id, False)`` for each. Returns their ids."""
        now = time.monotonic()
        with self._lock:
            dead = [r for r, s in self._served.items() if now - s.ready_at > s.lease_s]
            for r in dead:
                del self._served[r]
                self._requests.pop(r, None)
                self.stats.expired += 1
        for r in dead:
            logger.warning("prefill: lease of %s expired without Release; freeing its range", r)
            if self.ring is not None:
                self.ring.release(r)
            if self.on_finished is not None:
                try:
                    self.on_finished(r, False)  # P9: the blocks are free for the engine
                except Exception:  # noqa: BLE001 - the reaper must keep running
                    logger.exception("prefill: on_finished(%s) failed", r)
        return dead

    def close(self) -> None:
        """Stop serving; waiting reservations fail at once (ring abort), then workers drain.
        Safe on a partly constructed endpoint."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.server is not None:
            self.server.close()
        if self.ring is not None:
            self.ring.abort()  # a worker waiting for ring space must not hold up shutdown
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5.0)
        if self.ring is not None:
            self.ring.close()
        elif self._exported:
            self._exported = False
            try:
                self.transport.unregister(self.export_base)
            except Exception:  # noqa: BLE001
                pass


class _Cancelled(Exception):
    """Internal: the decode sent Release while the request was still being served."""


class _Refuse(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
