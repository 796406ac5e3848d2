"""``HawkConnector``: the facade vLLM instantiates (once per role).

It validates ``kv_connector_extra_config`` (:mod:`vllm_hawk.connector.config`) and
delegates: scheduler-side calls to :class:`HawkConnectorScheduler`, worker-side calls to
:class:`HawkConnectorWorker`. Pull design (like vLLM's NixlConnector): the prefill keeps
a finished request's blocks and returns ``kv_transfer_params``; the decode's worker
pulls them and tells the prefill to release them (``docs/architecture.md``).

Timing contracts (vLLM 0.32): ``on_new_request`` once per request as it enters the
queue; ``build_connector_meta`` once per scheduler step;
``start_load_kv`` once per worker step (also in steps without a forward pass);
``get_transfer_results`` once per worker step; ``request_finished`` once per request.
vLLM 0.25.1 (a Tenstorrent decode) asks ``get_finished`` and then
``get_block_ids_with_load_errors`` instead of ``get_transfer_results``
(:mod:`~vllm_hawk.connector.vllm_compat` lists every difference).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_hawk.connector.config import parse_config
from vllm_hawk.connector.metadata import HawkConnectorMetadata
from vllm_hawk.connector.scheduler import HawkConnectorScheduler
from vllm_hawk.connector.stats import HawkKVConnectorStats, HawkPromMetrics
from vllm_hawk.connector.vllm_compat import CacheHitSource, to_vllm_results
from vllm_hawk.connector.worker import HawkConnectorWorker

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk." + __name__.rsplit(".", 1)[-1])


class HawkConnector(KVConnectorBase_V1):
    if CacheHitSource is not None:  # vLLM >= 0.32: external hits are peer-to-peer
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError(
                "HawkConnector supports pipeline_parallel_size 1 only (tensor parallelism of any size on both sides)"
            )
        dp_rank = getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0
        side = "prefill" if ktc.is_kv_producer else "decode"
        self.cfg = parse_config(ktc.kv_connector_extra_config, dp_rank=dp_rank, side=side)
        self.engine_id = ktc.engine_id or "hawk"
        self.connector_scheduler: HawkConnectorScheduler | None = None
        self.connector_worker: HawkConnectorWorker | None = None
        self._load_errors: set[int] = set()  # vLLM 0.25.1: failed pulls' blocks until asked
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = HawkConnectorScheduler(vllm_config, self.engine_id, self.cfg)
        else:
            self.connector_worker = HawkConnectorWorker(vllm_config, self.cfg, ktc.is_kv_producer, ktc.is_kv_consumer)

    # ================================================================ scheduler side
    def on_new_request(self, request: Request) -> None:
        self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, HawkConnectorMetadata):
            self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Pulls complete before the request is scheduled: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Pull design: the prefill never pushes."""

    def wait_for_save(self) -> None:
        """Pull design: nothing to flush."""

    def get_transfer_results(self, finished_req_ids: set[str]):
        """vLLM >= 0.32: finished sends and receives, failed receives by request."""
        return to_vllm_results(self.connector_worker.get_transfer_results())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.25.1: finished sends and receives (failed ones included); the failed
        receives' blocks go to :meth:`get_block_ids_with_load_errors`, asked in the same step."""
        r = self.connector_worker.get_transfer_results()
        self._load_errors |= r.failed_blocks
        return r.finished_sending, r.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self):
        return self.connector_worker.build_worker_meta() if self.connector_worker else None

    def get_kv_connector_stats(self):
        return self.connector_worker.get_stats() if self.connector_worker else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return HawkKVConnectorStats(data=data) if data is not None else HawkKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HawkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
