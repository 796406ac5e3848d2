"""Worker side of HawkConnector: owns the transport, the side channel and the KV memory.

Prefill (``kv_producer``) — :class:`PrefillService`:
  registers the KV cache (``direct``) or a ring buffer (``staged``) with the transport,
  runs the side-channel :class:`~vllm_hawk.protocol.ProtocolServer`, and serves
  Algorithm 1's D1 requests for the requests the scheduler holds (P1-P7); a Release
  (D8) or an expired lease makes the request ``finished_sending`` (P8-P9: vLLM frees its
  blocks). A KVRequest that arrives before the scheduler's hand-over waits briefly.

Decode (``kv_consumer``) — :class:`PullService`:
  for each request in ``reqs_to_recv``: Hello once per prefill (compatibility hash),
  KVRequest -> KVReady, ONE batch of READs of coalesced block runs into its own KV
  blocks (``direct``) or into a receive buffer followed by copies into the blocks
  (``staged``), then Release. Pulls run on worker threads with one deadline each; the
  results come back through ``get_transfer_results`` (failed receives are also
  finished receives, as vLLM requires).

The decode-side destination is a :class:`KVDestination`; :class:`VllmPagedDestination`
is a vLLM paged cache with the prefill's layout. GN-HAWK (``device_profile`` names a
Tenstorrent device): the decode engine runs the Tenstorrent platform plugin and the
destination is :class:`vllm_hawk.connector.tt.TTDestination` (the plugin's device KV
cache through the bank-buffer API); the KVRequest carries its tile layout
(``LayoutDesc`` with ``num_banks`` > 1) and the prefill answers with G' in its ring, one
segment per bank (:func:`vllm_hawk.connector.tt.serve_tt`).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from vllm_hawk.connector.config import VLLM_PROFILE, HawkConfig
from vllm_hawk.connector.metadata import HawkConnectorMetadata, HawkWorkerMeta, RecvSpec, SendSpec
from vllm_hawk.connector.plan import (KVRegionMap, LayerRegion, gather_copies, pair_stream,
                                      region_map_from_caches, ring_segments, source_segments)
from vllm_hawk.connector.stats import HawkKVConnectorStats
from vllm_hawk.protocol import (Ack, CompatFields, ErrorMsg, KVReady, KVRequest, LayoutDesc,
                                ProtocolClient, ProtocolServer, Release, make_compat)
from vllm_hawk.transport import Transport, make_transport

if TYPE_CHECKING:
    from vllm_hawk.layout.vllm_kv import TransformSource

# Under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk." + __name__.rsplit(".", 1)[-1])

EARLY_KV_REQUEST_WAIT_S = 3.0  # a KVRequest may beat the scheduler's hand-over
_FORGET_S = 600.0  # remember released/expired ids this long (late messages)


# --------------------------------------------------------------------------- CPU affinity

def _all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def unpin_current_thread() -> None:
    """Let the calling thread run on every CPU.

    vLLM's CPU worker binds its main thread to its OpenMP cores (one core by default on
    small machines), and threads inherit that mask. The connector's threads (side
    channel, pulls, transport polling) must not queue behind the model's busy loop on
    that core: on a 2-core machine that starved them for tens of seconds.
    """
    if hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, _all_cpus())


@contextlib.contextmanager
def unpinned_threads():
    """Threads (Python and native) created inside inherit an unpinned CPU mask."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    mask = os.sched_getaffinity(0)
    unpin_current_thread()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mask)


# --------------------------------------------------------------------------- KV memory

def _layer_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


