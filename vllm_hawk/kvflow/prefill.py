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
that cannot get ring space within its deadline is answered ``ErrorMsg(no_space)``; a
range whose decode never sends ``Release`` is reclaimed after ``lease_s``.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from vllm_hawk.kvflow.errors import BufferFull
from vllm_hawk.kvflow.paged_cache import PagedKVCache, block_runs
from vllm_hawk.kvflow.ring import RingBuffer
from vllm_hawk.layout.formats import tile_format
from vllm_hawk.layout.tt_kv_cache import KV_DTYPES, TTKVCacheLayout, TTKVCacheSpec
from vllm_hawk.protocol import (Ack, CompatFields, ErrorMsg, KVReady, KVRequest, LayoutDesc,
                                ProtocolServer, Release, Segment)
from vllm_hawk.transform import make_plan, transform_kv

logger = logging.getLogger(__name__)

MODES = ("hawk", "vllm")


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
    transform_s: dict = field(default_factory=dict)  # req_id -> seconds (last 1024)


def spec_from_desc(desc: LayoutDesc, num_blocks: int) -> TTKVCacheSpec:
    return TTKVCacheSpec(desc.num_layers, num_blocks, desc.num_kv_heads, desc.block_size, desc.head_dim, desc.dtype)


class PrefillEndpoint:
    """One prefill instance's side of Algorithm 1 (see module doc).

    cache: the source KV; transport: a started transport (Mooncake, host-staged, ...);
    compat: our compatibility fields; ring_nbytes: ring size in bytes (hawk mode);
    reserve_timeout_s: backpressure wait for ring space when the request has no deadline;
    lease_s: a served range without Release is freed after this (0 = never).
    """

    def __init__(self, cache: PagedKVCache, transport, compat: CompatFields, *, mode: str = "hawk",
                 ring_nbytes: int = 64 << 20, bind: str = "tcp://127.0.0.1:0", secret: bytes | None = None,
                 reserve_timeout_s: float = 5.0, lease_s: float = 60.0, workers: int = 1,
                 on_finished=None) -> None:
        if mode not in MODES:
            raise ValueError(f"prefill mode must be one of {MODES}, got {mode!r}")
        self.cache, self.transport, self.mode = cache, transport, mode
        self.reserve_timeout_s, self.lease_s = reserve_timeout_s, lease_s
        self.on_finished = on_finished
        self.stats = PrefillStats()
        self._lock = threading.Lock()
        self._requests: dict[str, _Req] = {}
        self._served: dict[str, _Served] = {}
        self._pending: set[str] = set()
        self.ring: RingBuffer | None = None
        if mode == "hawk":
            self.ring = RingBuffer(ring_nbytes, transport)
            self.export_base, self.export_nbytes = self.ring.base_addr, self.ring.capacity
        else:
            transport.register(cache.base_addr, cache.nbytes)
            self.export_base, self.export_nbytes = cache.base_addr, cache.nbytes
        self._views = cache.kv_views()
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hawk-prefill")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="hawk-prefill-lease")
        self._reaper.start()
        self.server = ProtocolServer(self, compat, bind=bind, secret=secret)
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
                   "expired": self.stats.expired}
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
                timeout = self.reserve_timeout_s
                if msg.deadline_ms:
                    timeout = max(0.0, msg.deadline_ms / 1000.0 - time.time())
                try:
                    off = self.ring.reserve(rid, plan.total_nbytes, timeout)  # P5
                except BufferFull as e:
                    raise _Refuse("no_space", str(e)) from None
                reserved = True
                t0 = time.perf_counter()
                transform_kv(self._views, src, self.cache.block_size, plan,
                             out=self.ring.view(off, plan.total_nbytes))  # P4 + P6: G' lands in the ring
                self._note_transform(rid, time.perf_counter() - t0)
                segs = [Segment(int(b), off + int(plan.segment_offset[b]), int(plan.segment_nbytes[b]))
                        for b in range(desc.num_banks) if plan.segment_nbytes[b]]
                out = KVReady(req_id=rid, ring_offset=off, total_nbytes=plan.total_nbytes, segments=segs,
                              lease_ms=int(self.lease_s * 1000))
            with self._lock:
                self._pending.discard(rid)
                self._served[rid] = _Served(time.monotonic(), self.lease_s)
                self.stats.served += 1
            reply(out)  # P7
        except Exception as e:  # noqa: BLE001 - every failure becomes a typed reply
            if reserved:
                self.ring.release(rid)
            with self._lock:
                self._pending.discard(rid)
                self.stats.refused += 1
            if isinstance(e, _Refuse):
                reply(ErrorMsg(code=e.code, detail=str(e)[:1000], req_id=rid))
            else:
                logger.exception("prefill: serving %s failed", rid)
                reply(ErrorMsg(code="internal", detail=f"{type(e).__name__}: {str(e)[:900]}", req_id=rid))

    def _check(self, msg: KVRequest, req: _Req) -> str:
        c = self.cache
        if msg.num_tokens <= 0 or msg.num_tokens > req.num_tokens:
            return f"num_tokens {msg.num_tokens} not in [1, {req.num_tokens}] (the prefill's length)"
        if self.mode == "vllm":
            return ""
        d = msg.dst_layout
        if (d.num_layers, d.num_kv_heads, d.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            return (f"destination has {d.num_layers} layers x {d.num_kv_heads} KV heads x head_dim "
                    f"{d.head_dim}; this prefill has {c.num_layers} x {c.num_kv_heads} x {c.head_dim}")
        if d.dtype not in KV_DTYPES or tile_format(d.dtype).tile_nbytes != d.tile_nbytes:
            return f"destination dtype {d.dtype!r} with {d.tile_nbytes}-byte tiles is not supported"
        if d.page_nbytes < d.tile_nbytes or d.block_size % 32 or d.head_dim % 32:
            return "destination page/block/head_dim do not describe a TILE layout"
        n_dst = -(-msg.num_tokens // d.block_size)
        if len(msg.dst_block_ids) != n_dst or len(set(msg.dst_block_ids)) != n_dst:
            return f"{len(msg.dst_block_ids)} destination block ids for {n_dst} blocks (must be distinct)"
        return ""

    def _note_transform(self, rid: str, seconds: float) -> None:
        t = self.stats.transform_s
        t[rid] = seconds
        if len(t) > 1024:
            t.pop(next(iter(t)))

    # ------------------------------------------------------------------ leases and shutdown
    def _reap_loop(self) -> None:
        while not self._stop.wait(0.5):
            if not self.lease_s:
                continue
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

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.server.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.ring is not None:
            self.ring.close()
        else:
            try:
                self.transport.unregister(self.export_base)
            except Exception:  # noqa: BLE001
                pass


class _Refuse(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
