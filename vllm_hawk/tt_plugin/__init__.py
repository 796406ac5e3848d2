"""Deprecated alias of :mod:`vllm_hawk.tenstorrent.emulated` (the platform plugin entry point
``vllm_hawk.tt_plugin:register`` of older installs keeps working)."""

import warnings

from vllm_hawk.tenstorrent import registry  # noqa: F401  (connectors imported it from here)
from vllm_hawk.tenstorrent.emulated import *  # noqa: F403
from vllm_hawk.tenstorrent.emulated import register  # noqa: F401

warnings.warn("vllm_hawk.tt_plugin is deprecated: use vllm_hawk.tenstorrent.emulated", FutureWarning, stacklevel=2)
