"""Deprecated alias of :mod:`vllm_hawk.tenstorrent.vllm_tt` (``--worker-cls
vllm_hawk.tt_decode.worker.HawkTTWorker`` keeps working)."""

import warnings

from vllm_hawk.tenstorrent.vllm_tt import WORKER_CLS  # noqa: F401

warnings.warn("vllm_hawk.tt_decode is deprecated: use vllm_hawk.tenstorrent.vllm_tt", FutureWarning, stacklevel=2)
