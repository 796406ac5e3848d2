"""Every ``HAWK_*`` environment variable, read here and nowhere else.

=========================  ====================  ==============================================
variable                   default               meaning
=========================  ====================  ==============================================
``HAWK_CACHE``             ``~/.cache/vllm-hawk``  cached environments and build products
                                                 (venvs, tiny models, guest images)
``HAWK_CONFIG_DIR``        (packaged profiles)   a folder with ``devices/*.yaml`` and
                                                 ``models/*.yaml`` that override the ones
                                                 shipped in the package
``HAWK_SHARED_SECRET``     unset                 side-channel HMAC key when
                                                 ``kv_connector_extra_config.shared_secret``
                                                 is not set
``HAWK_TRANSFORM_IMPL``    ``auto``              prefill transform kernel: ``auto`` (numba
                                                 on CPU tensors, torch elsewhere), ``torch``,
                                                 ``numba``
``HAWK_DEBUG_DIR``         unset                 the ONE debug switch: when set, the connector
                                                 writes its state (``state-<role>-<pid>.json``,
                                                 twice a second) and, for GN-HAWK, the K/V
                                                 it sends and the bank bytes it lands
                                                 (``prefill-<req>.pt``, ``decode-<req>.pt``)
                                                 there. Off the hot path when unset.
``HAWK_TT_PLATFORM``       unset                 Tenstorrent decode plugin: ``emulated`` |
                                                 ``ttnn``; unset = plugin off
``HAWK_TT_DEVICE``         ``p150a``             device profile name or YAML path
``HAWK_TT_KV_DTYPE``       ``bfloat16``          KV dtype in the Tenstorrent cache
                                                 (``bfloat16`` | ``bfloat8_b``)
``HAWK_TT_BANK_MIB``       ``256``               emulated DRAM per bank (MiB)
``HAWK_TT_KV_FRACTION``    ``0.5``               share of each bank for the KV cache
=========================  ====================  ==============================================

The ``HAWK_TT_*`` variables are parsed and validated by
:class:`vllm_hawk.tt_plugin.config.TTPluginConfig` (errors name the variable).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HAWK_CACHE") or Path.home() / ".cache" / "vllm-hawk")


def config_dir() -> Path | None:
    d = os.environ.get("HAWK_CONFIG_DIR")
    return Path(d) if d else None


def shared_secret() -> str | None:
    return os.environ.get("HAWK_SHARED_SECRET") or None


def transform_impl() -> str:
    return os.environ.get("HAWK_TRANSFORM_IMPL", "auto")


def debug_dir() -> Path | None:
    d = os.environ.get("HAWK_DEBUG_DIR")
    return Path(d) if d else None


TT_VARS = ("HAWK_TT_PLATFORM", "HAWK_TT_DEVICE", "HAWK_TT_KV_DTYPE", "HAWK_TT_BANK_MIB", "HAWK_TT_KV_FRACTION")


def tt_env(env=None) -> dict[str, str]:
    """The ``HAWK_TT_*`` variables that are set (``env``: default ``os.environ``)."""
    env = os.environ if env is None else env
    return {k: env[k] for k in TT_VARS if k in env}
