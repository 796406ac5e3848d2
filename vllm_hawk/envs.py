"""Every ``HAWK_*`` environment variable the package reads, read here and nowhere else.

Each reader validates its value and raises :class:`HawkEnvError` naming the variable
and the value at fault. Pure: imports neither torch nor vLLM.

=========================  ======================  ============================================
variable                   default                 meaning
=========================  ======================  ============================================
``HAWK_CACHE``             ``~/.cache/vllm-hawk``  cached environments and build products
                                                   (venvs, tiny models, guest images, ttsim)
``HAWK_CONFIG_DIR``        unset                   folders (``os.pathsep``-separated) with
                                                   ``devices/*.yaml`` / ``models/*.yaml``,
                                                   searched before the packaged profiles
``HAWK_SHARED_SECRET``     unset                   the shared secret (side channel and
                                                   host-staged transport) when
                                                   ``kv_connector_extra_config`` names none
``HAWK_SHARED_SECRET_FILE`` unset                  a file holding it (same precedence; the
                                                   two variables are mutually exclusive)
``HAWK_TRANSFORM_IMPL``    ``auto``                prefill transform kernel: ``auto`` (the
                                                   numba CPU kernel on CPU tensors, torch
                                                   elsewhere), ``torch``, ``cpu_kernel``
``HAWK_DEBUG_DIR``         unset                   the ONE debug switch: the connector writes
                                                   its state (``state-<role>-<pid>.json``, twice
                                                   a second) and, for GN-HAWK, the K/V it sends
                                                   and the bank bytes it lands
                                                   (``prefill-<req>.pt``, ``decode-<req>.pt``)
                                                   there; nothing of it runs when unset
``HAWK_CPU_AMX``           ``auto``                whether vLLM's CPU kernels may use Intel
                                                   AMX: ``auto`` (only if a probe in a child
                                                   process runs AMX tile instructions without
                                                   SIGILL), ``on`` (the same probe; start-up
                                                   fails if it does not), ``off`` (never, no
                                                   probe); see :mod:`vllm_hawk.cpu_amx`
``HAWK_TT_PLATFORM``       unset                   emulated Tenstorrent decode plugin:
                                                   ``emulated``; unset = plugin off (a card is
                                                   served by vllm-tt-plugin, vllm_hawk.tenstorrent.vllm_tt)
``HAWK_TT_DEVICE``         ``p150a``               device profile name or YAML path
``HAWK_TT_CHIPS``          profile's ``chips``     chips the KV heads are sharded over (n300: 2;
                                                   p150a: 1, or 2 / 4 for a Blackhole group)
``HAWK_TT_KV_DTYPE``       ``bfloat16``            KV dtype in the Tenstorrent cache
                                                   (``bfloat16`` | ``bfloat8_b`` | ``bfloat4_b``;
                                                   ``bfloat4_b`` is warned about: it misses the
                                                   KV accuracy contract, docs/tenstorrent.md)
``HAWK_TT_BANK_MIB``       ``256``                 emulated DRAM per bank (MiB)
``HAWK_TT_KV_FRACTION``    ``0.5``                 share of each bank for the KV cache
=========================  ======================  ============================================

The ``HAWK_TT_*`` values are validated by :class:`vllm_hawk.tenstorrent.emulated.config.TTPluginConfig`
(errors name the variable). Internal, set by vllm_hawk for the processes it and vLLM
start: ``HAWK_CPU_AMX_DECIDED`` carries the AMX decision of the first process of a tree
to the processes it spawns, so the probe runs once per tree.

Scripts and tests have their own (not read by the package): ``HAWK_TTSIM_DIR`` and
``HAWK_SFPI_DIR`` (``scripts/ttsim_env.sh``), ``HAWK_GN_E2E_FULL`` and
``HAWK_HYPOTHESIS_PROFILE`` (tests).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "CPU_AMX",
    "CPU_AMX_DECIDED",
    "CPU_AMX_MODES",
    "HawkEnvError",
    "TT_VARS",
    "cache_dir",
    "config_dirs",
    "cpu_amx_mode",
    "debug_dir",
    "shared_secret",
    "shared_secret_file",
    "transform_impl",
    "tt_env",
]

CPU_AMX = "HAWK_CPU_AMX"
CPU_AMX_MODES = ("auto", "on", "off")
CPU_AMX_DECIDED = "HAWK_CPU_AMX_DECIDED"
TRANSFORM_IMPLS = ("auto", "torch", "cpu_kernel", "triton")
TT_VARS = (
    "HAWK_TT_PLATFORM",
    "HAWK_TT_DEVICE",
    "HAWK_TT_CHIPS",
    "HAWK_TT_KV_DTYPE",
    "HAWK_TT_BANK_MIB",
    "HAWK_TT_KV_FRACTION",
)


class HawkEnvError(ValueError):
    """A ``HAWK_*`` variable holds a value vllm_hawk cannot use; the message names it."""


def cache_dir() -> Path:
    """``HAWK_CACHE``: where cached environments and build products live."""
    return Path(os.environ.get("HAWK_CACHE") or Path.home() / ".cache" / "vllm-hawk")


def numba_cache_dir() -> str:
    """Where numba caches the compiled kernels (transform, checksum): ``$NUMBA_CACHE_DIR``,
    else ``$HAWK_CACHE/numba``, so they survive across processes even when the package is
    installed read-only."""
    return os.environ.get("NUMBA_CACHE_DIR") or str(cache_dir() / "numba")


def use_numba_cache() -> None:
    """Make :func:`numba_cache_dir` numba's cache (call before numba is imported): the
    folder is created and ``NUMBA_CACHE_DIR`` set unless it is; where it cannot be created,
    numba falls back to its own locations."""
    d = numba_cache_dir()
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:
        return
    os.environ.setdefault("NUMBA_CACHE_DIR", d)


def config_dirs() -> list[Path]:
    """``HAWK_CONFIG_DIR``: user profile folders, searched in order before the packaged ones."""
    return [Path(p) for p in os.environ.get("HAWK_CONFIG_DIR", "").split(os.pathsep) if p]


def shared_secret() -> str | None:
    """``HAWK_SHARED_SECRET``: the shared secret when the connector config has none."""
    value = os.environ.get("HAWK_SHARED_SECRET") or None
    if value is not None and os.environ.get("HAWK_SHARED_SECRET_FILE"):
        raise HawkEnvError("HAWK_SHARED_SECRET and HAWK_SHARED_SECRET_FILE are both set: keep one")
    return value


def shared_secret_file() -> str | None:
    """``HAWK_SHARED_SECRET_FILE``: path of a file holding the shared secret."""
    return os.environ.get("HAWK_SHARED_SECRET_FILE") or None


def transform_impl() -> str:
    """``HAWK_TRANSFORM_IMPL``: ``auto`` (default), ``torch``, ``cpu_kernel`` or ``triton``."""
    raw = os.environ.get("HAWK_TRANSFORM_IMPL", "")
    value = raw.strip().lower() or "auto"
    if value not in TRANSFORM_IMPLS:
        raise HawkEnvError(f"HAWK_TRANSFORM_IMPL={raw!r}: expected one of {', '.join(TRANSFORM_IMPLS)}")
    return value


def debug_dir() -> Path | None:
    """``HAWK_DEBUG_DIR``: the debug output folder, or None (debug output off)."""
    d = os.environ.get("HAWK_DEBUG_DIR")
    return Path(d) if d else None


def cpu_amx_mode(environ: Mapping[str, str] | None = None) -> str:
    """``HAWK_CPU_AMX``: ``auto`` (default, also when unset or empty), ``on`` or ``off``."""
    env = os.environ if environ is None else environ
    raw = env.get(CPU_AMX, "")
    value = raw.strip().lower() or "auto"
    if value not in CPU_AMX_MODES:
        raise HawkEnvError(f"{CPU_AMX}={raw!r}: expected one of {', '.join(CPU_AMX_MODES)}")
    return value


def tt_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``HAWK_TT_*`` variables that are set (``environ``: default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in TT_VARS if k in env}
