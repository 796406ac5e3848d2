"""Run vLLM's CLI with the Tenstorrent platform plugin active.

    python -m vllm_hawk.tt_plugin --tt-platform emulated [--tt-device n150] [--tt-chips 2]
        [--tt-kv-dtype bfloat8_b] serve MODEL --enforce-eager ...

The ``--tt-*`` flags (before the vLLM command) set the matching ``HAWK_TT_*`` variables
(see ``vllm_hawk.tt_plugin.config``); everything else goes to ``vllm`` unchanged. The
entry point is made visible even when the package is not installed, here and in the
processes vLLM spawns (they re-import this module as ``__mp_main__``); so is the AMX
decision (``HAWK_CPU_AMX``, :mod:`vllm_hawk.cpu_amx`), made in ``main()``.
"""

from __future__ import annotations

import os
import sys

from vllm_hawk.cpu_amx import apply_inherited_decision
from vllm_hawk.tt_plugin import ensure_entry_point, entry_point_path
from vllm_hawk.tt_plugin.config import ENV_CHIPS, ENV_DEVICE, ENV_KV_DTYPE, ENV_PLATFORM, TTPluginConfig

_FLAGS = {
    "--tt-platform": ENV_PLATFORM,
    "--tt-device": ENV_DEVICE,
    "--tt-chips": ENV_CHIPS,
    "--tt-kv-dtype": ENV_KV_DTYPE,
}


def split_tt_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``--tt-*`` flags -> ({env var: value}, remaining argv)."""
    env: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0].split("=", 1)[0] in _FLAGS:
        flag = rest.pop(0)
        if "=" in flag:
            flag, value = flag.split("=", 1)
        elif rest:
            value = rest.pop(0)
        else:
            raise SystemExit(f"{flag} needs a value")
        env[_FLAGS[flag]] = value
    return env, rest


def main(argv: list[str] | None = None) -> int:
    env, rest = split_tt_flags(list(sys.argv[1:] if argv is None else argv))
    os.environ.update(env)
    cfg = TTPluginConfig.from_env()  # fail here, with the variable's name, not inside vLLM
    if cfg.backend is None:
        raise SystemExit(f"no Tenstorrent backend chosen: pass --tt-platform or set {ENV_PLATFORM}")
    if os.environ.get("VLLM_TARGET_DEVICE"):
        raise SystemExit("unset VLLM_TARGET_DEVICE: it makes vLLM skip platform plugins")
    entry_point_path()  # processes vLLM spawns must see the plugin too
    from vllm_hawk.vllm_launcher import main as vllm_main

    return vllm_main(rest)


ensure_entry_point()  # also on re-import as __mp_main__ in spawned processes
apply_inherited_decision()

if __name__ == "__main__":
    sys.exit(main())
