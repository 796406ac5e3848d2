"""Benchmark (and test) wiring of :mod:`vllm_hawk.kvflow` around torch caches (no vLLM).

Nothing here moves bytes on its own: each helper builds the same sources, sinks and
endpoints the connector builds, and calls them.

* :func:`prefill_endpoint` — a :class:`~vllm_hawk.kvflow.PrefillEndpoint` over a
  :class:`~vllm_hawk.bench.paged_cache.PagedKVCache` with the connector's source
  (:func:`source_for`) for ``kind``: ``hawk`` (tile transform), ``staged`` (ring gather)
  or ``vllm`` (blocks in place), each serving any head range (shares of a tensor-parallel
  pull);
* :class:`TTDecode` — an emulated Tenstorrent KV pool, one sink per mode over it and a
  :class:`~vllm_hawk.kvflow.DecodeEndpoint`;
* :class:`VllmDecode` — a vLLM-layout decode cache with its sink and endpoint;
* :class:`GNHostDecode` — the GN-Host baseline: an emulated Tenstorrent KV pool fed
  vLLM-layout blocks, with the runtime :class:`~vllm_hawk.kvflow.GNHostSink`.
"""

from __future__ import annotations

from vllm_hawk.connector.config import VLLM_PROFILE, HawkConfig
from vllm_hawk.connector.describe import LocalKV
from vllm_hawk.connector.strategies import make_source
from vllm_hawk.kvflow import DecodeEndpoint, GNHostSink, PrefillEndpoint, TTSink, vllm_sink
from vllm_hawk.kvflow.regroup import Regroup
from vllm_hawk.kvflow.sinks import layout_desc
from vllm_hawk.kvflow.streams import head_maps
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec

#: the bench's source kinds -> the connector configuration whose prefill serves each
#: (:func:`vllm_hawk.connector.strategies.make_source`): GN-HAWK's tile transform, the
#: staged ring gather, vLLM's blocks in place
SOURCE_KINDS = {
    "hawk": {"layout_fix": "prefill"},
    "staged": {"mode": "staged", "device_profile": VLLM_PROFILE},
    "vllm": {"mode": "direct", "device_profile": VLLM_PROFILE},
}


def source_for(cache, kind: str, device_profile: str | None = "p150a"):
    """The connector's prefill source of ``kind`` (:data:`SOURCE_KINDS`) over ``cache`` (a
    :class:`~vllm_hawk.bench.paged_cache.PagedKVCache`); ``device_profile``: the
    Tenstorrent device a ``hawk`` source converts for."""
    if kind not in SOURCE_KINDS:
        raise ValueError(f"source kind must be one of {tuple(SOURCE_KINDS)}, got {kind!r}")
    cfg = HawkConfig(**{"device_profile": device_profile or "p150a", **SOURCE_KINDS[kind]})
    kv = LocalKV(
        None,
        cache.desc,
        cache.region_map,
        cache.storages,
        cache.kv_views() if kind == "hawk" else None,  # what the transform reads (strided layouts only)
        heads=head_maps(cache.layers),
        caches=cache.layers,
    )
    return make_source(cfg, kv)


def prefill_endpoint(cache, transport, compat, kind: str = "hawk", **kw) -> PrefillEndpoint:
    """A prefill endpoint serving ``cache`` (keyword arguments go to PrefillEndpoint)."""
    return PrefillEndpoint(
        source_for(cache, kind, compat.device_profile if kind == "hawk" else None), transport, compat, **kw
    )


class _Endpoint:
    ep: DecodeEndpoint

    @property
    def client(self):
        return self.ep.client

    @property
    def peer(self) -> str:
        return self.ep.peer

    @property
    def export_base(self) -> int:
        return self.ep.hello.export_base_addr

    @property
    def export_nbytes(self) -> int:
        return self.ep.hello.export_nbytes

    @property
    def quarantined(self) -> list[str]:
        return self.ep.quarantined

    def pending_frees(self) -> int:
        return self.ep.pending_frees()


