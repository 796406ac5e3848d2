"""Worker side of HawkConnector: an adapter from vLLM's worker hooks to Algorithm 1
(:mod:`vllm_hawk.kvflow`: leases, the ring, cancels, deadlines, settle/quarantine, Release).

``register_kv_caches`` describes this engine's KV cache and builds the strategies once
(:mod:`~vllm_hawk.connector.strategies`). Prefill: a :class:`~vllm_hawk.kvflow.PrefillEndpoint`
holds each step's ``reqs_to_send``; one the decode released (or whose lease expired) is
reported in ``finished_sending``. Decode: a :class:`~vllm_hawk.kvflow.LeaseKeeper` renews
the leases of ``reqs_to_want``; each pull runs on a pull thread, where the
:class:`~vllm_hawk.kvflow.pull_plan.PullPlanner` gives its shares (per prefill rank: the
endpoint from the :class:`~vllm_hawk.connector.peers.PeerPool`, the share, the sink) and
the idle ranks to release, :func:`~vllm_hawk.kvflow.shares.fetch_shares` moves them, and
:class:`~vllm_hawk.connector.pulls.PullResults` keeps the outcome for
``get_transfer_results`` (a failed pull whose READs have not drained: once they have).

Idle steps. vLLM keeps stepping an engine that computes nothing while the connector
holds a finished request for a decode (prefill) or a pull is in flight (decode), only to
ask ``get_transfer_results``. Answered at once, such steps spin the engine core and every
TP worker: a TP=2 prefill holding one request used 1.9 of 2 cores, and the side channel
(a thread of these workers, behind their GIL) then answered Renews in more than 1 s and
its CURVE handshakes ran past their 1 s limit. So in a step that computes nothing
(``meta.idle``) ``get_transfer_results`` waits up to ``idle_step_wait_ms`` for a Release
or a pull's end, and returns as soon as one comes.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time

from vllm_hawk import envs
from vllm_hawk.connector import debug
from vllm_hawk.connector.affinity import unpin_current_thread, unpinned_threads
from vllm_hawk.connector.config import HawkConfig
from vllm_hawk.connector.describe import LocalKV
from vllm_hawk.connector.metadata import HawkConnectorMetadata, HawkWorkerMeta, RecvSpec
from vllm_hawk.connector.peers import PeerPool
from vllm_hawk.connector.pulls import PullResults, figures_of
from vllm_hawk.connector.stats import HawkKVConnectorStats
from vllm_hawk.connector.strategies import (
    check_tp_size,
    decode_endpoint,
    describe_local,
    make_planner,
    make_prefill,
    make_sinks,
    make_transport_for,
    tp_rank_and_size,
)
from vllm_hawk.connector.vllm_compat import TransferResults
from vllm_hawk.kvflow import LeaseKeeper, TransferUnsettled
from vllm_hawk.kvflow.decode import WHOLE, Share
from vllm_hawk.kvflow.shares import fetch_shares
from vllm_hawk.layout.tp import TPMismatch

# Under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk.worker")


class HawkConnectorWorker:
    """The worker-side object the facade delegates to (see module doc)."""

    def __init__(self, vllm_config, cfg: HawkConfig, is_producer: bool, is_consumer: bool) -> None:
        self.vllm_config, self.cfg = vllm_config, cfg
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.stats = HawkKVConnectorStats()
        self._lock = threading.Lock()  # guards _done, _figures, stats and (inside it) _pulls
        self._done: set[str] = set()  # prefill: finished_sending
        self._pulls = PullResults(self._lock, self.stats)
        self._figures: dict[str, dict] = {}
        self._pull_blocks: dict[str, list[int]] = {}  # request -> local blocks its pull fills
        self._counted = {"expired": 0, "released": 0, "refused": 0}
        self.kv: LocalKV | None = None
        self.peers = PeerPool(
            lambda ep: decode_endpoint(self.cfg, self.transport, self.kv, ep),
            on_refused=lambda: self._pulls.count("refused"),
        )
        self.transport = self.prefill = self.sink = self._pool = self.keeper = self.planner = None
        self.sinks: list = []  # decode: one per target this worker lands (chips of a mesh), sinks[0] is self.sink
        self._debug = envs.debug_dir()
        self._scanned = False  # HAWK_DEBUG_DIR: the whole cache was scanned at the first pull
        self.tp_rank, self.tp_size = 0, 1
        self._news = threading.Event()  # set when a request finished sending or a pull ended
        self._idle_wait_s = 0.0  # this step computes nothing: get_transfer_results may wait this long

    # ---------------------------------------------------------------- set-up
    def register_kv_caches(self, kv_caches) -> None:
        self.kv = describe_local(kv_caches, self.vllm_config, self.cfg, is_producer=self.is_producer)
        self.tp_rank, self.tp_size = tp_rank_and_size()
        check_tp_size(self.cfg, self.tp_size)
        with unpinned_threads():  # the threads started here must not share the model's core
            self.transport = make_transport_for(self.cfg)
            try:
                if self.is_producer:
                    self.prefill = make_prefill(
                        self.cfg,
                        self.kv,
                        self.transport,
                        self.vllm_config,
                        tp_rank=self.tp_rank,
                        tp_size=self.tp_size,
                        on_finished=self._on_finished,
                        debug_dir=self._debug,
                    )
                if self.is_consumer:
                    self._start_decode()
            except BaseException:
                self.shutdown()
                raise
        if self._debug is not None:
            debug.start_state_writer(
                self._debug,
                "prefill" if self.is_producer else "decode",
                self.snapshot,
                lambda: self.transport is not None,
            )

    def _start_decode(self) -> None:
        cfg, kv = self.cfg, self.kv
        self.sinks = make_sinks(cfg, kv, self.transport)
        self.sink = self.sinks[0]
        self.planner = make_planner(cfg, kv, self.sinks, self.peers.get, tp_rank=self.tp_rank, tp_size=self.tp_size)
        self._pool = cf.ThreadPoolExecutor(
            cfg.max_pulls, thread_name_prefix="hawk-pull", initializer=unpin_current_thread
        )
        self.keeper = LeaseKeeper(self.peers.for_keeper, cfg.renew_interval_s, max_hold_s=cfg.max_hold_s)

    # ---------------------------------------------------------------- engine thread, each step
    def start_load_kv(self, meta: HawkConnectorMetadata) -> None:
        self._idle_wait_s = self.cfg.idle_step_wait_ms / 1e3 if meta.idle else 0.0
        if self.prefill is not None:
            for rid, spec in meta.reqs_to_send.items():
                try:
                    self.prefill.add_request(rid, spec.block_ids, spec.num_tokens, spec.lease_expiry)
                except ValueError as e:  # never hold blocks nobody can fetch
                    logger.error("HawkConnector prefill: request %s not held: %s", rid, e)
                    self._on_finished(rid, False)
            self.prefill.engine_step()
        if self.keeper is not None:
            for spec in meta.reqs_to_want.values():
                self.peers.note_engine(spec.side_channel, spec.remote_engine_id)  # for the keeper's messages
                for ep in self.planner.side_channels(spec):
                    self.keeper.want(ep, spec.remote_request_id)
        if self._pool is not None:
            for rid, spec in meta.reqs_to_recv.items():
                with self._lock:
                    self._pull_blocks[rid] = list(spec.local_block_ids)
                self._pulls.begin(rid)
                self._pool.submit(self._pull, rid, spec)
            for spec in meta.reqs_to_release.values():
                self._pool.submit(self._release_only, spec)

    def get_transfer_results(self) -> TransferResults:
        """What ended since the last call (vLLM version independent, see vllm_compat); in an
        idle step it first waits for news (see the module doc)."""
        res = TransferResults()
        if self._idle_wait_s and not self._has_news():
            self._news.wait(self._idle_wait_s)
        self._news.clear()
        with self._lock:
            res.finished_sending, self._done = self._done, set()
            res.finished_recving, res.failed_recving, figures = self._pulls.take()
            self._figures.update(figures)
            for rid in res.finished_recving:
                blocks = self._pull_blocks.pop(rid, ())
                if rid in res.failed_recving:
                    res.failed_blocks.update(blocks)
        return res

    def _has_news(self) -> bool:
        with self._lock:
            return bool(self._done) or self._pulls.has_results()

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
        self._news.set()

    # ---------------------------------------------------------------- decode
    def _pull(self, rid: str, spec: RecvSpec) -> None:
        t0 = time.monotonic()
        fig: dict = {"ok": False}
        try:
            end = spec.first_block + len(spec.local_block_ids)  # the blocks this pull ends at
            num_tokens = min(spec.remote_num_tokens, end * self.kv.layout.block_size)
            try:
                plan = self.planner.plan(spec)
            except TPMismatch as e:
                self._release_ranks(spec, self.planner.after_mismatch(e))
                raise
            self._release_ranks(spec, plan.idle)
            res = fetch_shares(
                spec.remote_request_id,
                num_tokens,
                plan.shares,
                spec.local_block_ids,
                first_block=spec.first_block,
                layer_groups=self.cfg.layer_groups,
            )
            self._drop_wants(spec)  # released: nothing left to renew
            fig = figures_of(res)
            self._dump_landed(spec, regrouped="src_block_size" in fig)
        except Exception as e:  # noqa: BLE001 - every failure becomes a failed receive
            self._drop_wants(spec)
            fig["error"] = str(e)[:500]
            logger.error(
                "HawkConnector decode: KV pull of %s (remote %s at %s) failed: %s",
                rid,
                spec.remote_request_id,
                spec.side_channel,
                e,
            )
            if isinstance(e, TransferUnsettled) and not self._pulls.settle(rid, e):
                return  # quarantined: the blocks stay with this request, never reused
        fig["total_ms"] = round(1e3 * (time.monotonic() - t0), 3)
        self._pulls.end(rid, fig)
        self._news.set()

    def _dump_landed(self, spec: RecvSpec, regrouped: bool) -> None:
        """``HAWK_DEBUG_DIR``: what a pull landed (Tenstorrent blocks, or the KV of a TP pull
        or of one whose prefill blocks were regrouped)."""
        rid, tag = spec.remote_request_id, f"-r{self.tp_rank}" if self.tp_size > 1 else ""
        if self._debug is not None and self.kv.tt_cache is not None:
            first, self._scanned = not self._scanned, True
            debug.dump_landed(self._debug, rid, self.kv.tt_cache, spec.local_block_ids, scan=first)
        elif (
            self._debug is not None
            and self.kv.views is not None
            and (spec.remote_tp_size * self.tp_size > 1 or regrouped)
        ):
            debug.dump_landed_kv(self._debug, rid + tag, self.kv.views, spec.local_block_ids)

    def _release_only(self, spec: RecvSpec) -> None:
        self._drop_wants(spec)
        try:
            plan = self.planner.plan(spec, connect=False)
        except TPMismatch as e:
            logger.warning("HawkConnector decode: release of %s not sent: %s", spec.remote_request_id, e)
            return
        self._release_ranks(spec, plan.idle)
        for _ep, _sink, ps in plan.shares:
            self._release_rank(spec, ps.prefill_rank, ps.share)

    def _drop_wants(self, spec: RecvSpec) -> None:
        for ep in self.planner.side_channels(spec):
            self.keeper.drop(spec.remote_request_id, ep)

    def _release_ranks(self, spec: RecvSpec, ranks: list[int]) -> None:
        """Release the request on each of prefill ranks ``ranks``, on the pull threads."""
        for r in ranks:
            self._pool.submit(self._release_rank, spec, r)

    def _release_rank(self, spec: RecvSpec, rank: int, share: Share = WHOLE) -> None:
        """Release (D8 without a fetch) ``share`` of the request on prefill rank ``rank``."""
        self.peers.release(
            spec.side_channel_of(rank),
            spec.remote_engine_id,
            spec.remote_request_id,
            rank=rank,
            share=share,
            timeout_s=self.cfg.handshake_timeout_s,
        )

    # ---------------------------------------------------------------- idle check, shutdown
    def snapshot(self) -> dict:
        """What is held right now (all zero when idle): prefill requests and ring bytes,
        decode pulls in flight and receive memory."""
        out: dict = {}
        if self.prefill is not None:
            s = self.prefill.snapshot()
            out["prefill"] = {
                "held": s["requests"],
                "ring_live": s.get("ring_live", 0),
                "ring_used": s.get("ring_used", 0),
                "expired": s["expired"],
                "released": s["released"],
                "renewed": s["renewed"],
            }
        if self.sink is not None:
            d = self._pulls.held()
            if self.sink.caps.snapshot:  # a mesh: the sum over its chips' sinks
                held = [x.holds() for x in self.sinks or [self.sink]]
                d.update({k: sum(h[k] for h in held) for k in ("recv_live", "device_buffers")})
            if self.keeper is not None:
                d["renewing"] = self.keeper.wanted()
                d["heartbeats"] = self.keeper.stats.heartbeats
            d["backpressured"] = sum(p.backpressured for p in self.peers.endpoints())
            out["decode"] = d
        return out

    def shutdown(self) -> None:
        if self.keeper is not None:
            self.keeper.close()
            self.keeper = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.peers.close()
        for part in (self.prefill, *(self.sinks or [self.sink]), self.transport):
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001
                    logger.exception("HawkConnector: shutdown of %s failed", type(part).__name__)
        self.prefill = self.sink = self.transport = self._pool = None
        self.sinks = []
