"""Deprecated alias of :mod:`vllm_hawk.tenstorrent.emulated` (the platform plugin entry point
``vllm_hawk.tt_plugin:register`` of older installs keeps working)."""

import warnings

from vllm_hawk.tenstorrent.emulated import *  # noqa: F403
from vllm_hawk.tenstorrent.emulated import register  # noqa: F401

warnings.warn("vllm_hawk.tt_plugin is deprecated: use vllm_hawk.tenstorrent.emulated", DeprecationWarning, stacklevel=2)
