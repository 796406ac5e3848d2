"""HAWK's Algorithm 1 between two processes: the one implementation vLLM, the tests and
the benchmarks run. One request's life through these classes, step by step, and the
threads that run each step: ``docs/architecture.md``.

prefill: :class:`PrefillEndpoint` (P1-P9: leases, ring, cancels) serving from a
:mod:`source <vllm_hawk.kvflow.sources>` — :class:`VllmBlockSource` (GG-Direct),
:class:`RingGatherSource` (staged), :class:`TileTransformSource` (GN-HAWK).

decode: :class:`DecodeEndpoint` (D1-D8: deadlines, READ batch, settle/quarantine,
Release) landing in a :mod:`sink <vllm_hawk.kvflow.sinks>` — :class:`VllmPagedSink`,
:class:`VllmStagedSink`, :class:`TTSink` (bank buffers or KV pages), :class:`GNHostSink` (GN-Host: vLLM blocks into
a receive ring, layout fixed on the decode, :mod:`~vllm_hawk.kvflow.gn_host`); a vLLM sink
regroups a prefill's smaller blocks into its own (:mod:`~vllm_hawk.kvflow.regroup`);
:class:`LeaseKeeper` (heartbeats renewing the prefill's leases of queued requests; it lives in
:mod:`vllm_hawk.protocol.leases`, next to the Renew it sends).

buffers: :class:`RingBuffer` (prefill ring, decode receive ring), :class:`BankBufferPool`
(per-bank receive buffers); :mod:`~vllm_hawk.kvflow.streams`: vLLM caches as
:class:`KVRegionMap` and the stream pairing of their block runs.
"""

from vllm_hawk.kvflow.bank_pool import BankBufferPool, RecvSlice
from vllm_hawk.kvflow.base import Capabilities, Prepared
from vllm_hawk.kvflow.decode import WHOLE, DecodeEndpoint, FetchResult, Share
from vllm_hawk.kvflow.errors import (
    BufferFull,
    IntegrityError,
    KVFlowError,
    PeerFailed,
    RingClosed,
    RingTooSmall,
    TransferUnsettled,
)
from vllm_hawk.kvflow.gn_host import GNHostSink, WireLayout
from vllm_hawk.kvflow.prefill import PrefillEndpoint
from vllm_hawk.kvflow.ring import RingAllocator, RingBuffer
from vllm_hawk.kvflow.sinks import (
    SINK_MODES,
    KVPageAddresses,
    KVSink,
    Landing,
    TTSink,
    VllmPagedSink,
    VllmStagedSink,
    layout_desc,
    vllm_sink,
)
from vllm_hawk.kvflow.sources import KVSource, RingGatherSource, TileTransformSource, VllmBlockSource, vllm_layout_desc
from vllm_hawk.kvflow.streams import KVRegionMap, LayerRegion
from vllm_hawk.protocol import LeaseKeeper

__all__ = [
    "BankBufferPool",
    "BufferFull",
    "Capabilities",
    "Prepared",
    "DecodeEndpoint",
    "FetchResult",
    "GNHostSink",
    "IntegrityError",
    "KVFlowError",
    "KVPageAddresses",
    "KVRegionMap",
    "KVSink",
    "KVSource",
    "Landing",
    "LayerRegion",
    "LeaseKeeper",
    "PeerFailed",
    "PrefillEndpoint",
    "RecvSlice",
    "RingAllocator",
    "RingBuffer",
    "RingClosed",
    "RingTooSmall",
    "RingGatherSource",
    "SINK_MODES",
    "Share",
    "TTSink",
    "TileTransformSource",
    "TransferUnsettled",
    "VllmBlockSource",
    "WHOLE",
    "VllmPagedSink",
    "VllmStagedSink",
    "WireLayout",
    "layout_desc",
    "vllm_layout_desc",
    "vllm_sink",
]
