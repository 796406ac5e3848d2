"""HAWK's Algorithm 1 between two processes, independent of vLLM.

* :class:`RingBuffer` / :class:`RingAllocator` — the prefill's registered ring (P5, P8)
* :class:`BankBufferPool` — the decode's per-bank receive buffers (D2-D5, D8)
* :class:`PagedKVCache` — a vLLM-layout (FlashAttention NHD) paged KV cache in torch
* :class:`PrefillEndpoint` — P1-P9 over a transport + protocol server
* :class:`DecodeEndpoint` — D1-D8 into an emulated (or real) Tenstorrent KV pool;
  :class:`VllmDecodeEndpoint` — the GG-* / GN-Host baselines' decode side
"""
from vllm_hawk.kvflow.bank_pool import BankBufferPool, RecvSlice
from vllm_hawk.kvflow.decode import (FETCH_MODES, DecodeDevice, DecodeEndpoint, FetchResult, KVPageAddresses,
                                     VllmDecodeEndpoint, layout_desc)
from vllm_hawk.kvflow.errors import BufferFull, KVFlowError, PeerFailed, RingClosed, TransferUnsettled
from vllm_hawk.kvflow.paged_cache import PagedKVCache, block_runs
from vllm_hawk.kvflow.prefill import PrefillEndpoint
from vllm_hawk.kvflow.ring import RingAllocator, RingBuffer

__all__ = ["BankBufferPool", "BufferFull", "DecodeDevice", "DecodeEndpoint", "FETCH_MODES", "FetchResult",
           "KVFlowError", "KVPageAddresses", "PagedKVCache", "PeerFailed", "PrefillEndpoint", "RecvSlice",
           "RingAllocator", "RingBuffer", "RingClosed", "TransferUnsettled", "VllmDecodeEndpoint", "block_runs",
           "layout_desc"]
