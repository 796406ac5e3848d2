"""vllm_hawk.cpu_amx and HAWK_CPU_AMX: the AMX decision, made in real child processes.

Both branches run on every x86 host: the probe without the tile-state request must die
with SIGILL in its child (the condition that kills vLLM's worker), and the decision is
run with ``HAWK_CPU_AMX=off`` (non-AMX), ``auto`` and ``on`` (AMX only where the probe says
it works, else ``on`` must refuse to start) in fresh interpreters. No CPU flag is mocked.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hawk import envs
from vllm_hawk.cpu_amx import AmxDecision, probe_amx

X86 = platform.machine().lower() in ("x86_64", "amd64")

# Applies the policy in a fresh interpreter, then reports what vLLM will see. Where AMX
# is on, it also runs AMX tile instructions in THIS process without requesting the tile
# state itself: only the policy's torch.cpu._init_amx() can have made that legal.
_CHILD = r"""
import json, sys
from vllm_hawk import cpu_amx
try:
    d = cpu_amx.apply_cpu_amx_policy()
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"})); sys.exit(3)
import torch
ran_amx = False
if d.use_amx:
    sys.argv = ["probe", "0"]
    exec(compile(cpu_amx._PROBE, "probe", "exec"), {"__name__": "probe"})
    ran_amx = True
print(json.dumps({"decision": d.encode(), "vllm_sees_amx": torch.cpu._is_amx_tile_supported(),
                  "ran_amx": ran_amx}))
"""


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAWK_CPU_AMX")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _run_child(**env) -> tuple[subprocess.CompletedProcess, dict]:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, env=_env(**env))
    assert out.returncode in (0, 3), f"child died (rc {out.returncode}): {out.stderr[-2000:]}"
    return out, json.loads(out.stdout.strip().splitlines()[-1])


def _amx_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("vllm_hawk:") and "AMX" in ln]


@pytest.fixture(scope="module")
def host():
    """What this host offers: torch's CPUID answer and the probe's verdict."""
    import torch

    return {"advertised": bool(torch.cpu._is_amx_tile_supported()), "probe": probe_amx()}


def test_mode_is_validated_with_the_variable_named():
    assert envs.cpu_amx_mode({}) == "auto"
    assert envs.cpu_amx_mode({"HAWK_CPU_AMX": " OFF "}) == "off"
    with pytest.raises(envs.HawkEnvError, match="HAWK_CPU_AMX='maybe': expected one of auto, on, off"):
        envs.cpu_amx_mode({"HAWK_CPU_AMX": "maybe"})


def test_decision_round_trips_through_the_environment():
    d = AmxDecision("auto", True, False, "probe: SIGILL (perm -1 22)")
    assert AmxDecision.decode(d.encode()) == d
    assert AmxDecision.decode("garbage") is None and AmxDecision.decode(None) is None


@pytest.mark.skipif(not X86, reason="AMX is x86-only; the probe reports 'not x86-64' here")
def test_probe_sees_sigill_in_its_child_and_survives():
    """Without ARCH_REQ_XCOMP_PERM (as in vLLM's worker) tile instructions raise SIGILL on
    every x86 Linux >= 5.16, with or without AMX: the probe's child dies, we do not."""
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) < (5, 16):
        pytest.skip(f"Linux {platform.release()} < 5.16 has no AMX permission request")
    r = probe_amx(request_permission=False)
    assert not r.ok and r.detail.startswith("SIGILL"), r


def test_probe_verdict_matches_cpuinfo(host):
    """The probe succeeds only where the CPU advertises AMX (never a false 'usable')."""
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    if host["probe"].ok:
        assert "amx_tile" in flags.split() and host["advertised"]


def test_off_runs_the_non_amx_path_in_a_child(host):
    out, got = _run_child(HAWK_CPU_AMX="off")
    d = AmxDecision.decode(got["decision"])
    assert d.mode == "off" and not d.use_amx
    assert got["vllm_sees_amx"] is False
    lines = _amx_lines(out.stderr)
    assert len(lines) == (1 if host["advertised"] else 0), out.stderr
    if lines:
        assert "HAWK_CPU_AMX=off" in lines[0] and "non-AMX" in lines[0]


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_auto_and_on_follow_the_probe_in_a_child(host, mode):
    out, got = _run_child(HAWK_CPU_AMX=mode)
    usable = host["advertised"] and host["probe"].ok
    if mode == "on" and not usable:  # on where AMX does not work: refuse, naming the variable
        assert out.returncode == 3 and "HAWK_CPU_AMX=on" in got["error"], got
        return
    d = AmxDecision.decode(got["decision"])
    assert d.use_amx is usable
    assert got["vllm_sees_amx"] is usable
    assert got["ran_amx"] is usable  # AMX really executes in the child after the policy
    lines = _amx_lines(out.stderr)
    assert len(lines) == (1 if host["advertised"] else 0), out.stderr
    if host["advertised"] and not usable:
        assert "does not work here" in lines[0] and "non-AMX" in lines[0]


def test_inherited_unusable_decision_is_applied_without_probe_or_log(host):
    """A spawned engine process inherits the parent's verdict (here: the SIGILL branch,
    as on hosts where AMX is advertised but unusable): non-AMX, no second line."""
    inherited = AmxDecision("auto", host["advertised"], False, "probe: SIGILL (parent)")
    out, got = _run_child(HAWK_CPU_AMX="auto", HAWK_CPU_AMX_DECIDED=inherited.encode())
    assert AmxDecision.decode(got["decision"]) == inherited
    assert got["vllm_sees_amx"] is False
    assert _amx_lines(out.stderr) == []


def test_launcher_refuses_a_bad_value_naming_it():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_hawk.vllm_launcher", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(HAWK_CPU_AMX="sometimes"),
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "HAWK_CPU_AMX='sometimes'" in out.stderr