@dataclass
class LocalKV:
    """This engine's paged KV cache as the connector sees it."""

    region_map: KVRegionMap
    storages: list[tuple[int, int]]  # (addr, nbytes) of each distinct buffer to register
    compat: CompatFields
    layout: LayoutDesc
    block_size: int
    views: TransformSource | None = None  # what the transform reads, per layer


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], vllm_config, cfg: HawkConfig) -> LocalKV:
    """Region map, buffers, compatibility fields and layout of vLLM's KV caches."""
    from vllm_hawk.layout.vllm_kv import TransformSource, source_layout_from_layer

    ctx = vllm_config.compilation_config.static_forward_context
    names = sorted(kv_caches, key=_layer_key)
    caches, templates, adapters = [], [], []
    for name in names:
        cache = kv_caches[name]
        if isinstance(cache, (list, tuple)):
            cache = cache[0]
        layer = ctx.get(name)
        if layer is None or not hasattr(layer, "attn_backend"):
            raise NotImplementedError(f"HawkConnector: KV cache {name!r} is not an attention layer")
        adapter = source_layout_from_layer(layer, cache)
        caches.append(cache)
        templates.append(adapter.block_byte_ranges(cache, 0))
        adapters.append(adapter)
    views = TransformSource(adapters, caches)  # zero-copy views, or a gather for amx
    region_map = region_map_from_caches(caches, templates)
    seen: dict[int, int] = {}
    for c in caches:
        st = c.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    a0 = adapters[0]
    isa = getattr(a0, "isa", None)
    src_layout = f"{a0.name}{'/' + isa if isa else ''}/{region_map.signature()}"
    hf = vllm_config.model_config.hf_config
    model_id = (f"{getattr(hf, 'model_type', '?')}:L{len(names)}:KV{a0.num_kv_heads}"
                f":D{a0.head_dim}:V{getattr(hf, 'vocab_size', 0)}")
    dtype = str(a0.dtype).removeprefix("torch.")
    block_nbytes = region_map.layers[0].block_nbytes
    if cfg.device_profile != VLLM_PROFILE:  # GN-HAWK: the prefill transforms for the decode
        from vllm_hawk.connector.tt import tt_compat
        compat = tt_compat(model_id, dtype, a0.block_size, cfg.device_profile)
    else:
        compat = make_compat(model=model_id[:256], dtype=dtype, block_size=a0.block_size,
                             src_layout=src_layout[:256], dst_layout=f"vllm-paged/{src_layout}"[:256],
                             device_profile=cfg.device_profile)
    layout = LayoutDesc(name=f"vllm-paged/{a0.name}"[:256], dtype=dtype, block_size=a0.block_size,
                        num_layers=len(names), num_kv_heads=a0.num_kv_heads, head_dim=a0.head_dim,
                        num_banks=1, tile_nbytes=block_nbytes,
                        page_nbytes=region_map.layers[0].block_stride_nbytes)
    return LocalKV(region_map, sorted(seen.items()), compat, layout, a0.block_size, views)


def describe_tt_cache(cache, vllm_config, cfg: HawkConfig) -> LocalKV:
    """Decode side on the Tenstorrent platform plugin: compat fields and layout of its
    device KV cache (no host buffers to register: the destination registers its own)."""
    from vllm_hawk.connector.tt import model_id, tt_compat
    from vllm_hawk.kvflow.decode import layout_desc

    s = cache.spec
    dev = cache.device.profile.name
    if dev != cfg.device_profile:
        from vllm_hawk.connector.config import HawkConfigError
        raise HawkConfigError(f"kv_connector_extra_config.device_profile={cfg.device_profile!r} but "
                              f"this engine's emulated Tenstorrent device is {dev!r}")
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    mid = model_id(vllm_config, s.num_layers, s.num_kv_heads, s.head_dim)
    compat = tt_compat(mid, dtype, s.block_size, cfg.device_profile)
    return LocalKV(KVRegionMap((), s.num_blocks), [], compat, layout_desc(cache.layout, "tt-paged"),
                   s.block_size)


class KVDestination(Protocol):
    """Where a decode pull lands (the seam for a Tenstorrent KV pool)."""

    region_map: KVRegionMap
    layout: LayoutDesc


@dataclass
class VllmPagedDestination:
    """A vLLM paged KV cache with the prefill's layout (GG-Direct / GG-Host)."""

    region_map: KVRegionMap
    layout: LayoutDesc


def _memmove_all(copies) -> None:
    for dst, src, n in copies:
        ctypes.memmove(dst, src, n)


def _transport_for(cfg: HawkConfig) -> Transport:
    kind, options = cfg.transport_kind_and_options()
    return make_transport(kind, **options)


