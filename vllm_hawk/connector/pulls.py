"""The decode's pulls: run on pull threads (:class:`Puller`), their results kept for
vLLM's ``get_transfer_results`` (:class:`PullResults`).

A request's ``RecvSpec`` goes through :meth:`Puller.pull`: the
:class:`~vllm_hawk.kvflow.pull_plan.PullPlanner` gives its shares (per prefill rank: the
endpoint, the share, the sink) and the idle ranks to release, and
:func:`~vllm_hawk.kvflow.shares.fetch_shares` moves them. A request the scheduler gives up
before its pull (``reqs_to_release``) is only released, on every rank that holds it.

A pull is in flight from the step that hands it over until it ends; then it is finished
(and, if it failed, also failed: vLLM requires both) with its figures for
``hawk_transfer``, and counted in the connector's stats. A failed pull whose READs into
this engine's blocks have not drained is held back until they have
(:meth:`PullResults.settle`), or quarantined for good: its blocks are never reported, so
vLLM never reuses them.

Locking: every method but :meth:`~PullResults.take` (whose caller holds it) takes
``lock``, the worker's lock, which also guards the stats (vLLM reads them on the engine
thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from pathlib import Path

from vllm_hawk.connector import debug
from vllm_hawk.connector.affinity import unpin_current_thread
from vllm_hawk.connector.config import HawkConfig
from vllm_hawk.connector.describe import LocalKV
from vllm_hawk.connector.metadata import RecvSpec
from vllm_hawk.connector.peers import PeerPool
from vllm_hawk.connector.stats import HawkKVConnectorStats
from vllm_hawk.kvflow import FetchResult, IntegrityError, LeaseKeeper, TransferUnsettled
from vllm_hawk.kvflow.decode import SETTLE_LIMIT_S, WHOLE, Share
from vllm_hawk.kvflow.pull_plan import PullPlanner
from vllm_hawk.kvflow.shares import fetch_shares
from vllm_hawk.layout.tp import TPMismatch

# The worker side's log: under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk.worker")

__all__ = ["PullResults", "Puller", "figures_of"]


def figures_of(res: FetchResult) -> dict:
    """A successful pull's figures (``hawk_transfer``) from its FetchResult."""
    return dict(
        ok=True,
        nbytes=res.nbytes,
        entries=res.entries,
        segments=res.segments,
        request_ms=round(1e3 * res.request_s, 3),
        transfer_ms=round(1e3 * res.transfer_s, 3),
        copy_ms=round(1e3 * res.copy_s, 3),
        **{k: v for k, v in res.extra.items() if not k.endswith("_s")},
    )


class PullResults:
    """Pulls in flight, ended (until taken) and quarantined (see module doc)."""

    def __init__(self, lock: threading.Lock, stats: HawkKVConnectorStats) -> None:
        self._lock, self._stats = lock, stats
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.figures: dict[str, dict] = {}
        self.inflight: set[str] = set()
        self.quarantined: set[str] = set()
        self._blocks: dict[str, list[int]] = {}  # request -> the local blocks its pull fills

    def begin(self, rid: str, blocks: list[int]) -> None:
        """Pull ``rid`` into local blocks ``blocks`` starts."""
        with self._lock:
            self.inflight.add(rid)
            self._blocks[rid] = list(blocks)

    def end(self, rid: str, fig: dict) -> None:
        """Pull ``rid`` ended with figures ``fig`` (``ok``, and on success the sizes and times)."""
        with self._lock:
            if fig["ok"]:
                self._stats.record_transfer(
                    fig["total_ms"] / 1e3,
                    fig["nbytes"],
                    fig["segments"],
                    fig["entries"],
                    fig["request_ms"] / 1e3,
                    (fig["transfer_ms"] + fig["copy_ms"]) / 1e3,
                )
            else:
                self._stats.count("failed")
                self.failed.add(rid)
            self.finished.add(rid)
            self.inflight.discard(rid)
            self.figures[rid] = fig

    def count(self, what: str) -> None:
        """Count one pull refused before it started (``what``: the stats counter)."""
        with self._lock:
            self._stats.count(what)

    def settle(self, rid: str, e: TransferUnsettled) -> bool:
        """Hold a failed pull's blocks until its READs drained (True), or for good (False)."""
        if e.settled is not None and e.settled.wait(SETTLE_LIMIT_S):
            return True
        logger.error(
            "HawkConnector decode: READs of %s never drained; its blocks %s stay held (quarantined)",
            rid,
            list(e.unsafe_blocks),
        )
        with self._lock:
            self.quarantined.add(rid)
            self.inflight.discard(rid)
        return False

    def take(self) -> tuple[set[str], set[str], dict[str, dict], set[int]]:
        """(finished, failed, figures, the failed pulls' blocks) since the last take; the
        caller holds the lock."""
        out = self.finished, self.failed, self.figures
        self.finished, self.failed, self.figures = set(), set(), {}
        bad: set[int] = set()
        for rid in out[0]:
            blocks = self._blocks.pop(rid, ())
            if rid in out[1]:
                bad.update(blocks)
        return (*out, bad)

    def held(self) -> dict:
        """The snapshot's counts: pulls in flight and quarantined."""
        with self._lock:
            return {"inflight": len(self.inflight), "quarantined": len(self.quarantined)}


