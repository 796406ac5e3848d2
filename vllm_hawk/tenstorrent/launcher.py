"""The ``--tt-*`` flags of ``hawk vllm``: run vLLM's CLI with the emulated Tenstorrent platform.

    hawk vllm --tt-platform emulated [--tt-device n150] [--tt-chips 2]
        [--tt-kv-dtype bfloat8_b] serve MODEL --enforce-eager ...

(``python -m vllm_hawk.vllm_launcher`` takes the same). The ``--tt-*`` flags, before the vLLM
command, set the matching ``HAWK_TT_*`` variables (see
:mod:`vllm_hawk.tenstorrent.emulated.config`); everything else goes to ``vllm`` unchanged. The
platform's entry point is made visible even when the package is not installed, here and in
the processes vLLM spawns (a metadata-only ``.dist-info`` on their ``PYTHONPATH``).
"""

from __future__ import annotations

import os

from vllm_hawk.tenstorrent.emulated import ensure_entry_point, entry_point_path
from vllm_hawk.tenstorrent.emulated.config import ENV_CHIPS, ENV_DEVICE, ENV_KV_DTYPE, ENV_PLATFORM, TTPluginConfig

__all__ = ["FLAGS", "has_tt_flags", "split_tt_flags", "apply_tt_flags"]

FLAGS = {
    "--tt-platform": ENV_PLATFORM,
    "--tt-device": ENV_DEVICE,
    "--tt-chips": ENV_CHIPS,
    "--tt-kv-dtype": ENV_KV_DTYPE,
}


def has_tt_flags(argv: list[str]) -> bool:
    """True when ``argv`` starts with a ``--tt-*`` flag."""
    return bool(argv) and argv[0].split("=", 1)[0] in FLAGS


def split_tt_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``--tt-*`` flags -> ({env var: value}, remaining argv)."""
    env: dict[str, str] = {}
    rest = list(argv)
    while has_tt_flags(rest):
        flag = rest.pop(0)
        if "=" in flag:
            flag, value = flag.split("=", 1)
        elif rest:
            value = rest.pop(0)
        else:
            raise SystemExit(f"{flag} needs a value")
        env[FLAGS[flag]] = value
    return env, rest


def apply_tt_flags(argv: list[str]) -> list[str]:
    """Set the ``HAWK_TT_*`` variables of the leading ``--tt-*`` flags, check them (an invalid
    value fails here naming its variable, not inside vLLM), make the platform's entry point
    visible to this process and those vLLM spawns; returns the vLLM argv."""
    env, rest = split_tt_flags(argv)
    os.environ.update(env)
    cfg = TTPluginConfig.from_env()
    if cfg.backend is None:
        raise SystemExit(f"no Tenstorrent backend chosen: pass --tt-platform or set {ENV_PLATFORM}")
    if os.environ.get("VLLM_TARGET_DEVICE"):
        raise SystemExit("unset VLLM_TARGET_DEVICE: it makes vLLM skip platform plugins")
    ensure_entry_point()
    entry_point_path()  # processes vLLM spawns must see the plugin too
    return rest
