"""Shared helpers for the kernel_driver tests.

These tests build the tt_peermem module against Debian's 6.1 and 6.12 header trees
and run the userspace sanitizer harness. They need root-installed Debian packages
(scripts/kernel_deps.sh). Outside CI a missing prerequisite skips with the reason;
under CI (CI=true) it fails, so a broken CI setup cannot pass silently.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KDRIVER = REPO / "kernel_driver"
IN_CI = os.environ.get("CI", "").lower() == "true"


def require(ok: bool, reason: str) -> None:
    """Skip (locally) or fail (under CI=true) when a prerequisite is missing."""
    if ok:
        return
    msg = f"{reason} (install with: sudo scripts/kernel_deps.sh)"
    if IN_CI:
        pytest.fail(f"CI=true and {msg}")
    pytest.skip(msg)


def header_dirs(series: str) -> list[str]:
    """Installed Debian amd64 header trees of one series ("6.1" or "6.12")."""
    return sorted(
        d for d in glob.glob(f"/usr/src/linux-headers-{series}.*-amd64") if os.path.isfile(os.path.join(d, "Makefile"))
    )


def run_make(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run make in kernel_driver/, stdout+stderr merged into .stdout.

    LD_PRELOAD is dropped: vLLM's CPU platform adds libraries to it in this process when an
    engine is built, and ASan refuses to start unless its runtime comes first."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(KDRIVER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=env,
    )


def have(tool: str) -> bool:
    return shutil.which(tool) is not None