# --------------------------------------------------------------------------- prefill

@dataclass
class _Held:
    spec: SendSpec
    claimed_until: float = 0.0  # unix s: blocks pinned for an in-flight read


class PrefillService:
    """Serves held requests' KV to decodes (see module doc). Thread-safe."""

    def __init__(self, cfg: HawkConfig, kv: LocalKV, stats: HawkKVConnectorStats,
                 stats_lock: threading.Lock) -> None:
        self.cfg, self.kv = cfg, kv
        self._stats, self._stats_lock = stats, stats_lock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._deferred: dict[str, tuple[KVRequest, object, float]] = {}
        self._early_release: dict[str, float] = {}
        self._gone: dict[str, tuple[str, float]] = {}  # req_id -> (why, when)
        self._done: set[str] = set()
        self.transport = _transport_for(cfg)
        self.ring = None
        try:
            if cfg.mode == "staged" or cfg.device_profile != VLLM_PROFILE:
                # GN-HAWK always serves G' from the ring (the decode's mode only decides
                # where its READs land), so only the ring is exported.
                from vllm_hawk.kvflow.ring import RingBuffer
                self.ring = RingBuffer(cfg.ring_nbytes, self.transport)
                self.export_base, self.export_nbytes = self.ring.base_addr, self.ring.capacity
            else:
                for addr, n in kv.storages:
                    self.transport.register(addr, n)
                lo = min(a for a, _ in kv.storages)
                hi = max(a + n for a, n in kv.storages)
                self.export_base, self.export_nbytes = lo, hi - lo
            self._copier = cf.ThreadPoolExecutor(1, thread_name_prefix="hawk-stage",
                                                 initializer=unpin_current_thread)
            bind = f"tcp://{cfg.side_channel_host}:{cfg.side_channel_port}"
            self.server = ProtocolServer(self, kv.compat, bind=bind, secret=cfg.secret_bytes,
                                         server_id=f"hawk-prefill-{cfg.side_channel_port}")
        except BaseException:
            self.transport.close()
            raise
        if cfg.device_profile != VLLM_PROFILE and kv.views is not None:
            # Compile the transform kernels now (seconds, numba) rather than inside the
            # first pulls' deadlines: the server is not healthy before this returns.
            from vllm_hawk.connector.tt import warm_transform
            t0 = time.monotonic()
            try:
                warm_transform(kv.views, kv.layout, cfg.device_profile)
            except Exception as e:  # noqa: BLE001 - the first request compiles instead
                logger.warning("HawkConnector prefill: transform warm-up failed: %s", e)
            logger.info("HawkConnector prefill: transform kernels ready in %.1f s",
                        time.monotonic() - t0)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="hawk-lease")
        self._reaper.start()
        logger.info("HawkConnector prefill: side channel %s, transfer endpoint %s, mode %s, "
                    "transport %s", self.server.endpoint, self.transport.endpoint, cfg.mode,
                    cfg.transport)

    # ---------------------------------------------------------------- engine thread
    def hold(self, reqs: dict[str, SendSpec]) -> None:
        serve_now = []
        with self._lock:
            for rid, spec in reqs.items():
                if self._early_release.pop(rid, None) is not None:
                    self._finish_locked(rid, "released")
                    continue
                self._held[rid] = _Held(spec)
                d = self._deferred.pop(rid, None)
                if d is not None:
                    serve_now.append(d)
        for msg, reply, _ in serve_now:
            out = self.on_kv_request("", msg, reply)
            if out is not None:
                reply(out)

    def take_finished(self) -> set[str]:
        with self._lock:
            done, self._done = self._done, set()
        return done

    # ---------------------------------------------------------------- ProtocolHandler
    def hello_info(self) -> tuple[str, int, int]:
        return self.transport.endpoint, self.export_base, self.export_nbytes

    def on_kv_request(self, peer: str, msg: KVRequest, reply):
        rid = msg.req_id
        with self._lock:
            held = self._held.get(rid)
            if held is None:
                gone = self._gone.get(rid)
                if gone is not None:
                    return ErrorMsg(code="expired" if gone[0] == "expired" else "unknown_request",
                                    detail=f"request's blocks were {gone[0]}", req_id=rid)
                self._deferred[rid] = (msg, reply, time.monotonic() + EARLY_KV_REQUEST_WAIT_S)
                logger.debug("HawkConnector prefill: KVRequest for %s came before the "
                             "scheduler's hand-over; waiting for it", rid)
                return None
            if self.cfg.device_profile != VLLM_PROFILE:
                from vllm_hawk.connector.tt import check_tt_request
                err = check_tt_request(msg, self.kv.layout, self.cfg.device_profile,
                                       held.spec.num_tokens)
            else:
                err = self._check(msg, held.spec)
            if err:
                return ErrorMsg(code="layout_mismatch", detail=err, req_id=rid)
            held.claimed_until = time.time() + self.cfg.transfer_timeout_s
        if self.cfg.device_profile != VLLM_PROFILE:
            self._copier.submit(self._stage_tt, msg, held.spec, reply)
            return None
        if self.ring is None:
            segs = source_segments(self.kv.region_map, held.spec.block_ids, self.export_base)
            return KVReady(req_id=rid, ring_offset=0, total_nbytes=sum(s.nbytes for s in segs),
                           segments=segs, lease_ms=int(self.cfg.transfer_timeout_s * 1000))
        self._copier.submit(self._stage, msg, held.spec, reply)
        return None

    def on_release(self, peer: str, msg: Release, reply):
        rid = msg.req_id
        with self._lock:
            if rid not in self._held:
                if rid in self._gone:
                    return ErrorMsg(code="unknown_request", detail=f"already {self._gone[rid][0]}",
                                    req_id=rid)
                self._early_release[rid] = time.monotonic()  # beat the hand-over
                return Ack(req_id=rid)
            self._finish_locked(rid, "released")
        if not msg.ok:
            logger.warning("HawkConnector prefill: decode reported a failed pull of %s", rid)
        return Ack(req_id=rid)

    # ---------------------------------------------------------------- internals
    def _check(self, msg: KVRequest, spec: SendSpec) -> str:
        mine, theirs = self.kv.layout, msg.dst_layout
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"):
            if getattr(mine, f) != getattr(theirs, f):
                return (f"destination {f} is {getattr(theirs, f)!r}, this prefill has "
                        f"{getattr(mine, f)!r}")
        if theirs.num_banks != 1:
            return "per-bank destinations (Tenstorrent) are not served by this prefill yet"
        if msg.num_tokens > spec.num_tokens:
            return f"num_tokens {msg.num_tokens} > the {spec.num_tokens} tokens prefilled"
        return ""

    def _stage(self, msg: KVRequest, spec: SendSpec, reply) -> None:
        """Staged mode, P5-P7: gather the blocks' layer streams into the ring."""
        from vllm_hawk.kvflow.errors import BufferFull

        rid = msg.req_id
        nbytes = len(spec.block_ids) * self.kv.region_map.block_nbytes
        try:
            off = self.ring.reserve(rid, nbytes, min(5.0, self.cfg.transfer_timeout_s))
        except BufferFull as e:
            reply(ErrorMsg(code="no_space", detail=str(e)[:1000], req_id=rid))
            return
        try:
            _memmove_all(gather_copies(self.kv.region_map, spec.block_ids,
                                       self.ring.base_addr + off))
            segs = ring_segments(self.kv.region_map, len(spec.block_ids), off)
            reply(KVReady(req_id=rid, ring_offset=off, total_nbytes=nbytes, segments=segs,
                          lease_ms=int(self.cfg.transfer_timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001
            self.ring.release(rid)
            logger.exception("HawkConnector prefill: staging %s failed", rid)
            reply(ErrorMsg(code="internal", detail=f"{type(e).__name__}: {e}"[:1000], req_id=rid))

    def _stage_tt(self, msg: KVRequest, spec: SendSpec, reply) -> None:
        """GN-HAWK, P4-P7: transform the blocks into G' in the ring, one segment per bank."""
        from vllm_hawk.connector.tt import serve_tt
        from vllm_hawk.kvflow.errors import BufferFull

        rid = msg.req_id
        try:
            with self._lock:
                if rid not in self._held:  # released/expired while queued
                    reply(ErrorMsg(code="unknown_request", detail="request no longer held",
                                   req_id=rid))
                    return
            ready, t_tf = serve_tt(msg, spec.block_ids, self.kv.views, self.kv.block_size,
                                   self.ring, min(5.0, self.cfg.transfer_timeout_s),
                                   int(self.cfg.transfer_timeout_s * 1000))
            logger.debug("HawkConnector prefill: %s transformed in %.3f ms", rid, 1e3 * t_tf)
            with self._lock:
                gone = rid not in self._held
            if gone:  # released or expired while transforming: P8 now, no KVReady
                if rid in self.ring.alloc.live():
                    self.ring.release(rid)
                reply(ErrorMsg(code="unknown_request", detail="request no longer held", req_id=rid))
                return
            reply(ready)
        except BufferFull as e:
            reply(ErrorMsg(code="no_space", detail=str(e)[:1000], req_id=rid))
        except Exception as e:  # noqa: BLE001
            logger.exception("HawkConnector prefill: transforming %s failed", rid)
            reply(ErrorMsg(code="internal", detail=f"{type(e).__name__}: {e}"[:1000], req_id=rid))

    def snapshot(self) -> dict:
        """Idle check: held requests and ring occupancy."""
        with self._lock:
            out = {"held": len(self._held)}
        if self.ring is not None:
            out.update(ring_live=len(self.ring.alloc.live()), ring_used=self.ring.alloc.used_bytes())
        return out

    def _finish_locked(self, rid: str, why: str) -> None:
        self._held.pop(rid, None)
        self._done.add(rid)
        self._gone[rid] = (why, time.monotonic())
        if self.ring is not None and rid in self.ring.alloc.live():
            self.ring.release(rid)
        with self._stats_lock:
            self._stats.count("expired" if why == "expired" else "released")

    def _reap_loop(self) -> None:
        while not self._stop.wait(0.2):
            now, mono = time.time(), time.monotonic()
            late = []
            with self._lock:
                for rid, h in list(self._held.items()):
                    if now > max(h.spec.lease_expiry, h.claimed_until):
                        logger.warning("HawkConnector prefill: lease of %s expired without a "
                                       "Release; freeing its blocks", rid)
                        self._finish_locked(rid, "expired")
                for rid, (_m, reply, deadline) in list(self._deferred.items()):
                    if mono > deadline:
                        del self._deferred[rid]
                        late.append((rid, reply))
                for table in (self._gone, self._early_release):
                    for rid in [r for r, v in table.items()
                                if mono - (v[1] if isinstance(v, tuple) else v) > _FORGET_S]:
                        del table[rid]
            for rid, reply in late:
                reply(ErrorMsg(code="unknown_request", detail="no finished prefill with this id",
                               req_id=rid))

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        self._copier.shutdown(wait=True, cancel_futures=True)
        if self.ring is not None:
            self.ring.close()
        self.transport.close()


# --------------------------------------------------------------------------- decode

class PullError(RuntimeError):
    pass


@dataclass
class _Peer:
    client: ProtocolClient
    lock: threading.Lock = field(default_factory=threading.Lock)


class PullService:
    """Pulls remote KV into this engine's blocks (see module doc). Thread-safe."""

    def __init__(self, cfg: HawkConfig, kv: LocalKV, dest: KVDestination | None,
                 stats: HawkKVConnectorStats, stats_lock: threading.Lock, tt_cache=None) -> None:
        self.cfg, self.kv, self.dest = cfg, kv, dest
        self._stats, self._stats_lock = stats, stats_lock
        self.transport = _transport_for(cfg)
        for addr, n in kv.storages:
            self.transport.register(addr, n)
        self.recv = None
        self.tt = None
        if tt_cache is not None:
            from vllm_hawk.connector.tt import TTDestination
            try:
                self.tt = self.dest = TTDestination(tt_cache, cfg.mode, self.transport, cfg.ring_nbytes)
            except BaseException:
                self.transport.close()
                raise
        elif cfg.mode == "staged":
            from vllm_hawk.kvflow.ring import RingBuffer
            self.recv = RingBuffer(cfg.ring_nbytes, self.transport)
        self._pool = cf.ThreadPoolExecutor(cfg.max_pulls, thread_name_prefix="hawk-pull",
                                           initializer=unpin_current_thread)
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._figures: dict[str, dict] = {}
        self._closed = False

    # ---------------------------------------------------------------- engine thread
    def start(self, meta: HawkConnectorMetadata) -> None:
        for rid, spec in meta.reqs_to_recv.items():
            self._pool.submit(self._pull_guarded, rid, spec)
        for rid, spec in meta.reqs_to_release.items():
            self._pool.submit(self._release_only, rid, spec)

    def take_results(self) -> tuple[set[str], set[str], dict[str, dict]]:
        with self._lock:
            out = (self._finished, self._failed, self._figures)
            self._finished, self._failed, self._figures = set(), set(), {}
        return out

    # ---------------------------------------------------------------- pull
    def _peer(self, spec: RecvSpec, timeout_s: float) -> ProtocolClient:
        ep = spec.side_channel
        with self._lock:
            peer = self._peers.get(ep)
            if peer is None:
                client = ProtocolClient(ep, self.kv.compat, secret=self.cfg.secret_bytes,
                                        timeout_s=self.cfg.transfer_timeout_s)
                peer = self._peers[ep] = _Peer(client)
        with peer.lock:
            if peer.client.hello is None:
                try:
                    peer.client.handshake(min(timeout_s, self.cfg.handshake_timeout_s))
                except Exception as e:
                    raise PullError(f"handshake with prefill {spec.remote_engine_id} at {ep} "
                                    f"failed: {e}") from e
        return peer.client

    def _pull_guarded(self, rid: str, spec: RecvSpec) -> None:
        t0 = time.monotonic()
        fig = {"nbytes": 0, "entries": 0, "segments": 0, "ok": False}
        try:
            self._pull(rid, spec, t0, fig)
            fig["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure becomes a failed receive
            fig["error"] = str(e)[:500]
            logger.error("HawkConnector decode: KV pull of %s (remote %s at %s) failed: %s",
                         rid, spec.remote_request_id, spec.side_channel, e)
            self._release_quietly(spec, ok=False)
        fig["total_ms"] = round(1e3 * (time.monotonic() - t0), 3)
        with self._stats_lock:
            if fig["ok"]:
                self._stats.record_transfer(fig["total_ms"] / 1e3, fig["nbytes"], fig["segments"],
                                            fig["entries"])
            else:
                self._stats.count("failed")
        with self._lock:
            self._finished.add(rid)
            if not fig["ok"]:
                self._failed.add(rid)
            self._figures[rid] = fig

    def _pull(self, rid: str, spec: RecvSpec, t0: float, fig: dict) -> None:
        deadline = t0 + self.cfg.transfer_timeout_s

        def left() -> float:
            r = deadline - time.monotonic()
            if r <= 0:
                raise PullError(f"transfer deadline of {self.cfg.transfer_timeout_s} s passed")
            return r

        client = self._peer(spec, left())
        hello = client.hello
        plan = self.tt.plan(spec.local_block_ids) if self.tt is not None else None
        req = KVRequest(req_id=spec.remote_request_id, dst_layout=self.dest.layout,
                        num_tokens=spec.remote_num_tokens,
                        dst_block_ids=list(spec.local_block_ids),
                        deadline_ms=int((time.time() + left()) * 1000))
        t_req = time.monotonic()
        ready: KVReady = client.request_kv(req, left())
        fig["request_ms"] = round(1e3 * (time.monotonic() - t_req), 3)
        fig["segments"] = len(ready.segments)
        n = len(spec.local_block_ids)
        dmap = self.dest.region_map
        t1 = time.monotonic()
        if self.tt is not None:  # GN-HAWK: bank buffers (staged) or KV pages (direct)
            self.tt.check_ready(ready, plan, hello.ring_nbytes)
            self.tt.land(rid, ready, plan, hello.ring_base_addr,
                         lambda entries: self._read(hello.transfer_endpoint, entries, left()),
                         left(), fig, dump_key=spec.remote_request_id)
            entries = [None] * fig["entries"]
        elif self.recv is None:  # direct: straight into the KV blocks
            entries = pair_stream(ready.segments, hello.ring_base_addr, dmap,
                                  spec.local_block_ids, spec.first_block)
            self._read(hello.transfer_endpoint, entries, left())
        else:  # staged: receive buffer, then copies into the blocks (D6-D7)
            nbytes = n * dmap.block_nbytes
            off = self.recv.reserve(rid, nbytes, min(left(), 5.0))
            try:
                base = self.recv.base_addr + off
                recv_map = _stream_buffer_map(dmap, n, base)
                entries = pair_stream(ready.segments, hello.ring_base_addr, recv_map,
                                      list(range(n)), spec.first_block)
                self._read(hello.transfer_endpoint, entries, left())
                _memmove_all(pair_stream(ring_segments(dmap, n, 0), base, dmap,
                                         spec.local_block_ids, 0))
            finally:
                self.recv.release(rid)
        fig["transfer_ms"] = round(1e3 * (time.monotonic() - t1), 3)
        if self.tt is None:
            fig["entries"] = len(entries)
            fig["nbytes"] = sum(e[2] for e in entries)
        try:
            client.release(spec.remote_request_id, ok=True, timeout_s=min(left(), 2.0))
        except Exception as e:  # noqa: BLE001 - KV is in place; the lease frees the rest
            logger.warning("HawkConnector decode: Release of %s failed (%s); the prefill "
                           "frees the blocks when its lease expires", rid, e)

    def _read(self, peer: str, entries, timeout_s: float) -> None:
        h = self.transport.submit("read", peer, entries)
        try:
            self.transport.wait(h, timeout_s)
        except Exception:
            # Never hand the blocks back while a READ may still write them.
            h.settled.wait(max(5.0, self.cfg.transfer_timeout_s))
            raise

    def _release_only(self, rid: str, spec: RecvSpec) -> None:
        self._release_quietly(spec, ok=True)

    def _release_quietly(self, spec: RecvSpec, ok: bool) -> None:
        try:
            client = self._peer(spec, self.cfg.handshake_timeout_s)
            client.release(spec.remote_request_id, ok=ok, timeout_s=2.0)
        except Exception as e:  # noqa: BLE001
            logger.debug("HawkConnector decode: release of %s not delivered: %s",
                         spec.remote_request_id, e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            p.client.close()
        if self.recv is not None:
            self.recv.close()
        if self.tt is not None:
            self.tt.close()
        self.transport.close()


def _stream_buffer_map(dmap: KVRegionMap, n: int, base: int) -> KVRegionMap:
    """A map whose ``n`` blocks are the layer streams laid contiguously from ``base``."""
    layers, off = [], base
    for r in dmap.layers:
        bn = r.block_nbytes
        layers.append(LayerRegion(off, bn, ((0, bn),)))
        off += n * bn
    return KVRegionMap(tuple(layers), n)


# --------------------------------------------------------------------------- facade helper

def _tt_cache_of(vllm_config):
    """The engine's Tenstorrent KV cache when it runs the platform plugin, else None."""
    try:
        from vllm_hawk.tt_plugin import registry
    except Exception:  # noqa: BLE001 - plugin not importable: not a Tenstorrent engine
        return None
    try:
        return registry.get_kv_cache(vllm_config)
    except (LookupError, ValueError):
        return None


class HawkConnectorWorker:
    """The worker-side object the facade delegates to; one of the two services."""

    def __init__(self, vllm_config, cfg: HawkConfig, is_producer: bool, is_consumer: bool) -> None:
        self.vllm_config, self.cfg = vllm_config, cfg
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.stats = HawkKVConnectorStats()
        self._stats_lock = threading.Lock()
        self.prefill: PrefillService | None = None
        self.pull: PullService | None = None
        self.kv: LocalKV | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tt_cache = _tt_cache_of(self.vllm_config)
        if tt_cache is not None:
            if self.is_producer:
                raise NotImplementedError("HawkConnector: an engine on the Tenstorrent platform "
                                          "is a decode (kv_consumer) only")
            if self.cfg.device_profile == VLLM_PROFILE:
                from vllm_hawk.connector.config import HawkConfigError
                raise HawkConfigError("kv_connector_extra_config.device_profile must name the "
                                      "Tenstorrent device (e.g. 'p150a') on an engine that runs "
                                      "the Tenstorrent platform plugin")
            self.kv = describe_tt_cache(tt_cache, self.vllm_config, self.cfg)
        else:
            self.kv = describe_kv_caches(kv_caches, self.vllm_config, self.cfg)
        with unpinned_threads():  # the services' threads must not share the model's core
            if self.is_producer:
                self.prefill = PrefillService(self.cfg, self.kv, self.stats, self._stats_lock)
            if self.is_consumer:
                if tt_cache is not None:
                    self.pull = PullService(self.cfg, self.kv, None, self.stats, self._stats_lock,
                                            tt_cache=tt_cache)
                else:
                    if self.cfg.device_profile != VLLM_PROFILE:
                        raise NotImplementedError(
                            f"HawkConnector: device_profile {self.cfg.device_profile!r} on the "
                            "decode needs the Tenstorrent platform plugin (HAWK_TT_PLATFORM)")
                    dest = VllmPagedDestination(self.kv.region_map, self.kv.layout)
                    self.pull = PullService(self.cfg, self.kv, dest, self.stats, self._stats_lock)
        self._start_state_writer()

    def start_load_kv(self, meta: HawkConnectorMetadata) -> None:
        if self.prefill is not None and meta.reqs_to_send:
            self.prefill.hold(meta.reqs_to_send)
        if self.pull is not None and (meta.reqs_to_recv or meta.reqs_to_release):
            self.pull.start(meta)

    def get_transfer_results(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        res = KVConnectorTransferResults()
        if self.prefill is not None:
            res.finished_sending = self.prefill.take_finished()
        if self.pull is not None:
            fin, failed, figures = self.pull.take_results()
            res.finished_recving, res.failed_recving = fin, failed
            if figures:
                self._figures = {**getattr(self, "_figures", {}), **figures}
        return res

    def build_worker_meta(self) -> HawkWorkerMeta | None:
        figures = getattr(self, "_figures", None)
        if not figures:
            return None
        self._figures = {}
        return HawkWorkerMeta(transfers=figures)

    def snapshot(self) -> dict:
        """Idle check for tests: the services' held state (empty when idle)."""
        out: dict = {}
        if self.prefill is not None:
            out["prefill"] = self.prefill.snapshot()
        if self.pull is not None and self.pull.tt is not None:
            out["decode"] = self.pull.tt.snapshot()
        return out

    def _start_state_writer(self) -> None:
        """Tests: with ``HAWK_CONNECTOR_DUMP_DIR`` set, write :meth:`snapshot` to
        ``state-<pid>.json`` there twice a second (servers run in other processes)."""
        from vllm_hawk.connector.tt import DUMP_ENV

        d = os.environ.get(DUMP_ENV)
        if not d:
            return
        import json
        from pathlib import Path

        path = Path(d) / f"state-{'prefill' if self.is_producer else 'decode'}-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)

        def loop() -> None:
            while self.prefill is not None or self.pull is not None:
                try:
                    snap = self.snapshot()
                    tt = self.pull.tt if self.pull is not None else None
                    if tt is not None:
                        snap["decode"]["device_buffers"] = len(tt.device.live_buffers())
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"t": time.time(), **snap}))
                    tmp.rename(path)
                except Exception:  # noqa: BLE001 - debugging aid only
                    pass
                time.sleep(0.5)

        threading.Thread(target=loop, daemon=True, name="hawk-state").start()

    def get_stats(self) -> HawkKVConnectorStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            return self.stats.clone_and_reset()

    def shutdown(self) -> None:
        for svc in (self.pull, self.prefill):
            if svc is not None:
                try:
                    svc.close()
                except Exception:  # noqa: BLE001
                    logger.exception("HawkConnector: shutdown of %s failed", type(svc).__name__)
        self.pull = self.prefill = None
