"""Deprecated alias: ``--worker-cls vllm_hawk.tenstorrent.vllm_tt.worker.HawkTTWorker``."""

from vllm_hawk.tenstorrent.vllm_tt.worker import HawkTTWorker  # noqa: F401
