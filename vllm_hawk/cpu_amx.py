"""Intel AMX on CPU hosts: probe it in a child process, let vLLM use it only where it runs.

vLLM 0.32's CPU build picks AMX kernels whenever ``torch.cpu._is_amx_tile_supported()``
(a CPUID check) is true: the AMX attention path and its KV-cache layout for bf16 with
block_size % 32 == 0 (``vllm/v1/attention/backends/cpu_attn.py: _get_attn_isa``) and the
AMX GEMMs (``vllm/model_executor/layers/utils.py: check_cpu_sgl_kernel``). On Linux
>= 5.16 a process may execute AMX tile instructions only after asking for the tile-data
state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, what
``torch.cpu._init_amx()`` does); vLLM's worker does not ask, and some kernels or
hypervisors refuse. Either way the worker dies with SIGILL at the first bf16 forward.

:func:`apply_cpu_amx_policy` decides once per process tree (``HAWK_CPU_AMX``, see
:mod:`vllm_hawk.envs`) and applies the decision in the calling process:

* AMX usable (the probe, a child process, asked for the tile state and ran
  ``ldtilecfg``/``tilezero``/``tdpbf16ps`` without SIGILL): ask for the tile state in
  this process (``torch.cpu._init_amx()``), so vLLM's AMX kernels run.
* AMX advertised but unusable, or ``HAWK_CPU_AMX=off``: ``torch.cpu._is_amx_tile_supported``
  (and ``_is_amx_fp16_supported``) return False in this process, so vLLM picks its
  non-AMX kernels and the ``vec``/``vec16`` KV layout. One line is logged per tree.
* AMX not advertised: nothing to do.

The decision travels to the processes vLLM spawns in ``HAWK_CPU_AMX_DECIDED``; they apply it
without probing again (:func:`apply_inherited_decision`, called where those processes
re-import the launcher modules, and by the vLLM plugin entry points). The probe needs no
torch (ctypes + an executable mmap page) and takes ~50 ms.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from dataclasses import dataclass

from vllm_hawk import envs

__all__ = [
    "AmxDecision",
    "AmxUnavailableError",
    "ProbeResult",
    "probe_amx",
    "decide",
    "apply_cpu_amx_policy",
    "apply_inherited_decision",
    "apply_from_plugin",
    "reset_cpu_amx_policy",
]

logger = logging.getLogger("vllm.hawk.cpu_amx")

# The probe child: stdlib only, run as ``python -I -S -c _PROBE <request_permission 0|1>``.
# Prints "perm <rc> <errno>" before executing tile instructions, "ok" after; a SIGILL
# kills it with -4. Encodings: Intel SDM vol. 2, LDTILECFG/TILEZERO/TDPBF16PS/TILERELEASE.
_PROBE = r"""
import ctypes, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
if sys.argv[1] == "1":  # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    rc = libc.syscall(158, 0x1023, 18)
    print("perm", rc, ctypes.get_errno(), flush=True)
code = bytes([0xC4, 0xE2, 0x78, 0x49, 0x07,   # ldtilecfg [rdi]
              0xC4, 0xE2, 0x7B, 0x49, 0xC0,   # tilezero tmm0
              0xC4, 0xE2, 0x7B, 0x49, 0xC8,   # tilezero tmm1
              0xC4, 0xE2, 0x7B, 0x49, 0xD0,   # tilezero tmm2
              0xC4, 0xE2, 0x6A, 0x5C, 0xC1,   # tdpbf16ps tmm0, tmm1, tmm2
              0xC4, 0xE2, 0x78, 0x49, 0xC0,   # tilerelease
              0xC3])                          # ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
cfg = (ctypes.c_uint8 * 64)()  # palette 1; tmm0-2: 16 rows x 64 bytes
cfg[0] = 1
for t in range(3):
    cfg[16 + 2 * t], cfg[48 + t] = 64, 16
fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
fn(ctypes.addressof(cfg))
print("ok", flush=True)
"""


class AmxUnavailableError(RuntimeError):
    """``HAWK_CPU_AMX=on`` on a host where AMX does not work; the message says why."""


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # "ok", "SIGILL (...)", "exit code N: ...", "not x86-64", ...


def probe_amx(request_permission: bool = True, timeout_s: float = 30.0) -> ProbeResult:
    """Run AMX tile instructions in a child process; never raises, never crashes the caller.

    ``request_permission=False`` skips ``ARCH_REQ_XCOMP_PERM`` (what vLLM's worker does):
    on any Linux >= 5.16 that child must die with SIGILL (used by the tests to prove the
    SIGILL branch on every x86 host)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ProbeResult(False, f"not x86-64 ({platform.machine()})")
    try:
        out = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE, "1" if request_permission else "0"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return ProbeResult(False, f"probe did not run: {e}")
    said = " ".join(out.stdout.split())
    if out.returncode == 0 and said.endswith("ok"):
        return ProbeResult(True, "ok")
    if out.returncode == -4:
        return ProbeResult(False, f"SIGILL ({said or 'no output'})")
    return ProbeResult(False, f"exit code {out.returncode}: {said} {out.stderr.strip()[-300:]}".strip())


@dataclass(frozen=True)
class AmxDecision:
    mode: str  # HAWK_CPU_AMX at decision time
    advertised: bool  # torch.cpu._is_amx_tile_supported() before any patch
    use_amx: bool
    reason: str

    def encode(self) -> str:
        return f"{self.mode}|{int(self.advertised)}|{int(self.use_amx)}|{self.reason}"

    @classmethod
    def decode(cls, s: str | None) -> AmxDecision | None:
        parts = (s or "").split("|", 3)
        if len(parts) != 4 or parts[0] not in envs.CPU_AMX_MODES:
            return None
        return cls(parts[0], parts[1] == "1", parts[2] == "1", parts[3])


def _torch_fn(name: str):
    import torch

    f = getattr(torch.cpu, name, None)
    return getattr(f, "_hawk_original", f)


def _advertised() -> bool:
    f = _torch_fn("_is_amx_tile_supported")
    return bool(f()) if f is not None else False


def decide(mode: str | None = None) -> AmxDecision:
    """The decision for this host (runs the probe when the mode needs it). Raises
    :class:`AmxUnavailableError` for ``on`` where AMX does not work."""
    mode = envs.cpu_amx_mode() if mode is None else mode
    advertised = _advertised()
    if mode == "off":
        return AmxDecision(mode, advertised, False, f"{envs.CPU_AMX}=off")
    if not advertised:
        if mode == "on":
            raise AmxUnavailableError(
                f"{envs.CPU_AMX}=on, but this CPU does not report AMX (torch.cpu._is_amx_tile_supported() is False)"
            )
        return AmxDecision(mode, False, False, "the CPU does not report AMX")
    probe = probe_amx()
    if probe.ok:
        return AmxDecision(mode, True, True, "probe ran AMX tile instructions")
    if mode == "on":
        raise AmxUnavailableError(f"{envs.CPU_AMX}=on, but AMX tile instructions fail here (probe: {probe.detail})")
    return AmxDecision(mode, True, False, f"probe: {probe.detail}")


_applied: AmxDecision | None = None


def _patch_torch_off() -> None:
    import torch

    for name in ("_is_amx_tile_supported", "_is_amx_fp16_supported"):
        f = getattr(torch.cpu, name, None)
        if f is None or hasattr(f, "_hawk_original"):
            continue

        def off() -> bool:
            return False

        off._hawk_original = f  # type: ignore[attr-defined]
        setattr(torch.cpu, name, off)


def _say(decision: AmxDecision) -> None:
    if decision.use_amx:
        msg = "vllm_hawk: AMX works here (probe in a child process); vLLM may use its AMX kernels"
    elif not decision.advertised:
        logger.debug("vllm_hawk: %s; nothing to change", decision.reason)
        return
    elif decision.mode == "off":
        msg = f"vllm_hawk: {envs.CPU_AMX}=off: vLLM runs its non-AMX CPU kernels"
    else:
        msg = (
            f"vllm_hawk: this CPU reports AMX but AMX does not work here ({decision.reason}); "
            f"vLLM runs its non-AMX CPU kernels ({envs.CPU_AMX}={decision.mode})"
        )
    if logging.getLogger("vllm").handlers or logger.handlers:
        logger.log(logging.INFO if decision.use_amx else logging.WARNING, "%s", msg)
    else:  # before vLLM configured logging (launcher process)
        print(msg, file=sys.stderr, flush=True)


def apply_cpu_amx_policy(strict: bool = True) -> AmxDecision:
    """Decide (or take the decision inherited through ``HAWK_CPU_AMX_DECIDED`` when it was
    made for the same ``HAWK_CPU_AMX``) and apply it to this process; export it for child
    processes. Idempotent per process. Logs one line per process tree.

    ``strict=False`` (plugin entry points, spawned processes): where ``HAWK_CPU_AMX`` is
    invalid or ``on`` cannot be honoured, log the error and run without AMX instead of
    raising — never SIGILL."""
    global _applied
    if _applied is not None:
        return _applied
    try:
        mode = envs.cpu_amx_mode()
        inherited = AmxDecision.decode(os.environ.get(envs.CPU_AMX_DECIDED))
        fresh = inherited is None or inherited.mode != mode
        d = decide(mode) if fresh else inherited
    except (envs.HawkEnvError, AmxUnavailableError) as e:
        if strict:
            raise
        logger.error("%s; running without AMX", e)
        fresh, d = True, AmxDecision("off", True, False, str(e).replace("|", "/"))
    if d.use_amx:
        init = _torch_fn("_init_amx")
        if init is not None and not init():  # the probe passed, so this is unexpected
            d = AmxDecision(d.mode, d.advertised, False, "torch.cpu._init_amx() refused the tile state")
            if d.mode == "on" and strict:
                raise AmxUnavailableError(f"{envs.CPU_AMX}=on, but {d.reason}")
    if not d.use_amx and d.advertised:
        _patch_torch_off()
    os.environ[envs.CPU_AMX_DECIDED] = d.encode()
    if fresh:
        _say(d)
    _applied = d
    return d


def apply_inherited_decision() -> AmxDecision | None:
    """In a process started by a launcher (``HAWK_CPU_AMX_DECIDED`` set): apply that
    decision here, without probing. Otherwise (no launcher above us) do nothing."""
    if _applied is None and os.environ.get(envs.CPU_AMX_DECIDED):
        return apply_cpu_amx_policy(strict=False)
    return _applied


def apply_from_plugin() -> None:
    """For vLLM plugin entry points (they run in every vLLM process, also without our
    launchers): apply the policy, never raising into vLLM's plugin loader."""
    try:
        apply_cpu_amx_policy(strict=False)
    except Exception:  # noqa: BLE001 - a plugin must not break vLLM's start-up
        logger.exception("vllm_hawk: AMX policy not applied")


def reset_cpu_amx_policy() -> None:
    """Undo :func:`apply_cpu_amx_policy` in this process (tests): restore torch's functions,
    forget the decision and its export. The tile-state permission, once granted, stays."""
    global _applied
    import torch

    for name in ("_is_amx_tile_supported", "_is_amx_fp16_supported"):
        f = getattr(torch.cpu, name, None)
        if f is not None and hasattr(f, "_hawk_original"):
            setattr(torch.cpu, name, f._hawk_original)
    os.environ.pop(envs.CPU_AMX_DECIDED, None)
    _applied = None
