"""The ``HAWK_*`` environment variables vllm_hawk reads, each with its meaning and default.

One place for all of them (the ``HAWK_TT_*`` platform variables still live in
:mod:`vllm_hawk.tt_plugin.config` and move here later). Each reader validates its value
and raises :class:`HawkEnvError` naming the variable and the value at fault.

===================  ====================  ==================================================
variable             values (default 1st)  meaning
===================  ====================  ==================================================
``HAWK_CPU_AMX``     ``auto``, ``on``,     Whether vLLM's CPU kernels may use Intel AMX
                     ``off``               (AMX attention and its KV-cache layout, AMX GEMMs).
                                           ``auto``: only if a probe in a child process runs
                                           AMX tile instructions without SIGILL; ``on``: the
                                           same probe, and start-up fails if it does not;
                                           ``off``: never (no probe). See
                                           :mod:`vllm_hawk.cpu_amx`.
===================  ====================  ==================================================

Internal (set by vllm_hawk for the processes it and vLLM start; not for users):
``HAWK_CPU_AMX_DECIDED`` carries the AMX decision of the first process of a process tree
to the processes it spawns, so the probe runs once per tree.

Pure: imports neither torch nor vLLM.
"""
from __future__ import annotations

import os
from typing import Mapping

__all__ = ["HawkEnvError", "CPU_AMX", "CPU_AMX_MODES", "CPU_AMX_DECIDED", "cpu_amx_mode"]

CPU_AMX = "HAWK_CPU_AMX"
CPU_AMX_MODES = ("auto", "on", "off")
CPU_AMX_DECIDED = "HAWK_CPU_AMX_DECIDED"


class HawkEnvError(ValueError):
    """A ``HAWK_*`` variable holds a value vllm_hawk cannot use; the message names it."""


def cpu_amx_mode(environ: Mapping[str, str] | None = None) -> str:
    """``HAWK_CPU_AMX``: ``auto`` (default, also when unset or empty), ``on`` or ``off``."""
    env = os.environ if environ is None else environ
    raw = env.get(CPU_AMX, "")
    value = raw.strip().lower() or "auto"
    if value not in CPU_AMX_MODES:
        raise HawkEnvError(f"{CPU_AMX}={raw!r}: expected one of {', '.join(CPU_AMX_MODES)}")
    return value
