"""The proxy's Prometheus metrics (``GET /metrics``): where a request's TTFT goes, as
the proxy sees it. Per request, in seconds:

=========================================  ==============================================
metric                                     meaning
=========================================  ==============================================
``hawk_proxy_prefill_seconds``             prefill request sent -> its answer read (the
                                           prefill's queue and compute, KV kept)
``hawk_proxy_decode_first_chunk_seconds``  decode request sent -> first streamed chunk
                                           (the decode's queue, KV pull, first step)
``hawk_proxy_ttft_seconds``                request received -> first chunk relayed to
                                           the client (streaming requests only)
``hawk_proxy_requests_total``              requests by answer: ``ok`` (200), ``error``
``hawk_proxy_clients_evicted_total``       client connections dropped, before they sent a
                                           request, to keep fds free at the fd bound
``hawk_proxy_prefills_total``              requests by where their prompt was prefilled
                                           (``where``: ``local`` on the decode, ``remote``
                                           on a prefill) and why (``reason``:
                                           :mod:`vllm_hawk.proxy.decide`)
``hawk_proxy_tokenize_seconds``            a decode's ``/tokenize`` round trip (counting a
                                           prompt for the decode-first rules)
``hawk_proxy_tokenize_fallbacks_total``    ``/tokenize`` round trips that failed (``cause``:
                                           ``timeout``, ``error``): the request went P/D
``hawk_proxy_prefix_record_blocks``        block hashes in the prefix record now
=========================================  ==============================================

Each proxy has its own registry, so several can run in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
TOKENIZE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ProxyMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

        def hist(name: str, doc: str, buckets: tuple = BUCKETS_S) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.prefill = hist("hawk_proxy_prefill_seconds", "Prefill request sent -> its answer read.")
        self.decode_first_chunk = hist(
            "hawk_proxy_decode_first_chunk_seconds", "Decode request sent -> first streamed chunk."
        )
        self.ttft = hist("hawk_proxy_ttft_seconds", "Request received -> first chunk relayed to the client.")
        self.requests = Counter("hawk_proxy_requests", "Requests by outcome.", ["outcome"], registry=self.registry)
        self.clients_evicted = Counter(
            "hawk_proxy_clients_evicted",
            "Client connections dropped at the fd bound before they sent a request.",
            registry=self.registry,
        )
        self.prefills = Counter(
            "hawk_proxy_prefills",
            "Requests by where their prompt was prefilled.",
            ["where", "reason"],
            registry=self.registry,
        )
        self.tokenize = hist("hawk_proxy_tokenize_seconds", "A decode's /tokenize round trip.", TOKENIZE_BUCKETS_S)
        self.tokenize_fallbacks = Counter(
            "hawk_proxy_tokenize_fallbacks",
            "/tokenize round trips that failed; the request went P/D.",
            ["cause"],
            registry=self.registry,
        )
        self.record_blocks = Gauge(
            "hawk_proxy_prefix_record_blocks", "Block hashes in the prefix record.", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
