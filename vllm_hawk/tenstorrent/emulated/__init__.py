"""Tenstorrent decode platform for vLLM (``vllm.platform_plugins`` entry point).

One backend, chosen explicitly with ``HAWK_TT_PLATFORM`` (see :mod:`.config` for all
``HAWK_TT_*`` variables), never by detection, so a GPU node is unaffected:

* ``emulated``: runs on the CPU (:mod:`.platform`). The KV cache lives in an emulated
  Tenstorrent device's DRAM banks in the device's paged tile layout (bf16, bfloat8_b or
  bfloat4_b) and decode attention reads it in that layout (:mod:`.attention`,
  :mod:`.kv_cache`); on several chips (``HAWK_TT_CHIPS``, an n300) the KV heads are
  sharded over them (:mod:`.mesh`). ``make demo`` and machines without ttnn decode this way.

A real (or simulated) Tenstorrent device is served by Tenstorrent's own plugin,
vllm-tt-plugin, with the HAWK decode worker of :mod:`vllm_hawk.tenstorrent.vllm_tt` (docs/tenstorrent.md).

KV connectors find the running engine's cache with :func:`get_kv_cache` (see
:mod:`vllm_hawk.tenstorrent.registry`). Activation without installing the entry point (tests, a
checkout on ``PYTHONPATH``): :func:`ensure_entry_point`, or the launcher
``hawk vllm --tt-platform emulated [--tt-device n150] serve MODEL ...``
(:mod:`vllm_hawk.tenstorrent.launcher`).

This module imports neither vLLM nor torch: vLLM loads it during platform detection
(``register`` imports torch, for the AMX policy).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as md
import logging
import os
import sys
from pathlib import Path

from vllm_hawk import envs
from vllm_hawk.tenstorrent.emulated.config import TTPluginConfig, TTPluginConfigError

__all__ = [
    "register",
    "ensure_entry_point",
    "entry_point_path",
    "get_kv_cache",
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_NAME",
]

logger = logging.getLogger("vllm.hawk.tt_plugin")

ENTRY_POINT_GROUP = "vllm.platform_plugins"
ENTRY_POINT_NAME = "hawk_tt"
ENTRY_POINT_VALUE = "vllm_hawk.tenstorrent.emulated:register"

_PLATFORMS = {"emulated": "vllm_hawk.tenstorrent.emulated.platform.TTEmulatedPlatform"}
_MISCONFIGURED = "vllm_hawk.tenstorrent.emulated.platform.TTPlatformMisconfigured"


def register() -> str | None:
    """The ``vllm.platform_plugins`` hook: the platform class path, or None when
    ``HAWK_TT_PLATFORM`` is unset/off. An invalid ``HAWK_TT_*`` value selects a platform
    that raises on construction with the variable's name (vLLM would otherwise swallow
    the error and run its stock platform). Applies the AMX policy (``HAWK_CPU_AMX``,
    :mod:`vllm_hawk.cpu_amx`) first: vLLM calls this in every process it starts."""
    from vllm_hawk.cpu_amx import apply_from_plugin

    apply_from_plugin()
    try:
        cfg = TTPluginConfig.from_env()
    except TTPluginConfigError as e:
        logger.error("%s", e)
        return _MISCONFIGURED
    return None if cfg.backend is None else _PLATFORMS[cfg.backend]


def get_kv_cache(vllm_config=None):
    """The running engine's Tenstorrent KV cache (see :mod:`vllm_hawk.tenstorrent.registry`)."""
    from vllm_hawk.tenstorrent.registry import get_kv_cache as _get

    return _get(vllm_config)


# --------------------------------------------------------------------------- activation


class _EntryPointDistribution(md.Distribution):
    """Metadata-only distribution declaring the platform entry point (no files)."""

    _NAME = "vllm-hawk-tt-plugin"

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return f"Metadata-Version: 2.1\nName: {self._NAME}\nVersion: 0\n"
        if filename == "entry_points.txt":
            return f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_NAME} = {ENTRY_POINT_VALUE}\n"
        return None

    def locate_file(self, path) -> Path:
        return Path(path)


class _EntryPointFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):  # noqa: B008 - importlib.metadata signature
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == _EntryPointDistribution._NAME:
            yield _EntryPointDistribution()


def _declared() -> bool:
    return any(ep.value == ENTRY_POINT_VALUE for ep in md.entry_points(group=ENTRY_POINT_GROUP))


def ensure_entry_point() -> bool:
    """Make ``vllm_hawk.tenstorrent.emulated:register`` visible to vLLM's plugin loader in this
    process (and processes that import this package first), when no installed
    distribution declares it. Idempotent; returns True if it had to add it. Activation
    still needs ``HAWK_TT_PLATFORM``."""
    if _declared():
        return False
    sys.meta_path.append(_EntryPointFinder())
    return True


def entry_point_path(directory: str | os.PathLike | None = None) -> str | None:
    """For processes vLLM spawns (they do not inherit :func:`ensure_entry_point`'s
    in-memory finder): write a metadata-only ``.dist-info`` declaring the entry point
    under ``directory`` (default ``$HAWK_CACHE/tt_entry_point``), put it on ``sys.path``
    and on ``PYTHONPATH`` of this process's environment, and return it. Returns None
    when an installed distribution already declares the entry point."""
    if any(
        ep.value == ENTRY_POINT_VALUE and not isinstance(ep.dist, _EntryPointDistribution)
        for ep in md.entry_points(group=ENTRY_POINT_GROUP)
    ):
        return None
    d = Path(directory) if directory is not None else envs.cache_dir() / "tt_entry_point"
    info = d / "vllm_hawk_tt_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-hawk-tt-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_NAME} = {ENTRY_POINT_VALUE}\n")
    if str(d) not in sys.path:
        sys.path.append(str(d))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(d) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths + [str(d)])
    return str(d)
