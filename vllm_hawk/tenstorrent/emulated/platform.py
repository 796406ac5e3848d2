"""vLLM platform classes of the Tenstorrent decode plugin.

:class:`TTEmulatedPlatform` subclasses vLLM's ``CpuPlatform``: the model runs in torch
on the host (vLLM's CPU worker and runner), while the KV cache lives in an emulated
Tenstorrent device in the device's paged tile layout and attention reads it there
(:mod:`.attention`, :mod:`.worker`). It is selected by :func:`vllm_hawk.tenstorrent.emulated.register`
(the ``vllm.platform_plugins`` entry point) only when ``HAWK_TT_PLATFORM=emulated``.

Importing this module registers the attention backend name ``HAWK_TT_PAGED`` with vLLM,
which must happen before attention layers are built (vLLM looks the name up in
``AttentionBackendEnum``); vLLM imports the platform class first, so that holds.

Notes for operators: do not set ``VLLM_TARGET_DEVICE=cpu`` together with this plugin
(vLLM then picks its stock CPU platform without asking plugins); ``kv_cache_dtype``
stays ``auto``/``bfloat16`` (the tile format comes from ``HAWK_TT_KV_DTYPE``); block
size defaults to 64 tokens (tt_transformers' examples) and must be a multiple of 32.
"""

from __future__ import annotations

import logging

from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from vllm_hawk.tenstorrent.device import decode_device
from vllm_hawk.tenstorrent.emulated.config import ATTN_BACKEND_NAME as BACKEND_NAME
from vllm_hawk.tenstorrent.emulated.config import ATTN_BACKEND_PATH as BACKEND_PATH
from vllm_hawk.tenstorrent.emulated.config import ENV_DEVICE, TTPluginConfig, kv_dtype_for

logger = logging.getLogger("vllm.hawk.tt_plugin")

DEFAULT_BLOCK_SIZE = 64
WORKER_CLS = "vllm_hawk.tenstorrent.emulated.worker.TTEmulatedWorker"

if BACKEND_NAME not in AttentionBackendEnum.__members__:
    register_backend(BACKEND_NAME, BACKEND_PATH)


class TTEmulatedPlatform(CpuPlatform):
    """CPU compute + emulated Tenstorrent KV cache (see the module docstring)."""

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        device = TTPluginConfig.from_env().device
        return f"tt-emulated-{device}" if device else "tt-emulated"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError("MLA / sparse attention have no Tenstorrent paged backend here")
        if selected_backend is not None and selected_backend != AttentionBackendEnum[BACKEND_NAME]:
            logger.info(
                "attention backend %s ignored: the Tenstorrent platform uses %s", selected_backend, BACKEND_NAME
            )
        return BACKEND_PATH

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        cfg = TTPluginConfig.from_env()
        device = decode_device(vllm_config, cfg.device, ENV_DEVICE)  # refuses two names for it
        cache = vllm_config.cache_config
        kv_dtype_for(cache.cache_dtype, cfg)  # refuses fp8 & co. with a clear message
        if not cache.user_specified_block_size:
            cache.block_size = DEFAULT_BLOCK_SIZE
            cache.user_specified_block_size = True  # keep CpuPlatform from choosing 128
        if cache.block_size % 32:
            raise ValueError(
                f"block_size {cache.block_size}: the Tenstorrent paged cache needs a "
                "multiple of 32 tokens (whole tile rows)"
            )
        par = vllm_config.parallel_config
        if par.worker_cls == "auto":
            par.worker_cls = WORKER_CLS
        elif par.worker_cls != WORKER_CLS:
            raise ValueError(f"worker_cls={par.worker_cls!r}: the Tenstorrent platform needs {WORKER_CLS}")
        if par.world_size > 1:
            raise NotImplementedError("the emulated Tenstorrent platform runs one worker (TP=PP=1)")
        super().check_and_update_config(vllm_config)
        logger.info(
            "HAWK Tenstorrent platform (emulated %s, chips %s, KV %s, block %d tokens)",
            device,
            cfg.chips or "from the profile",
            cfg.kv_dtype,
            cache.block_size,
        )

    @classmethod
    def pack_kv_cache(cls, kv_cache, indices) -> None:
        raise NotImplementedError(
            "the Tenstorrent KV cache is tiled and interleaved over DRAM banks; blocks cannot be "
            "repacked by position. Write through vllm_hawk.tenstorrent.registry.get_kv_cache()."
        )


class TTPlatformMisconfigured(CpuPlatform):
    """Chosen when ``HAWK_TT_*`` is set but invalid: fails loudly instead of silently
    running the stock platform (vLLM swallows exceptions raised by plugin detection)."""

    def __init__(self) -> None:
        TTPluginConfig.from_env()  # raises TTPluginConfigError with the offending variable
        raise RuntimeError("HAWK_TT_PLATFORM is set but the Tenstorrent plugin is misconfigured")
