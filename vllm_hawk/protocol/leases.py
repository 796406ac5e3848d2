"""The lease heartbeat: keep the prefill's leases of wanted requests alive.

A request the decode has accepted but not yet asked the prefill for (it waits in the
engine's queue, or for a pull thread) must not lose its KV to the prefill's lease
(``lease_s``; before the first heartbeat the prefill's own hand-over hold covers it,
``handover_s``). :class:`LeaseKeeper` remembers those ids per prefill (``want``) until the
pull or the Release takes over (``drop``), and every ``interval_s`` sends each prefill
ONE ``Renew`` naming all of its wanted ids (in chunks of :data:`MAX_RENEW_IDS`), over
the same authenticated side channel as every other message. Ids the prefill answers as
``gone`` are forgotten.

Bounds: at most ``max_wanted`` ids in all (a further ``want`` is refused, counted
``refused``; that request keeps only its lease); an id is renewed for at most
``max_hold_s`` after its ``want`` (the prefill bounds the hold the same way, from its
hand-over). A prefill that cannot be reached is retried at the next interval; its
requests then keep only what is left of their lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_hawk.protocol.messages import MAX_RENEW_IDS
from vllm_hawk.security import RateLimitedLog

logger = logging.getLogger("vllm.hawk.protocol.leases")

MAX_WANTED = 1 << 16  # ids renewed at once, over all prefills


@dataclass
class KeeperStats:
    heartbeats: int = 0  # Renew messages sent
    renewed: int = 0  # leases the prefills reported extended
    gone: int = 0  # ids the prefills no longer held
    failed: int = 0  # heartbeats that got no answer (prefill unreachable, timeout)
    refused: int = 0  # wants refused: max_wanted reached
    timed_out: int = 0  # ids dropped after max_hold_s
    per_peer: dict = field(default_factory=dict)  # key -> heartbeats sent


class LeaseKeeper:
    """One heartbeat thread for every prefill its owner (a decode's worker) talks to.
    Thread-safe.

    connect(key): the object to renew through for prefill ``key`` (anything with
    ``renew(req_ids, timeout_s) -> Renewed``, e.g. a
    :class:`~vllm_hawk.kvflow.DecodeEndpoint`); called from the heartbeat thread, may
    raise. interval_s: seconds between two heartbeats to one prefill (keep it well below
    the prefill's ``lease_s``); max_hold_s: longest renewal of one id (0 = no bound).
    """

    def __init__(
        self,
        connect: Callable[[str], object],
        interval_s: float,
        *,
        max_hold_s: float = 600.0,
        max_wanted: int = MAX_WANTED,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"LeaseKeeper interval_s={interval_s!r} must be > 0")
        self.connect, self.interval_s, self.max_hold_s, self.max_wanted = connect, interval_s, max_hold_s, max_wanted
        self.stats = KeeperStats()
        self._lock = threading.Lock()
        self._wanted: dict[str, dict[str, float]] = {}  # key -> {req_id: monotonic time of want}
        self._n = 0
        self._rlog = RateLimitedLog(logger)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hawk-lease-keeper")
        self._thread.start()

    def want(self, key: str, req_id: str) -> bool:
        """Renew ``req_id``'s lease at prefill ``key`` until :meth:`drop`. False: refused
        (``max_wanted`` ids are renewed already)."""
        with self._lock:
            ids = self._wanted.setdefault(key, {})
            if req_id in ids:
                return True
            if self._n >= self.max_wanted:
                self.stats.refused += 1
                if not ids:
                    del self._wanted[key]
                full = True
            else:
                ids[req_id] = time.monotonic()
                self._n += 1
                full = False
        if full:
            self._rlog(
                "full", "lease keeper: %d ids renewed already; %s keeps only its lease", self.max_wanted, req_id[:64]
            )
        return not full

    def drop(self, req_id: str, key: str | None = None) -> None:
        """Stop renewing ``req_id`` (at ``key``, or at every prefill)."""
        with self._lock:
            for k in [key] if key is not None else list(self._wanted):
                ids = self._wanted.get(k)
                if ids is not None and ids.pop(req_id, None) is not None:
                    self._n -= 1
                    if not ids:
                        del self._wanted[k]

    def wanted(self) -> int:
        with self._lock:
            return self._n

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the heartbeat must keep running
                logger.exception("lease keeper: heartbeat failed")

    def beat(self) -> None:
        """One heartbeat: a Renew (per :data:`MAX_RENEW_IDS` ids) to each prefill with
        wanted ids. Runs in the keeper's thread every ``interval_s``; callable directly."""
        now = time.monotonic()
        with self._lock:
            plan = {}
            for key, ids in list(self._wanted.items()):
                if self.max_hold_s:
                    old = [r for r, t in ids.items() if now - t > self.max_hold_s]
                    for r in old:
                        del ids[r]
                    self._n -= len(old)
                    self.stats.timed_out += len(old)
                    if not ids:
                        del self._wanted[key]
                        continue
                plan[key] = list(ids)
        for key, ids in plan.items():
            if self._stop.is_set():
                return
            try:
                ep = self.connect(key)
                for i in range(0, len(ids), MAX_RENEW_IDS):
                    out = ep.renew(ids[i : i + MAX_RENEW_IDS], timeout_s=self.interval_s)
                    with self._lock:
                        self.stats.heartbeats += 1
                        self.stats.per_peer[key] = self.stats.per_peer.get(key, 0) + 1
                        self.stats.renewed += out.renewed
                        self.stats.gone += len(out.gone)
                    for r in out.gone:
                        self.drop(r, key)
            except Exception as e:  # noqa: BLE001 - retried at the next interval
                with self._lock:
                    self.stats.failed += 1
                self._rlog(
                    f"fail-{key}",
                    "lease keeper: heartbeat to %s failed (%s: %s); %d request(s) keep "
                    "only their lease until the next one",
                    key,
                    type(e).__name__,
                    e,
                    len(ids),
                )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
