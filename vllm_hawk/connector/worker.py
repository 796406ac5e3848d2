"""Worker side of HawkConnector: an adapter from vLLM's worker hooks to Algorithm 1
(:mod:`vllm_hawk.kvflow`; one request's life on each side: ``docs/architecture.md``).

``register_kv_caches`` describes this engine's KV cache and builds the strategies once
(:mod:`~vllm_hawk.connector.strategies`). Prefill: a :class:`~vllm_hawk.kvflow.PrefillEndpoint`
holds each step's ``reqs_to_send``; one the decode released (or whose lease expired) is
reported in ``finished_sending``. Decode: the :class:`~vllm_hawk.connector.pulls.Puller`
renews the leases of ``reqs_to_want`` and runs each pull of ``reqs_to_recv`` on a pull
thread (prefill endpoints from the :class:`~vllm_hawk.connector.peers.PeerPool`);
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

import logging
import threading

from vllm_hawk import envs
from vllm_hawk.connector import debug
from vllm_hawk.connector.affinity import unpinned_threads
from vllm_hawk.connector.config import HawkConfig
from vllm_hawk.connector.describe import LocalKV
from vllm_hawk.connector.metadata import HawkConnectorMetadata, HawkWorkerMeta
from vllm_hawk.connector.peers import PeerPool
from vllm_hawk.connector.pulls import Puller, PullResults
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

# Under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk.worker")


class HawkConnectorWorker:
    """The worker-side object the facade delegates to (see module doc)."""

    def __init__(self, vllm_config, cfg: HawkConfig, is_producer: bool, is_consumer: bool) -> None:
        self.vllm_config, self.cfg = vllm_config, cfg
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.stats = HawkKVConnectorStats()
        self._lock = threading.Lock()  # guards _done, _figures, stats and (inside it) results
        self._done: set[str] = set()  # prefill: finished_sending
        self.results = PullResults(self._lock, self.stats)
        self._figures: dict[str, dict] = {}
        self._counted = {"expired": 0, "released": 0, "refused": 0}
        self.kv: LocalKV | None = None
        self.peers = PeerPool(
            lambda ep: decode_endpoint(self.cfg, self.transport, self.kv, ep),
            on_refused=lambda: self.results.count("refused"),
        )
        self.transport = self.prefill = self.sink = self.puller = None
        self.sinks: list = []  # decode: one per target this worker lands (chips of a mesh), sinks[0] is self.sink
        self._debug = envs.debug_dir()
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
        rank = {"tp_rank": self.tp_rank, "tp_size": self.tp_size}
        planner = make_planner(cfg, kv, self.sinks, self.peers.get, **rank)
        self.puller = Puller(cfg, kv, planner, self.peers, self.results, self._news, self._debug, **rank)

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
        if self.puller is not None:
            for spec in meta.reqs_to_want.values():
                self.puller.want(spec)
            for rid, spec in meta.reqs_to_recv.items():
                self.puller.submit(rid, spec)
            for spec in meta.reqs_to_release.values():
                self.puller.submit_release(spec)

    def get_transfer_results(self) -> TransferResults:
        """What ended since the last call (vLLM version independent, see vllm_compat); in an
        idle step it first waits for news (see the module doc)."""
        res = TransferResults()
        if self._idle_wait_s:  # returns at once when news came since the last clear
            self._news.wait(self._idle_wait_s)
        self._news.clear()
        with self._lock:
            res.finished_sending, self._done = self._done, set()
            res.finished_recving, res.failed_recving, figures, res.failed_blocks = self.results.take()
            self._figures.update(figures)
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
        self._news.set()

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
            d = self.results.held()
            if self.sink.caps.snapshot:  # a mesh: the sum over its chips' sinks
                held = [x.holds() for x in self.sinks or [self.sink]]
                d.update({k: sum(h[k] for h in held) for k in ("recv_live", "device_buffers")})
            if self.puller is not None:
                d.update(self.puller.snapshot())
            d["backpressured"] = sum(p.backpressured for p in self.peers.endpoints())
            out["decode"] = d
        return out

    def shutdown(self) -> None:
        if self.puller is not None:
            self.puller.close()
        self.peers.close()
        for part in (self.prefill, *(self.sinks or [self.sink]), self.transport):
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001
                    logger.exception("HawkConnector: shutdown of %s failed", type(part).__name__)
        self.prefill = self.sink = self.transport = self.puller = None
        self.sinks = []