class Puller:
    """Pulls and releases on ``cfg.max_pulls`` pull threads, and the lease renewals of the
    requests this decode will pull (the :class:`~vllm_hawk.kvflow.LeaseKeeper`).

    ``news`` is set when a pull ends; ``debug_dir`` (``HAWK_DEBUG_DIR``) receives what each
    pull landed."""

    def __init__(
        self,
        cfg: HawkConfig,
        kv: LocalKV,
        planner: PullPlanner,
        peers: PeerPool,
        results: PullResults,
        news: threading.Event,
        debug_dir: Path | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.cfg, self.kv, self.planner, self.peers = cfg, kv, planner, peers
        self.results, self._news, self._debug = results, news, debug_dir
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._scanned = False  # HAWK_DEBUG_DIR: the whole cache was scanned at the first pull
        self._pool = cf.ThreadPoolExecutor(
            cfg.max_pulls, thread_name_prefix="hawk-pull", initializer=unpin_current_thread
        )
        self.keeper = LeaseKeeper(peers.for_keeper, cfg.renew_interval_s, max_hold_s=cfg.max_hold_s)

    def want(self, spec: RecvSpec) -> None:
        """Renew the request's leases on every prefill rank that holds it until its pull."""
        self.peers.note_engine(spec.side_channel, spec.remote_engine_id)  # for the keeper's messages
        for ep in self.planner.side_channels(spec):
            self.keeper.want(ep, spec.remote_request_id)

    def submit(self, rid: str, spec: RecvSpec) -> None:
        """Pull request ``rid`` (its ``spec``) on a pull thread."""
        self.results.begin(rid, spec.local_block_ids)
        self._pool.submit(self._pull, rid, spec)

    def submit_release(self, spec: RecvSpec) -> None:
        """Release, without a pull, a request the scheduler gave up."""
        self._pool.submit(self._release_only, spec)

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
            if isinstance(e, IntegrityError):  # logged below with the request, chip, segment and bank
                self.results.count("integrity")
            logger.error(
                "HawkConnector decode: KV pull of %s (remote %s at %s) failed: %s",
                rid,
                spec.remote_request_id,
                spec.side_channel,
                e,
            )
            if isinstance(e, TransferUnsettled) and not self.results.settle(rid, e):
                return  # quarantined: the blocks stay with this request, never reused
        fig["total_ms"] = round(1e3 * (time.monotonic() - t0), 3)
        self.results.end(rid, fig)
        self._news.set()

    def _dump_landed(self, spec: RecvSpec, regrouped: bool) -> None:
        """``HAWK_DEBUG_DIR``: what a pull landed (Tenstorrent blocks, or the KV of a TP pull
        or of one whose prefill blocks were regrouped)."""
        if self._debug is None:
            return
        rid, tag = spec.remote_request_id, f"-r{self.tp_rank}" if self.tp_size > 1 else ""
        if self.kv.tt_cache is not None:
            first, self._scanned = not self._scanned, True
            debug.dump_landed(self._debug, rid, self.kv.tt_cache, spec.local_block_ids, scan=first)
        elif self.kv.views is not None and (spec.remote_tp_size * self.tp_size > 1 or regrouped):
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

    def snapshot(self) -> dict:
        """Leases renewed and heartbeats sent (the worker's snapshot adds the rest)."""
        return {"renewing": self.keeper.wanted(), "heartbeats": self.keeper.stats.heartbeats}

    def close(self) -> None:
        """Stop renewing and drop the pulls not started (the ones running end on their own)."""
        self.keeper.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