class TTDecode(_Endpoint):
    """A decode with a Tenstorrent KV pool (``spec``) on ``device`` (emulated here).

    Sinks are made per mode on first use (``staged`` owns a receive pool of
    ``recv_nbytes_per_bank``, or uses ``pool``; ``direct`` and ``per_tile`` register the KV pages, one of
    them at a time). Freed at :meth:`close`; a failing ``__init__`` frees the pool."""

    def __init__(
        self,
        device,
        spec: TTKVCacheSpec,
        transport,
        endpoint: str,
        compat,
        *,
        secret=None,
        auth=None,
        recv_nbytes_per_bank: int = 16 << 20,
        pool=None,
        timeout_s: float = 10.0,
        claim_wait_s: float = 5.0,
        registration: str = "per_request",
        integrity: bool = True,
    ) -> None:
        self.device, self.transport, self.recv, self.shared_pool = device, transport, recv_nbytes_per_bank, pool
        self.registration = registration
        self.sinks: dict[str, TTSink] = {}
        self.ep = None
        self.layout, self.bufs = device.allocate_kv_cache(spec)
        try:
            if recv_nbytes_per_bank:
                self.sink("staged")
            self.ep = DecodeEndpoint(
                transport,
                endpoint,
                compat,
                secret=secret,
                auth=auth,
                pull_timeout_s=timeout_s,
                claim_wait_s=claim_wait_s,
                integrity=integrity,
            )
        except BaseException:
            self.close()
            raise

    @property
    def desc(self):
        """The pool's LayoutDesc (what a KVRequest carries)."""
        return layout_desc(self.layout)

    @property
    def pool(self):
        return self.sinks["staged"].pool if "staged" in self.sinks else None

    def sink(self, mode: str) -> TTSink:
        if mode not in self.sinks:
            for other in ("direct", "per_tile"):
                if mode != "staged" and other in self.sinks:
                    self.sinks.pop(other).close()
            self.sinks[mode] = TTSink(
                self.device,
                self.layout,
                self.bufs,
                self.transport,
                mode,
                recv_nbytes_per_bank=self.recv,
                pool=self.shared_pool,
                registration=self.registration,
            )
        return self.sinks[mode]

    def fetch(self, req_id: str, num_tokens: int, dst_blocks, mode: str = "staged", **kw):
        return self.ep.fetch(req_id, num_tokens, self.sink(mode), dst_blocks, **kw)

    def read_blocks(self, layer: int, kv: int, blocks):
        """Bytes of whole KV-pool blocks of tensor (layer, K=0|V=1): uint8 [tiles, tile_nbytes]."""
        return self.device.read_tiles(self.layout, layer, kv, self.layout.block_tiles(blocks))

    def close(self) -> None:
        if self.ep is not None:
            self.ep.close()
            self.ep = None
        for s in self.sinks.values():
            s.close()
        self.sinks = {}
        for b in self.bufs:
            self.device.free_buffer(b)
        self.bufs = []


class VllmDecode(_Endpoint):
    """A decode with a vLLM-layout cache (``PagedKVCache``): GG-Direct (``direct``) or
    GG-Host / staged (``staged``: receive ring of ``recv_nbytes``)."""

    def __init__(
        self,
        cache,
        transport,
        endpoint: str,
        compat,
        *,
        mode: str = "direct",
        secret=None,
        auth=None,
        timeout_s: float = 10.0,
        recv_nbytes: int = 64 << 20,
        registration: str = "per_request",
        integrity: bool = True,
    ) -> None:
        self.cache = cache
        regroup = Regroup([cache.adapter] * cache.num_layers, cache.layers)  # a prefill with smaller blocks
        self.sink = vllm_sink(
            cache.region_map, cache.desc, transport, mode, cache.storages, recv_nbytes, registration, regroup
        )
        try:
            self.ep = DecodeEndpoint(
                transport, endpoint, compat, secret=secret, auth=auth, pull_timeout_s=timeout_s, integrity=integrity
            )
        except BaseException:
            self.sink.close()
            raise

    def fetch(self, req_id: str, num_tokens: int, dst_blocks, **kw):
        return self.ep.fetch(req_id, num_tokens, self.sink, dst_blocks, **kw)

    def close(self) -> None:
        self.ep.close()
        self.sink.close()


class GNHostDecode(_Endpoint):
    """GN-Host: a Tenstorrent KV pool (``spec``) on ``device`` whose KV arrives as the
    prefill's vLLM blocks (``wire``: their layout, e.g. ``wire_layout_of(cache.adapter,
    cache.layers[0])``) in a receive ring of ``recv_nbytes``, fixed up on this side by
    :class:`~vllm_hawk.kvflow.GNHostSink`. Freed at :meth:`close`."""

    def __init__(
        self,
        device,
        spec: TTKVCacheSpec,
        transport,
        endpoint: str,
        compat,
        wire,
        *,
        secret=None,
        auth=None,
        recv_nbytes: int = 64 << 20,
        timeout_s: float = 10.0,
        claim_wait_s: float = 5.0,
        registration: str = "per_request",
        layout=None,
        bufs=None,
        integrity: bool = True,
    ) -> None:
        self.device, self.sink, self.ep = device, None, None
        self._own = layout is None
        self.layout, self.bufs = (layout, list(bufs)) if layout is not None else device.allocate_kv_cache(spec)
        try:
            self.sink = GNHostSink(device, self.layout, self.bufs, transport, wire, recv_nbytes, registration)
            self.ep = DecodeEndpoint(
                transport,
                endpoint,
                compat,
                secret=secret,
                auth=auth,
                pull_timeout_s=timeout_s,
                claim_wait_s=claim_wait_s,
                integrity=integrity,
            )
        except BaseException:
            self.close()
            raise

    def fetch(self, req_id: str, num_tokens: int, dst_blocks, **kw):
        return self.ep.fetch(req_id, num_tokens, self.sink, dst_blocks, **kw)

    def read_blocks(self, layer: int, kv: int, blocks):
        """Bytes of whole KV-pool blocks of tensor (layer, K=0|V=1): uint8 [tiles, tile_nbytes]."""
        return self.device.read_tiles(self.layout, layer, kv, self.layout.block_tiles(blocks))

    def close(self) -> None:
        if self.ep is not None:
            self.ep.close()
            self.ep = None
        if self.sink is not None:
            self.sink.close()
            self.sink = None
        if self._own:
            for b in self.bufs:
                self.device.free_buffer(b)
        self.bufs = []
