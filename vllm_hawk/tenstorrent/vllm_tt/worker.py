"""The HAWK decode worker on vllm-tt-plugin: ``--worker-cls vllm_hawk.tenstorrent.vllm_tt.worker.HawkTTWorker``.

vllm-tt-plugin's ``TTWorker`` never initialises KV transfer (its platform sets the worker
class only when it is ``"auto"``, so this one is chosen with vLLM's ``--worker-cls``). On
top of it, as vLLM's own GPU and CPU workers do:

* ``init_device``: lane mode is refused (its scheduler has no KV connector); the plugin
  opens the mesh and builds its runner; then a one-rank distributed environment (world and
  tensor-parallel groups of size 1, gloo): the connector's factory reads the TP group. The runner becomes
  :class:`~vllm_hawk.tenstorrent.vllm_tt.model_runner.HawkTTModelRunner` (the connector's per-step hooks);
* ``initialize_from_config``: the KV connector is created (``ensure_kv_transfer_initialized``),
  the plugin's runner allocates the cache through the model (``allocate_kv_cache``), then
  the cache the model returned is described per chip by the addresses of its ttnn tensors
  (:class:`~vllm_hawk.tenstorrent.vllm_tt.kv_cache.TTNNMeshKVCache`, every chip checked against the
  connector's ``device_profile``: a mismatch names the profile field); the landing route is
  chosen (:mod:`vllm_hawk.tenstorrent.vllm_tt.landing`: the NIC through tt-kmd windows into
  the KV pages or receive buffers, else the host staging the bytes; logged with the reason
  when it is not the mode asked for), the cache registered for the connector
  (:mod:`vllm_hawk.tenstorrent.registry`) and handed to it (``register_kv_caches``): its sink
  allocates the per-bank receive buffers now, before ``compile_or_warm_up_model`` captures
  any trace;
* ``shutdown``: the connector first (it frees its receive buffers and stops its threads),
  then the mesh.

Without a ``--kv-transfer-config`` it is the plugin's worker, unchanged.
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
from vllm_tt_plugin.worker import TTWorker, close_mesh_device

from vllm_hawk.connector.config import parse_config
from vllm_hawk.npu.ttnn_chip import TTNNChip
from vllm_hawk.tenstorrent import registry
from vllm_hawk.tenstorrent.kv_accuracy import log_kv_dtype
from vllm_hawk.tenstorrent.vllm_tt import WORKER_CLS
from vllm_hawk.tenstorrent.vllm_tt.kv_cache import TTNNMeshKVCache
from vllm_hawk.tenstorrent.vllm_tt.landing import chip_links, choose_landing, nic_chips
from vllm_hawk.tenstorrent.vllm_tt.model_runner import HawkTTModelRunner

__all__ = ["HawkTTWorker", "WORKER_CLS"]

logger = logging.getLogger("vllm.hawk.tt_decode")
#: where a vllm-tt-plugin decode's KV tile format comes from: the model allocates its cache
KV_DTYPE_SOURCE = "the model's cache; tt_transformers: bfloat8_b, or bfloat16 with optimizations 'accuracy'"


def _one_rank_groups(worker) -> None:
    """vLLM's world and model-parallel groups of one rank (gloo), as its CPU worker makes
    them. vLLM names an out-of-tree platform's group device after the platform (``tt:0``),
    a device type torch does not know (the plugin registers none, and naming torch's
    ``privateuse1`` slot after it breaks torch.compile'd host sampling); a one-rank group
    moves no tensor, so its device is the CPU while the groups are built."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    current_platform.is_out_of_tree = lambda: False
    try:
        init_worker_distributed_environment(
            worker.vllm_config, worker.rank, worker.distributed_init_method, worker.local_rank, "gloo"
        )
    finally:
        del current_platform.is_out_of_tree


def refuse_lane_mode(vllm_config) -> None:
    """vllm-tt-plugin's lane mode (``tt_data_parallel`` > 1 submeshes in one engine) runs its
    ``TTLaneCoordinator`` scheduler, whose ``get_kv_connector()`` returns None: no KV
    connector hook would ever run. Refused when a KV connector is configured."""
    if vllm_config.kv_transfer_config is None:
        return
    from vllm_tt_plugin.config import get_tt_data_parallel_size, uses_tt_lane_coordinator

    if uses_tt_lane_coordinator(vllm_config):
        raise ValueError(
            f"--kv-transfer-config with vllm-tt-plugin's lane mode (tt data parallel "
            f"{get_tt_data_parallel_size(vllm_config)} over submeshes, e.g. a Galaxy): its TTLaneCoordinator has "
            "no KV connector (get_kv_connector() returns None), so HawkConnector cannot serve it; run one decode "
            "server per submesh (tt data parallel 1) instead"
        )


class HawkTTWorker(TTWorker):
    """vllm-tt-plugin's worker with HawkConnector's decode side (see module doc)."""

    hawk_cache: TTNNMeshKVCache | None = None

    def init_device(self) -> None:
        refuse_lane_mode(self.vllm_config)
        super().init_device()
        _one_rank_groups(self)
        HawkTTModelRunner.adopt(self.model_runner)

    def initialize_from_config(self, kv_cache_config) -> None:
        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        super().initialize_from_config(kv_cache_config)
        if has_kv_transfer_group():
            self._hand_cache_to_connector()

    def _hand_cache_to_connector(self) -> None:
        cfg = parse_config(self.vllm_config.kv_transfer_config.kv_connector_extra_config)
        mesh, profile = self.mesh_device, cfg.device_profile
        cache = self._describe([TTNNChip(mesh, profile, c) for c in range(mesh.get_num_devices())])
        links = chip_links(mesh)
        try:
            route = choose_landing(cache, cfg, links)
            if route.path != "host-staged":  # the NIC writes DRAM through tt-kmd windows
                cache.close()
                cache = self._describe(nic_chips(mesh, profile, links, route))
        except BaseException:
            cache.close()
            raise
        cache.route = route
        self.hawk_cache = cache
        registry.register(self.vllm_config, cache)
        chip = cache.chips[0]
        logger.info(
            "HAWK Tenstorrent decode: KV cache of %d layers x (K, V) x %d blocks on %d %s chip(s), %s tiles, "
            "%d of %d KV heads per chip, K0 at 0x%x",
            cache.spec.num_layers,
            cache.spec.num_blocks,
            cache.num_chips,
            profile,
            cache.spec.dtype,
            chip.spec.num_kv_heads,
            cache.num_kv_heads,
            chip.layout.addresses[0][0],
        )
        log_kv_dtype(logger, cache.spec.dtype, KV_DTYPE_SOURCE)  # a lossy format beyond the accuracy contract
        logger.info("HAWK Tenstorrent decode: landing route %s", route.describe())
        get_kv_transfer_group().register_kv_caches({})

    def _describe(self, chips) -> TTNNMeshKVCache:
        return TTNNMeshKVCache(
            chips, self.model_runner.kv_caches, self.model_config.get_total_num_kv_heads(), self.cache_config.block_size
        )

    def get_kv_connector_handshake_metadata(self) -> dict | None:
        """The connector's out-of-band handshake metadata keyed by ``(pp_rank, tp_rank)``,
        as vLLM's GPU worker answers the engine (HawkConnector has none: its handshake is
        its own side channel)."""
        if not has_kv_transfer_group():
            return None
        metadata = get_kv_transfer_group().get_handshake_metadata()
        return None if metadata is None else {(0, 0): metadata}

    def shutdown(self) -> None:
        """The connector, then the cache description, then the mesh (see module doc)."""
        ensure_kv_transfer_shutdown()
        logger.info("HAWK Tenstorrent decode: KV connector shut down; closing the mesh")
        if self.hawk_cache is not None:
            registry.unregister(self.vllm_config)
            devices = [c.device for c in self.hawk_cache.chips]
            self.hawk_cache.close()
            for dev in devices:  # a NIC path's chips hold their tt-kmd fd and windows
                dev.close()
            self.hawk_cache = None
        mesh, self.mesh_device = self.mesh_device, None
        if mesh is not None:
            runner = getattr(self, "model_runner", None)
            if runner is not None:
                runner.kv_caches = None
                del self.model_runner
            close_mesh_device(mesh, self._tt_config())
        super().shutdown()

    def _tt_config(self):
        from vllm_tt_plugin.config import get_tt_config

        return get_tt_config(self.vllm_config)
