"""The KV-connector API differences between the vLLM versions HawkConnector runs on.

Prefill nodes run vLLM 0.32 (CPU and GPU builds); a Tenstorrent decode runs 0.25.1, the
version vllm-tt-plugin pins. What differs in the connector API, and how each is handled
(tests/tt_decode/test_vllm_api_0_25.py checks every row on 0.25.1):

========================================  =====================  ================================
0.32                                      0.25.1                 handled by
========================================  =====================  ================================
``KVConnectorTransferResults`` and        absent: the runner     :class:`TransferResults` here;
``get_transfer_results`` (finished        calls ``get_finished`` ``HawkConnector.get_finished``
sends/receives + ``failed_recving``)      only                   returns the same sets
``KVConnectorOutput.failed_recving``      absent: a failed load  ``get_finished`` records the
(a failed receive, by request)            is reported as its     failed pulls' local blocks,
                                          blocks in              ``get_block_ids_with_load_errors``
                                          ``invalid_block_ids``  returns them in the same step
``vllm.v1.metrics.cache_hit_source``      absent                 :data:`CacheHitSource` is None;
(``_cache_hit_source``)                                          the attribute is set only on 0.32
``get_loaded_kv_cache_group_ids``,        absent (never called)  defined; unused on 0.25.1
``get_external_cache_hit_sources``,
``requires_kv_delivery``,
``bind_kv_cache_manager``,
``finish_forward``, ``has_pending_block_frees``
``SchedulerOutput.has_sync_kv_loads``:    ``start_load_kv``      HawkConnector loads are all
async loads start after the forward       always before it       asynchronous: same result
``prefer_cross_layer_blocks`` /           0.25.1 only            not overridden (False: vLLM
``register_cross_layers_kv_cache``                               never calls the latter)
``KVConnectorStats.to_dict``              absent                 not used; stats travel as
                                                                 ``data`` on both
========================================  =====================  ================================

The same on both (checked there too): the constructor ``(vllm_config, role,
kv_cache_config)``, the scheduler hooks (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
``request_finished(request, block_ids)``), ``KVConnectorMetadata``,
``KVConnectorWorkerMetadata`` + ``build_connector_worker_meta``, ``kv_load_failure_policy``,
``RequestStatus`` (``WAITING_FOR_REMOTE_KVS``, ``FINISHED_LENGTH_CAPPED``, ...), and the
scheduler's handling of a full remote hit (the decode recomputes the last prompt token).

Nothing here changes what crosses the wire: the side channel is ours
(:mod:`vllm_hawk.protocol`), and its handshake names both sides' vLLM versions
(:func:`vllm_hawk.protocol.compat.check_vllm_pair`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import vllm

try:  # vLLM >= 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.25.1
    KVConnectorTransferResults = None

try:  # vLLM >= 0.32
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM 0.25.1
    CacheHitSource = None

__all__ = [
    "VLLM_VERSION",
    "HAS_TRANSFER_RESULTS",
    "CacheHitSource",
    "TransferResults",
    "to_vllm_results",
    "transfer_output",
]

VLLM_VERSION: str = vllm.__version__.split("+", 1)[0]
#: the runner asks ``get_transfer_results`` and reads ``failed_recving`` (vLLM >= 0.32)
HAS_TRANSFER_RESULTS = KVConnectorTransferResults is not None


@dataclass
class TransferResults:
    """One step's transfer outcome on any vLLM version (request ids). A failed receive
    is in ``finished_recving`` too (vLLM requires both); ``failed_blocks`` are the local
    blocks of the failed receives (what vLLM 0.25.1 is told)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)


def to_vllm_results(r: TransferResults):
    """vLLM 0.32's ``KVConnectorTransferResults`` of ``r``."""
    return KVConnectorTransferResults(
        finished_sending=r.finished_sending, finished_recving=r.finished_recving, failed_recving=r.failed_recving
    )


def transfer_output(connector, finished_req_ids: set[str]):
    """A ``KVConnectorOutput`` from the worker-side ``connector`` after a step, as the
    running vLLM's own ``KVConnectorModelRunnerMixin`` builds it (for runners that do
    not inherit it: vllm-tt-plugin's)."""
    from vllm.v1.outputs import KVConnectorOutput

    out = KVConnectorOutput()
    if HAS_TRANSFER_RESULTS:
        r = connector.get_transfer_results(finished_req_ids)
        out.finished_sending, out.finished_recving = r.finished_sending, r.finished_recving
        out.failed_recving = r.failed_recving
    else:
        out.finished_sending, out.finished_recving = connector.get_finished(finished_req_ids)
    out.invalid_block_ids = connector.get_block_ids_with_load_errors()
    out.kv_connector_stats = connector.get_kv_connector_stats()
    out.kv_cache_events = connector.get_kv_connector_kv_cache_events()
    out.kv_connector_worker_meta = connector.build_connector_worker_meta()
    return out
