"""Where a KV connector finds the running engine's Tenstorrent KV cache.

The emulated platform's model runner registers its :class:`~vllm_hawk.tenstorrent.emulated.mesh.TTMeshKVCache`
here when vLLM initialises the KV cache, and the HAWK decode worker on vllm-tt-plugin its
:class:`~vllm_hawk.tenstorrent.vllm_tt.kv_cache.TTNNMeshKVCache` (both a
:class:`~vllm_hawk.tenstorrent.kv_cache.MeshKVCache`), BEFORE vLLM
calls the connector's ``register_kv_caches`` (same worker process). The tensors vLLM hands to
``register_kv_caches`` under this platform are placeholders (``[num_blocks, 1]`` uint8,
no KV in them); a connector uses instead::

    from vllm_hawk.tenstorrent import registry
    cache = registry.get_kv_cache(vllm_config)     # or registry.get_kv_cache() if one engine
    cache.num_kv_heads      # the model's KV heads (all chips)
    cache.heads_of(c)       # HeadShard: global KV heads [start, stop) chip c holds
    cache.layer_names       # vLLM layer names, in layer-index order
    chip = cache.chips[c]   # chip c's ChipKVCache:
    chip.device             # its bank-buffer backend (BankBufferAPI: map_buffer_dma, ...)
    chip.layout             # TTKVCacheLayout: spec, num_banks, aligned_page, addresses
    chip.spec               # TTKVCacheSpec; num_kv_heads = the heads on that chip
    chip.buffer(layer, kv)  # the DeviceBuffer of one layer's K (0) or V (1)

With one chip, ``cache.device`` / ``.layout`` / ``.buffers`` / ``.buffer()`` are
``cache.chips[0]``'s. ``cache.spec`` is the model's (global) spec.

Keys are the engine's ``VllmConfig.instance_id`` (one per engine; a connector built from
the same config finds it). Entries are removed when the worker shuts down.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_hawk.tenstorrent.kv_cache import MeshKVCache

__all__ = ["register", "unregister", "get_kv_cache", "registered_keys", "engine_key"]

_lock = threading.Lock()
_caches: dict[str, MeshKVCache] = {}


def engine_key(vllm_config) -> str:
    """The registry key of an engine: its ``VllmConfig.instance_id`` (or the str given)."""
    if isinstance(vllm_config, str):
        return vllm_config
    key = getattr(vllm_config, "instance_id", "")
    if not key:
        raise ValueError("vllm_config has no instance_id; pass the engine's VllmConfig")
    return key


def register(vllm_config, cache: MeshKVCache) -> str:
    """Record ``cache`` as the KV cache of the engine; returns its key."""
    key = engine_key(vllm_config)
    with _lock:
        if key in _caches and _caches[key] is not cache:
            raise RuntimeError(f"a Tenstorrent KV cache is already registered for engine {key}")
        _caches[key] = cache
    return key


def unregister(vllm_config) -> MeshKVCache | None:
    """Forget the engine's cache (does not free it); returns it, or None."""
    with _lock:
        return _caches.pop(engine_key(vllm_config), None)


def get_kv_cache(vllm_config=None) -> MeshKVCache:
    """The KV cache of the engine ``vllm_config`` (a VllmConfig or its key).

    Without an argument: the only registered cache of this process; raises LookupError
    when there is none or more than one."""
    with _lock:
        if vllm_config is not None:
            key = engine_key(vllm_config)
            if key not in _caches:
                raise LookupError(
                    f"no Tenstorrent KV cache registered for engine {key} "
                    f"(registered: {sorted(_caches)}); is HAWK_TT_PLATFORM set and "
                    "the KV cache initialised?"
                )
            return _caches[key]
        if len(_caches) != 1:
            raise LookupError(
                f"{len(_caches)} Tenstorrent KV caches registered in this process; pass the engine's vllm_config"
            )
        return next(iter(_caches.values()))


def registered_keys() -> list[str]:
    with _lock:
        return sorted(_caches)
