"""Worker side of HawkConnector: a thin adapter from vLLM's worker hooks to Algorithm 1.

It describes the caches (:mod:`~vllm_hawk.connector.describe`), picks the strategies once
at ``register_kv_caches`` and relays metadata, results and stats. Everything else —
leases, the ring, cancels, deadlines, settle/quarantine, Release — is
:mod:`vllm_hawk.kvflow`, the same code the tests and benchmarks run.

Prefill (``kv_producer``): a :class:`~vllm_hawk.kvflow.PrefillEndpoint` serving from
:class:`~vllm_hawk.kvflow.TileTransformSource` (``device_profile`` names a Tenstorrent
device: GN-HAWK), :class:`~vllm_hawk.kvflow.RingGatherSource` (``mode: staged``; also
GN-Host, ``layout_fix: decode``, whose decode fixes the layout) or
:class:`~vllm_hawk.kvflow.VllmBlockSource` (``mode: direct``). ``reqs_to_send`` are
handed over each step; a request the decode released (or whose lease expired) is
reported in ``finished_sending`` and vLLM frees its blocks.

Decode (``kv_consumer``): a :class:`~vllm_hawk.kvflow.LeaseKeeper` renews the prefill
leases of requests waiting in this engine (``reqs_to_want``) until their pull or Release
takes over; one sink — :class:`~vllm_hawk.kvflow.TTSink` on the
Tenstorrent platform plugin (:class:`~vllm_hawk.kvflow.gn_host.GNHostSink` with
``layout_fix: decode``), else :class:`~vllm_hawk.kvflow.VllmPagedSink` /
:class:`~vllm_hawk.kvflow.VllmStagedSink` — and one
:class:`~vllm_hawk.kvflow.DecodeEndpoint` per prefill, created at its first pull. Pulls
run on worker threads; results come back through ``get_transfer_results`` (failed
receives are also finished receives, as vLLM requires). A failed pull whose READs into
this engine's blocks have not drained is reported only once they have (the blocks are
held until then: vLLM must not reuse them).
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from vllm_hawk import envs
from vllm_hawk.connector import debug
from vllm_hawk.connector.config import VLLM_PROFILE, HawkConfig, HawkConfigError, port_stride
from vllm_hawk.connector.describe import LocalKV, describe_tt_cache, describe_vllm_caches, tt_cache_of
from vllm_hawk.connector.metadata import HawkConnectorMetadata, HawkWorkerMeta, RecvSpec
from vllm_hawk.connector.stats import HawkKVConnectorStats
from vllm_hawk.kvflow import (
    DecodeEndpoint,
    LeaseKeeper,
    PeerFailed,
    PrefillEndpoint,
    RingGatherSource,
    TileTransformSource,
    TransferUnsettled,
    TTSink,
    VllmBlockSource,
    vllm_sink,
)
from vllm_hawk.kvflow.decode import SETTLE_LIMIT_S, WHOLE, Share
from vllm_hawk.kvflow.gn_host import GNHostSink
from vllm_hawk.kvflow.shares import PlannedShare, fetch_shares, idle_ranks, plan_shares
from vllm_hawk.kvflow.sources import vllm_layout_desc
from vllm_hawk.kvflow.streams import PerHeadRange
from vllm_hawk.layout.tp import TPMismatch, replicas, shard_heads
from vllm_hawk.transport import make_transport

# Under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk.worker")

MAX_PEERS = 64  # decode: prefill side channels kept open at once; a pull to one more is refused (counted)


# --------------------------------------------------------------------------- CPU affinity

def unpin_current_thread() -> None:
    """Let the calling thread run on every CPU.

    vLLM's CPU worker binds its main thread to its OpenMP cores (one core by default on
    small machines), and threads inherit that mask. The connector's threads (side
    channel, pulls, transport polling) must not queue behind the model's busy loop on
    that core: on a 2-core machine that starved them for tens of seconds.
    """
    if hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


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


# --------------------------------------------------------------------------- strategies

def _in_background(warm, what: str) -> None:
    """Run ``warm`` (compile or load the transform kernels) while the engine starts."""
    def run() -> None:
        t0 = time.monotonic()
        try:
            warm()
        except Exception as e:  # noqa: BLE001 - the first request compiles instead
            logger.warning("HawkConnector: %s warm-up failed: %s", what, e)
            return
        logger.info("HawkConnector: %s kernels ready in %.1f s", what, time.monotonic() - t0)

    threading.Thread(target=run, daemon=True, name="hawk-transform-warm").start()


def tp_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and size (0, 1 outside a TP group)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - no distributed state (a bare engine in a test)
        return 0, 1


def check_pairing(num_kv_heads: int, prefill_tp: int, total: int, targets, local: int, *, chips: bool) -> None:
    """Raise HawkConfigError (naming both sides' values) unless decode targets ``targets``
    of ``total`` (TP ranks, or ``chips`` of a Tenstorrent mesh: those take their heads
    whole from one prefill rank), each holding ``local`` heads, can pull from a prefill
    with ``prefill_tp`` ranks."""
    what = "chips" if chips else "TP ranks"
    try:
        for t in targets:
            for ps in plan_shares(num_kv_heads, prefill_tp, total, t, local):
                if chips:
                    check_whole_chip(ps, local)
    except TPMismatch as e:
        raise HawkConfigError(f"kv_connector_extra_config.prefill_tp={prefill_tp} cannot feed this decode ({total} "
                              f"{what}, {num_kv_heads} KV heads): {e}") from None


def check_whole_chip(ps: PlannedShare, local: int) -> None:
    """A Tenstorrent chip lands whole head shards: raise TPMismatch unless share ``ps``
    brings all ``local`` heads of its chip."""
    if (ps.dst_start, ps.count) != (0, local):
        last = ps.dst_start + ps.count - 1
        raise TPMismatch(f"chip {ps.target} holds {local} KV heads; heads {ps.dst_start}..{last} "
                         f"of them would come from prefill rank {ps.prefill_rank} alone, and a Tenstorrent chip lands "
                         "whole head shards: use a prefill tensor_parallel_size <= the decode's chips")


def make_source(cfg: HawkConfig, kv: LocalKV):
    """The prefill's source for this configuration (see module doc)."""
    if cfg.device_profile != VLLM_PROFILE and cfg.layout_fix == "prefill":
        from vllm_hawk.layout.device_profiles import load_profile

        src = TileTransformSource(kv.views, kv.layout, load_profile(cfg.device_profile))
        _in_background(lambda: src.warm(src.profile), "prefill transform")
        return src
    if cfg.mode == "staged":  # also GN-Host (layout_fix 'decode'): plain vLLM blocks, the decode fixes them
        return RingGatherSource(kv.region_map, kv.layout, kv.storages, kv.heads)
    return VllmBlockSource(kv.region_map, kv.layout, kv.storages, kv.heads)


def make_sinks(cfg: HawkConfig, kv: LocalKV, transport) -> list:
    """The decode's sinks for this configuration (see module doc): one per chip of a
    Tenstorrent mesh (each chip's banks, its heads), else one."""
    if kv.tt_cache is not None and cfg.layout_fix == "decode":
        chips = getattr(kv.tt_cache, "chips", [kv.tt_cache])
        if len(chips) != 1:
            raise HawkConfigError(f"layout_fix 'decode' (GN-Host) with {len(chips)} chips: GN-Host lands on one "
                                  "chip; use layout_fix 'prefill' (GN-HAWK) for a mesh, or HAWK_TT_CHIPS=1")
        c = chips[0]
        sink = GNHostSink(c.device, c.layout, c.buffers, transport, kv.wire, cfg.ring_nbytes)
        _in_background(sink.warm, "GN-Host layout fix")
        return [sink]
    if kv.tt_cache is not None:
        sinks = []
        try:
            for c in getattr(kv.tt_cache, "chips", [kv.tt_cache]):  # each chip: its own banks, buffers, allocator
                align = c.device.profile.dram_alignment_bytes
                per_bank = max(align, cfg.ring_nbytes // c.layout.num_banks // align * align)
                sinks.append(TTSink(c.device, c.layout, c.buffers, transport, cfg.mode, recv_nbytes_per_bank=per_bank))
        except BaseException:
            for x in sinks:
                x.close()
            raise
        return sinks
    if cfg.device_profile != VLLM_PROFILE:
        raise NotImplementedError(f"HawkConnector: device_profile {cfg.device_profile!r} on the decode needs "
                                  "the Tenstorrent platform plugin (HAWK_TT_PLATFORM)")
    return [vllm_sink(kv.region_map, kv.layout, transport, cfg.mode, kv.storages, cfg.ring_nbytes)]


def make_transport_for(cfg: HawkConfig):
    kind, options = cfg.transport_kind_and_options()
    return make_transport(kind, **options)


# --------------------------------------------------------------------------- worker

@dataclass
class _Pulls:
    """Decode results waiting for ``get_transfer_results`` (guarded by the worker's lock)."""

    finished: set = field(default_factory=set)
    failed: set = field(default_factory=set)
    figures: dict = field(default_factory=dict)
    inflight: set = field(default_factory=set)
    quarantined: set = field(default_factory=set)


class HawkConnectorWorker:
    """The worker-side object the facade delegates to (see module doc)."""

    def __init__(self, vllm_config, cfg: HawkConfig, is_producer: bool, is_consumer: bool) -> None:
        self.vllm_config, self.cfg = vllm_config, cfg
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.stats = HawkKVConnectorStats()
        self._lock = threading.Lock()
        self._done: set[str] = set()  # prefill: finished_sending
        self._pulls = _Pulls()
        self._figures: dict[str, dict] = {}
        self._peers: dict[str, DecodeEndpoint] = {}
        self._peer_locks: dict[str, threading.Lock] = {}
        self._counted = {"expired": 0, "released": 0, "refused": 0}
        self.kv: LocalKV | None = None
        self._engines: dict[str, str] = {}  # side channel -> remote engine id (for messages)
        self._connecting: set[str] = set()  # side channels the lease keeper is handshaking with
        self.transport = self.prefill = self.sink = self._pool = self.keeper = None
        self.sinks: list = []  # decode: one per target this worker lands (chips of a mesh), sinks[0] is self.sink
        self._debug = envs.debug_dir()
        self.tp_rank, self.tp_size = 0, 1
        self._replicas_logged: set[int] = set()  # prefill TP sizes whose replicated heads were logged
        self._share_sinks = PerHeadRange(self._share_sink)  # (dst_start, count) -> the sink of those heads

    # ---------------------------------------------------------------- set-up
    def register_kv_caches(self, kv_caches) -> None:
        tt_cache = tt_cache_of(self.vllm_config)
        if tt_cache is not None:
            if self.is_producer:
                raise NotImplementedError("HawkConnector: an engine on the Tenstorrent platform is a decode "
                                          "(kv_consumer) only")
            if self.cfg.device_profile == VLLM_PROFILE:
                raise HawkConfigError("kv_connector_extra_config.device_profile must name the Tenstorrent device "
                                      "(e.g. 'p150a') on an engine that runs the Tenstorrent platform plugin")
            self.kv = describe_tt_cache(tt_cache, self.vllm_config, self.cfg)
        else:
            self.kv = describe_vllm_caches(kv_caches, self.vllm_config, self.cfg)
        self.tp_rank, self.tp_size = tp_rank_and_size()
        if self.tp_size > 1 and self.cfg.layout_fix == "decode":
            raise HawkConfigError(f"kv_connector_extra_config.layout_fix='decode' (GN-Host) with "
                                  f"tensor_parallel_size={self.tp_size}: GN-Host serves TP=1 only (GN-HAWK and GG "
                                  "pairs take any TP on both sides)")
        with unpinned_threads():  # the threads started here must not share the model's core
            self.transport = make_transport_for(self.cfg)
            try:
                if self.is_producer:
                    self._start_prefill()
                if self.is_consumer:
                    self.sinks = make_sinks(self.cfg, self.kv, self.transport)
                    self.sink = self.sinks[0]
                    if self.cfg.prefill_tp:
                        self._check_pairing(self.cfg.prefill_tp)
                    self._pool = cf.ThreadPoolExecutor(self.cfg.max_pulls, thread_name_prefix="hawk-pull",
                                                       initializer=unpin_current_thread)
                    self.keeper = LeaseKeeper(self._keeper_endpoint, self.cfg.renew_interval_s,
                                              max_hold_s=self.cfg.max_hold_s)
            except BaseException:
                self.shutdown()
                raise
        if self._debug is not None:
            debug.start_state_writer(self._debug, "prefill" if self.is_producer else "decode", self.snapshot,
                                     lambda: self.transport is not None)

    def _start_prefill(self) -> None:
        cfg = self.cfg
        source = make_source(cfg, self.kv)
        observer = None
        if self._debug is not None:
            every = isinstance(source, TileTransformSource) or cfg.layout_fix == "decode" or self.tp_size > 1
            observer = debug.prefill_dumper(self._debug, self.kv.views, self._rank_tag(),
                                            when=None if every else (lambda msg: msg.num_heads > 0))
        port = cfg.side_channel_port + self.tp_rank * port_stride(self.vllm_config)
        local = self.kv.layout.num_kv_heads
        tp_info = dict(tp_size=self.tp_size, tp_rank=self.tp_rank, num_kv_heads=self.kv.num_kv_heads,
                       head_start=shard_heads(self.kv.num_kv_heads, self.tp_size, self.tp_rank).start,
                       num_heads=local) if self.kv.num_kv_heads else None
        self.prefill = PrefillEndpoint(
            source, self.transport, self.kv.compat, ring_nbytes=cfg.ring_nbytes, tp_info=tp_info,
            bind=f"tcp://{cfg.side_channel_host}:{port}", secret=cfg.secret_bytes,
            auth=cfg.auth, claim_wait_s=cfg.claim_wait_s, lease_s=cfg.lease_s, max_hold_s=cfg.max_hold_s,
            on_finished=self._on_finished,
            observer=observer)  # server_id: random per start, so signed requests name this instance
        logger.info("HawkConnector prefill: side channel %s (auth %s), transfer endpoint %s, source %s, "
                    "transport %s", self.prefill.endpoint, cfg.auth, self.transport.endpoint, source.name,
                    cfg.transport)
        if cfg.auth == "none":
            logger.warning("HawkConnector prefill: side-channel authentication is OFF (auth 'none'): anyone who "
                           "reaches %s can request and release KV", self.prefill.endpoint)

    # ---------------------------------------------------------------- engine thread, each step
    def start_load_kv(self, meta: HawkConnectorMetadata) -> None:
        if self.prefill is not None:
            for rid, spec in meta.reqs_to_send.items():
                try:
                    self.prefill.add_request(rid, spec.block_ids, spec.num_tokens, spec.lease_expiry)
                except ValueError as e:  # never hold blocks nobody can fetch
                    logger.error("HawkConnector prefill: request %s not held: %s", rid, e)
                    self._on_finished(rid, False)
        if self.keeper is not None:
            for spec in meta.reqs_to_want.values():
                with self._lock:
                    if len(self._engines) < 4 * MAX_PEERS:  # only for messages; bounded like the peers
                        self._engines.setdefault(spec.side_channel, spec.remote_engine_id)
                for ep in self._side_channels(spec):
                    self.keeper.want(ep, spec.remote_request_id)
        if self._pool is not None:
            for rid, spec in meta.reqs_to_recv.items():
                with self._lock:
                    self._pulls.inflight.add(rid)
                self._pool.submit(self._pull, rid, spec)
            for spec in meta.reqs_to_release.values():
                self._pool.submit(self._release_only, spec)

    def get_transfer_results(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        res = KVConnectorTransferResults()
        with self._lock:
            res.finished_sending, self._done = self._done, set()
            p = self._pulls
            res.finished_recving, res.failed_recving = p.finished, p.failed
            self._figures.update(p.figures)
            p.finished, p.failed, p.figures = set(), set(), {}
        return res

    def build_worker_meta(self) -> HawkWorkerMeta | None:
        with self._lock:
            figures, self._figures = self._figures, {}
        return HawkWorkerMeta(transfers=figures) if figures else None

    def get_stats(self) -> HawkKVConnectorStats | None:
        with self._lock:
            if self.prefill is not None:
                for what in ("expired", "released", "refused"):
                    n = self.prefill.refused_input() if what == "refused" else getattr(self.prefill.stats, what)
                    self.stats.count(what, n - self._counted[what])
                    self._counted[what] = n
            if self.stats.is_empty():
                return None
            return self.stats.clone_and_reset()

    # ---------------------------------------------------------------- prefill callback
    def _on_finished(self, rid: str, ok: bool) -> None:
        with self._lock:
            self._done.add(rid)

    # ---------------------------------------------------------------- decode
    def _keeper_endpoint(self, ep: str) -> DecodeEndpoint:
        """The lease keeper's endpoint for prefill ``ep``. A handshake (up to
        ``handshake_timeout_s``, longer for a dead prefill) runs in its own thread, so that
        it never delays the heartbeats to other prefills; until then this raises."""
        with self._lock:
            got = self._peers.get(ep)
            if got is not None:
                return got
            busy = ep in self._connecting
            self._connecting.add(ep)
            engine_id = self._engines.get(ep, "?")
        if not busy:
            def connect() -> None:
                try:
                    self._endpoint_at(ep, engine_id)
                except Exception as e:  # noqa: BLE001 - the keeper retries at its next heartbeat
                    logger.debug("HawkConnector decode: lease keeper: %s", e)
                finally:
                    with self._lock:
                        self._connecting.discard(ep)

            threading.Thread(target=connect, daemon=True, name="hawk-keeper-connect").start()
        raise PeerFailed(f"no side channel to prefill {engine_id} at {ep} yet (connecting)")

    def _endpoint_at(self, ep: str, engine_id: str) -> DecodeEndpoint:
        with self._lock:
            lock = self._peer_locks.setdefault(ep, threading.Lock())
        with lock:
            with self._lock:
                got = self._peers.get(ep)
            if got is None:
                with self._lock:
                    full = len(self._peers) >= MAX_PEERS
                if full:
                    with self._lock:
                        self.stats.count("refused")
                    raise PeerFailed(f"pull from prefill {engine_id} at {ep} refused: this decode already "
                                     f"talks to {MAX_PEERS} prefills (kv_transfer_params name too many side channels)")
                try:
                    got = DecodeEndpoint(self.transport, ep, self.kv.compat, secret=self.cfg.secret_bytes,
                                         auth=self.cfg.auth,
                                         pull_timeout_s=self.cfg.pull_timeout_s,
                                         claim_wait_s=self.cfg.claim_wait_s,
                                         handshake_timeout_s=self.cfg.handshake_timeout_s)
                except Exception as e:
                    raise PeerFailed(f"handshake with prefill {engine_id} at {ep} failed: {e}") from e
                with self._lock:
                    self._peers[ep] = got
            return got

    def _pull(self, rid: str, spec: RecvSpec) -> None:
        t0 = time.monotonic()
        fig: dict = {"ok": False}
        try:
            end = spec.first_block + len(spec.local_block_ids)  # the blocks this pull ends at
            num_tokens = min(spec.remote_num_tokens, end * self.kv.layout.block_size)
            try:
                shares = [(self._rank_endpoint(spec, ps.prefill_rank), self._sink_for(ps), ps)
                          for ps in self._plan(spec)]
            except TPMismatch as e:
                self._release_after_mismatch(spec, e)
                raise
            self._release_idle_ranks(spec)
            res = fetch_shares(spec.remote_request_id, num_tokens, shares, spec.local_block_ids,
                               first_block=spec.first_block, layer_groups=self.cfg.layer_groups)
            self._drop_wants(spec)  # released: nothing left to renew
            fig.update(ok=True, nbytes=res.nbytes, entries=res.entries, segments=res.segments,
                       request_ms=round(1e3 * res.request_s, 3), transfer_ms=round(1e3 * res.transfer_s, 3),
                       copy_ms=round(1e3 * res.copy_s, 3),
                       **{k: v for k, v in res.extra.items() if not k.endswith("_s")})
            if self._debug is not None and self.kv.tt_cache is not None:
                debug.dump_landed(self._debug, spec.remote_request_id, self.kv.tt_cache, spec.local_block_ids)
            elif self._debug is not None and self.kv.views is not None and spec.remote_tp_size * self.tp_size > 1:
                debug.dump_landed_kv(self._debug, spec.remote_request_id + self._rank_tag(), self.kv.views,
                                     spec.local_block_ids)
        except Exception as e:  # noqa: BLE001 - every failure becomes a failed receive
            self._drop_wants(spec)
            fig["error"] = str(e)[:500]
            logger.error("HawkConnector decode: KV pull of %s (remote %s at %s) failed: %s",
                         rid, spec.remote_request_id, spec.side_channel, e)
            if isinstance(e, TransferUnsettled) and not self._settle(rid, e):
                return  # quarantined: the blocks stay with this request, never reused
        fig["total_ms"] = round(1e3 * (time.monotonic() - t0), 3)
        with self._lock:
            if fig["ok"]:
                self.stats.record_transfer(fig["total_ms"] / 1e3, fig["nbytes"], fig["segments"], fig["entries"],
                                           fig["request_ms"] / 1e3, (fig["transfer_ms"] + fig["copy_ms"]) / 1e3)
            else:
                self.stats.count("failed")
                self._pulls.failed.add(rid)
            self._pulls.finished.add(rid)
            self._pulls.inflight.discard(rid)
            self._pulls.figures[rid] = fig

    def _settle(self, rid: str, e: TransferUnsettled) -> bool:
        """Hold a failed pull's blocks until its READs drained (True), or for good (False)."""
        if e.settled is not None and e.settled.wait(SETTLE_LIMIT_S):
            return True
        logger.error("HawkConnector decode: READs of %s never drained; its blocks %s stay held (quarantined)",
                     rid, list(e.unsafe_blocks))
        with self._lock:
            self._pulls.quarantined.add(rid)
            self._pulls.inflight.discard(rid)
        return False

    def _release_only(self, spec: RecvSpec) -> None:
        self._drop_wants(spec)
        try:
            planned = self._plan(spec)
        except TPMismatch as e:
            logger.warning("HawkConnector decode: release of %s not sent: %s", spec.remote_request_id, e)
            return
        self._release_idle_ranks(spec)
        for ps in planned:
            self._release_rank(spec, ps.prefill_rank, ps.share)

    # ---------------------------------------------------------------- tensor parallelism
    def _rank_tag(self) -> str:
        """Debug file suffix of this TP rank ('' without TP)."""
        return f"-r{self.tp_rank}" if self.tp_size > 1 else ""

    def _targets(self) -> tuple[int, list[int], int]:
        """(decode targets in all, this worker's targets, KV heads each holds): a TP rank
        each, or each chip of a Tenstorrent mesh (the plugin's engine runs TP=1)."""
        local = self.kv.layout.num_kv_heads
        if self.kv.tt_cache is not None:
            n = len(self.sinks)
            return n, list(range(n)), local
        return self.tp_size, [self.tp_rank], local

    def _check_pairing(self, prefill_tp: int) -> None:
        """Start-up (``prefill_tp`` set): this decode's targets can pull from such a prefill."""
        total, targets, local = self._targets()
        check_pairing(self.kv.num_kv_heads or local, prefill_tp, total, targets, local,
                      chips=self.kv.tt_cache is not None)

    def _plan(self, spec: RecvSpec) -> list[PlannedShare]:
        """The shares this worker pulls for ``spec`` (one WHOLE share without TP)."""
        total, targets, local = self._targets()
        if self.cfg.prefill_tp and spec.remote_tp_size != self.cfg.prefill_tp:
            raise TPMismatch(f"kv_transfer_params name a prefill with tensor_parallel_size {spec.remote_tp_size}; "
                             f"this decode is configured for prefill_tp={self.cfg.prefill_tp}")
        return [ps for t in targets
                for ps in plan_shares(self.kv.num_kv_heads or local, spec.remote_tp_size, total, t, local)]

    def _rank_endpoint(self, spec: RecvSpec, rank: int) -> DecodeEndpoint:
        """The endpoint of prefill TP rank ``rank``; its HelloAck must say it is that rank."""
        ep = self._endpoint_at(spec.side_channel_of(rank), spec.remote_engine_id)
        h = ep.hello
        if h.num_kv_heads and ((h.tp_size, h.tp_rank) != (spec.remote_tp_size, rank)
                               or h.num_kv_heads != self.kv.num_kv_heads):
            err = TPMismatch(f"prefill side channel {spec.side_channel_of(rank)} says it is TP rank {h.tp_rank} of "
                             f"{h.tp_size} with {h.num_kv_heads} KV heads; kv_transfer_params name rank {rank} of "
                             f"{spec.remote_tp_size}, and this decode's model has {self.kv.num_kv_heads}")
            err.hello = h
            raise err
        return ep

    def _side_channels(self, spec: RecvSpec) -> list[str]:
        """Every prefill rank's side channel this worker renews leases on."""
        try:
            ranks = {ps.prefill_rank for ps in self._plan(spec)}
            if self.tp_rank == 0 and self.kv.num_kv_heads:
                ranks |= set(idle_ranks(self.kv.num_kv_heads, spec.remote_tp_size, self._targets()[0]))
        except TPMismatch:
            ranks = {0}
        return [spec.side_channel_of(r) for r in sorted(ranks)]

    def _drop_wants(self, spec: RecvSpec) -> None:
        for ep in self._side_channels(spec):
            self.keeper.drop(spec.remote_request_id, ep)

    def _release_idle_ranks(self, spec: RecvSpec) -> None:
        """Target 0 releases the prefill ranks nobody pulls from (replicated heads)."""
        if self.tp_rank != 0 or not self.kv.num_kv_heads:
            return
        with self._lock:  # pulls run on several threads: log once per prefill TP size
            first = spec.remote_tp_size not in self._replicas_logged
            self._replicas_logged.add(spec.remote_tp_size)
        if first:
            note = replicas(self.kv.num_kv_heads, spec.remote_tp_size)
            if note:
                logger.info("HawkConnector decode: prefill TP %d replicates KV heads: %s; idle ranks %s are "
                            "released at once", spec.remote_tp_size, note,
                            idle_ranks(self.kv.num_kv_heads, spec.remote_tp_size, self._targets()[0]))
        for r in idle_ranks(self.kv.num_kv_heads, spec.remote_tp_size, self._targets()[0]):
            self._pool.submit(self._release_rank, spec, r)

    def _release_after_mismatch(self, spec: RecvSpec, e: TPMismatch) -> None:
        """A pull that cannot be planned (the two sides disagree on TP): release the request
        on every rank the prefill says it has, so its blocks are not held until the lease."""
        if e.hello is None or self.tp_rank != 0:
            return
        for r in range(e.hello.tp_size):
            self._pool.submit(self._release_rank, spec, r)

    def _release_rank(self, spec: RecvSpec, rank: int, share: Share = WHOLE) -> None:
        """Release (D8 without a fetch) ``share`` of the request on prefill rank ``rank``."""
        try:
            self._endpoint_at(spec.side_channel_of(rank), spec.remote_engine_id).release(
                spec.remote_request_id, ok=True, timeout_s=self.cfg.handshake_timeout_s, share=share)
        except Exception as e:  # noqa: BLE001 - the prefill's lease frees it
            logger.warning("HawkConnector decode: release of %s on prefill rank %d not delivered (%s); the "
                           "prefill frees it when its lease expires", spec.remote_request_id, rank, e)

    def _sink_for(self, ps: PlannedShare):
        """The sink of share ``ps``: its chip's sink (a mesh), this worker's sink, or a view
        of it restricted to the share's destination heads (vLLM caches)."""
        local = self.kv.layout.num_kv_heads
        if self.kv.tt_cache is not None:
            check_whole_chip(ps, local)
            return self.sinks[ps.target]
        if ps.dst_start == 0 and ps.count == local:
            return self.sink
        if self.kv.heads is None or not self.sink.caps.head_shares:
            raise TPMismatch(f"this decode's sink ({type(self.sink).__name__}) takes whole shards only; "
                             f"heads {ps.dst_start}..{ps.dst_start + ps.count - 1} of its {local} would come "
                             f"from prefill rank {ps.prefill_rank} alone")
        return self._share_sinks(ps.dst_start, ps.count)

    def _share_sink(self, start: int, count: int):
        """This worker's vLLM sink restricted to its KV heads ``[start, start+count)``."""
        m, lay = self.kv.heads(start, count), self.kv.layout
        return self.sink.for_heads(m, vllm_layout_desc(m, lay.name, lay.dtype, lay.block_size, count, lay.head_dim))

    # ---------------------------------------------------------------- idle check, shutdown
    def snapshot(self) -> dict:
        """What is held right now (all zero when idle): prefill requests and ring bytes,
        decode pulls in flight and receive memory."""
        out: dict = {}
        if self.prefill is not None:
            s = self.prefill.snapshot()
            out["prefill"] = {"held": s["requests"], "ring_live": s.get("ring_live", 0),
                              "ring_used": s.get("ring_used", 0), "expired": s["expired"],
                              "released": s["released"], "renewed": s["renewed"]}
        if self.sink is not None:
            with self._lock:
                d = {"inflight": len(self._pulls.inflight), "quarantined": len(self._pulls.quarantined)}
            if self.sink.caps.snapshot:  # a mesh: the sum over its chips' sinks
                held = [x.holds() for x in self.sinks or [self.sink]]
                d.update({k: sum(h[k] for h in held) for k in ("recv_live", "device_buffers")})
            if self.keeper is not None:
                d["renewing"] = self.keeper.wanted()
                d["heartbeats"] = self.keeper.stats.heartbeats
            with self._lock:
                peers = list(self._peers.values())
            d["backpressured"] = sum(p.backpressured for p in peers)
            out["decode"] = d
        return out

    def shutdown(self) -> None:
        if self.keeper is not None:
            self.keeper.close()
            self.keeper = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.close()
        for part in (self.prefill, *(self.sinks or [self.sink]), self.transport):
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001
                    logger.exception("HawkConnector: shutdown of %s failed", type(part).__name__)
        self.prefill = self.sink = self.transport = self._pool = None
        self.sinks = []
