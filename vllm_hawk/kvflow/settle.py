"""Receive memory of a failed READ batch is freed only once the batch has settled (no
entry of it can still write there); one that never settles stays held, quarantined."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("vllm.hawk.kvflow.decode")


class ReceiveFrees:
    """The frees of one :class:`~vllm_hawk.kvflow.decode.DecodeEndpoint`: ``quarantined``
    lists the requests whose receive memory stays held. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0
        self.quarantined: list[str] = []

    def pending(self) -> int:
        """Receive memory waiting (in the background) for its batch to settle."""
        with self._lock:
            return self._pending

    def free_when_settled(
        self, h, req_id: str, free: Callable[[], None], deadline: float, wait_s: float, limit_s: float
    ) -> None:
        """Call ``free`` once batch ``h`` has settled: waiting here up to ``deadline``
        (monotonic) and ``wait_s``, then in a background thread up to ``limit_s`` seconds;
        a batch that never settles leaves it held for good."""
        if h.settled.wait(min(wait_s, max(0.0, deadline - time.monotonic()))):
            free()
            return
        with self._lock:
            self._pending += 1

        def later():
            try:
                if h.settled.wait(limit_s):
                    free()
                else:
                    logger.error(
                        "request %s: its READ batch did not settle within %.1f s; its receive "
                        "memory stays held (quarantined)",
                        req_id,
                        limit_s,
                    )
                    with self._lock:
                        self.quarantined.append(req_id)
            finally:
                with self._lock:
                    self._pending -= 1

        threading.Thread(target=later, daemon=True, name=f"hawk-free-{req_id}").start()
