"""Transfer statistics of HawkConnector and their Prometheus metrics.

Workers record into :class:`HawkKVConnectorStats` (plain lists, serialisable); vLLM
ships them to the API process each step, where :class:`HawkPromMetrics` observes them:

==============================================  =========  ==================================
metric                                          type       meaning
==============================================  =========  ==================================
``vllm:hawk_transfer_time_seconds``             histogram  decode: KVRequest sent -> KV in
                                                           the local blocks (one pull)
``vllm:hawk_kv_ready_seconds``                  histogram  decode: KVRequest sent -> KVReady
                                                           back (the prefill's produce step:
                                                           transform, ring, side channel)
``vllm:hawk_kv_read_seconds``                   histogram  decode: READs submitted -> KV in
                                                           place (transport + staged copies)
``vllm:hawk_transfer_bytes``                    histogram  bytes moved per pull
``vllm:hawk_transfer_segments``                 histogram  segments the prefill described
                                                           per pull (KVReady)
``vllm:hawk_transfer_operations``               histogram  transport entries (READs) per pull
``vllm:hawk_failed_transfers_total``            counter    pulls that failed (any reason)
``vllm:hawk_expired_leases_total``              counter    prefill: held requests freed
                                                           because no decode came in time
``vllm:hawk_released_total``                    counter    prefill: held requests released
                                                           by their decode
``vllm:hawk_refused_input_total``               counter    prefill: side-channel input refused
                                                           (failed authentication, bounded
                                                           tables full, a Release by a decode
                                                           that did not request the id, ...)
==============================================  =========  ==================================
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

_SERIES = ("transfer_s", "kv_ready_s", "read_s", "nbytes", "segments", "operations")
_COUNTS = ("failed", "integrity", "expired", "released", "refused")


@dataclass
class HawkKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: [] for k in _SERIES} | {k: 0 for k in _COUNTS}

    def record_transfer(
        self, seconds: float, nbytes: int, segments: int, operations: int, kv_ready_s: float = 0.0, read_s: float = 0.0
    ) -> None:
        """One pull: ``seconds`` in all, of which ``kv_ready_s`` until KVReady and
        ``read_s`` reading (the stages of the TTFT breakdown, ``hawk bench serve``)."""
        self.data["transfer_s"].append(seconds)
        self.data["kv_ready_s"].append(kv_ready_s)
        self.data["read_s"].append(read_s)
        self.data["nbytes"].append(nbytes)
        self.data["segments"].append(segments)
        self.data["operations"].append(operations)

    def count(self, what: str, n: int = 1) -> None:
        self.data[what] += n

    def clone_and_reset(self) -> HawkKVConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not self.data["transfer_s"] and not any(self.data[k] for k in _COUNTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _SERIES:
            self.data[k].extend(other.data.get(k, []))
        for k in _COUNTS:
            self.data[k] += other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        n = len(self.data["transfer_s"])
        t = sum(self.data["transfer_s"])
        b = sum(self.data["nbytes"])
        return {
            "Num pulls": n,
            "Avg pull time (ms)": round(1e3 * t / n, 3) if n else 0,
            "Avg MB per pull": round(b / n / 2**20, 3) if n else 0,
            "Throughput (MB/s)": round(b / 2**20 / t, 1) if t else 0,
            "Avg ops per pull": round(sum(self.data["operations"]) / n, 1) if n else 0,
            "Failed pulls": self.data["failed"],
            "Integrity failures": self.data["integrity"],
            "Expired leases": self.data["expired"],
            "Refused input": self.data["refused"],
        }


class HawkPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def hist(name, doc, buckets):
            m = self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
            return create_metric_per_engine(m, per_engine_labelvalues)

        def counter(name, doc):
            m = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(m, per_engine_labelvalues)

        seconds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
        self.time = hist(
            "vllm:hawk_transfer_time_seconds", "HawkConnector: time of one KV pull (request to KV in place).", seconds
        )
        self.kv_ready = hist(
            "vllm:hawk_kv_ready_seconds",
            "HawkConnector: KVRequest sent -> KVReady received (the prefill's produce step).",
            seconds,
        )
        self.read = hist(
            "vllm:hawk_kv_read_seconds",
            "HawkConnector: READs submitted -> KV in place (transport and staged copies).",
            seconds,
        )
        self.bytes = hist(
            "vllm:hawk_transfer_bytes", "HawkConnector: bytes per KV pull.", [2 ** (10 + 2 * i) for i in range(12)]
        )
        self.segments = hist(
            "vllm:hawk_transfer_segments",
            "HawkConnector: segments described per KV pull.",
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096],
        )
        self.operations = hist(
            "vllm:hawk_transfer_operations",
            "HawkConnector: transport operations (READs) per KV pull.",
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096],
        )
        self.failed = counter("vllm:hawk_failed_transfers", "HawkConnector: KV pulls that failed.")
        self.integrity = counter(
            "vllm:hawk_integrity_failures",
            "HawkConnector: KV pulls whose landed bytes did not match the prefill's checksums (never served).",
        )
        self.expired = counter(
            "vllm:hawk_expired_leases", "HawkConnector: held prefill requests freed on lease expiry."
        )
        self.released = counter("vllm:hawk_released", "HawkConnector: held prefill requests released by their decode.")
        self.refused = counter(
            "vllm:hawk_refused_input", "HawkConnector: side-channel input refused (authentication, bounds, ownership)."
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for series, metric in (
            ("transfer_s", self.time),
            ("kv_ready_s", self.kv_ready),
            ("read_s", self.read),
            ("nbytes", self.bytes),
            ("segments", self.segments),
            ("operations", self.operations),
        ):
            for v in d.get(series, ()):
                metric[engine_idx].observe(v)
        for key, metric in (
            ("failed", self.failed),
            ("integrity", self.integrity),
            ("expired", self.expired),
            ("released", self.released),
            ("refused", self.refused),
        ):
            if d.get(key):
                metric[engine_idx].inc(d[key])
