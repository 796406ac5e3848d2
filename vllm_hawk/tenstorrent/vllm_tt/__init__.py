"""The HAWK decode on Tenstorrent's own vLLM platform plugin (vllm-tt-plugin, vLLM 0.25.1).

A Tenstorrent decode node serves its model with vllm-tt-plugin and HawkConnector; this
package is what joins them (docs/tenstorrent.md):

* :mod:`.worker`: ``HawkTTWorker``, the plugin's worker with KV transfer (select it with
  ``--worker-cls`` :data:`WORKER_CLS`);
* :mod:`.model_runner`: the plugin's model runner with the connector's per-step hooks;
* :mod:`.kv_cache`: the model's paged KV cache described per chip for the connector's sink
  (:class:`~vllm_hawk.tenstorrent.kv_cache.MeshKVCache`), each chip a
  :class:`~vllm_hawk.npu.ttnn_chip.TTNNChip` (the only way vllm_hawk reaches a Tenstorrent
  device through ttnn).

Only :mod:`.kv_cache` imports without vllm-tt-plugin (numpy and ttnn).
"""

#: the value of vLLM's ``--worker-cls`` on a Tenstorrent decode node
WORKER_CLS = "vllm_hawk.tenstorrent.vllm_tt.worker.HawkTTWorker"
