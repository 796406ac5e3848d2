"""The decode's pull results, from the pull threads to vLLM's ``get_transfer_results``.

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

import logging
import threading

from vllm_hawk.connector.stats import HawkKVConnectorStats
from vllm_hawk.kvflow import FetchResult, TransferUnsettled
from vllm_hawk.kvflow.decode import SETTLE_LIMIT_S

# The worker side's log: under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk.worker")

__all__ = ["PullResults", "figures_of"]


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

    def begin(self, rid: str) -> None:
        with self._lock:
            self.inflight.add(rid)

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

    def has_results(self) -> bool:
        """A pull ended since the last take; the caller holds the lock."""
        return bool(self.finished)

    def take(self) -> tuple[set[str], set[str], dict[str, dict]]:
        """(finished, failed, figures) since the last take; the caller holds the lock."""
        out = self.finished, self.failed, self.figures
        self.finished, self.failed, self.figures = set(), set(), {}
        return out

    def held(self) -> dict:
        """The snapshot's counts: pulls in flight and quarantined."""
        with self._lock:
            return {"inflight": len(self.inflight), "quarantined": len(self.quarantined)}
