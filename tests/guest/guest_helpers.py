"""Shared by the guest stages: find the runner, say why a stage cannot run, keep times.

The guest stages boot Debian's 6.12 kernel under QEMU TCG (scripts/qemu_guest.py). They
need root (debootstrap, module builds for the guest kernel), qemu-system-x86,
debootstrap, busybox-static, cpio, zstd and linux-image/headers-6.12 (scripts/kernel_deps.sh
installs all of them). Outside CI a missing prerequisite skips with the reason; under
CI=true it fails, so a broken CI set-up cannot pass silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import qemu_guest  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() == "true"
#: "stage: what took how long" lines, printed at the end of the run (conftest.py)
TIMES: list[str] = []


def require(ok: bool, reason: str) -> None:
    if ok:
        return
    msg = f"{reason} (install with: sudo scripts/kernel_deps.sh)"
    if IN_CI:
        pytest.fail(f"CI=true and {msg}", pytrace=False)
    pytest.skip(msg)


def images() -> qemu_guest.Images:
    """Build or reuse the guest images; skip/fail with the reason if that is impossible."""
    require(os.geteuid() == 0, "the guest stages need root (debootstrap, 9p as root)")
    missing = qemu_guest.missing_host_tools()
    require(not missing, f"missing host packages: {' '.join(missing)}")
    try:
        kver = qemu_guest.guest_kernel_release()
    except qemu_guest.GuestError as e:
        require(False, str(e))
    require(Path(f"/usr/src/linux-headers-{kver}/Makefile").is_file(), f"no headers for {kver}")
    t0 = time.monotonic()
    try:
        imgs = qemu_guest.ensure_images()
    except qemu_guest.GuestError as e:
        require(False, f"guest images: {e}")
    dt = time.monotonic() - t0
    parts = ", ".join(f"{k} {'cached' if v == 0 else f'{v:.1f} s'}" for k, v in imgs.build_s.items())
    TIMES.append(f"guest images {imgs.kver}: {'COLD build' if imgs.cold else 'warm'} {dt:.1f} s ({parts})")
    return imgs


def build_modules(kver: str, dest: Path) -> Path:
    """tt_peermem + the test provider built for the guest kernel in a copy under dest."""
    src = REPO / "kernel_driver"
    out = dest / "kernel_driver"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("build", "*.o", "*.ko", ".*.cmd", "*.mod*"))
    t0 = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.run(
        ["make", "-j2", "-C", f"/usr/src/linux-headers-{kver}", f"M={out}", "TPM_WITH_PROVIDER=m", "modules"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    mods = out / "mods"
    mods.mkdir()
    for ko in ("tt_peermem/tt_peermem.ko", "peermem_provider/peermem_provider.ko"):
        shutil.copy2(out / ko, mods)
    TIMES.append(f"module build for {kver}: {time.monotonic() - t0:.1f} s")
    return mods


def run(stage: str, script: str, **kw) -> qemu_guest.GuestResult:
    res = qemu_guest.run_job(script, **kw)
    TIMES.append(f"{stage}: {res.summary()}")
    if res.timed_out or res.rc is None:
        pytest.fail(
            f"{stage}: {res.summary()}\n--- last console lines ---\n" + "\n".join(res.output.splitlines()[-40:]),
            pytrace=False,
        )
    return res


def case_lines(output: str, prefix: str = "CASE ") -> dict[str, tuple[bool, str]]:
    out = {}
    for line in output.splitlines():
        if line.startswith(prefix):
            _, name, status, *rest = line.split(" ", 3) + [""]
            out[name] = (status == "PASS", " ".join(rest).strip())
    return out
