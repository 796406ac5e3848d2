"""tt_peermem and its test provider build warning-free (W=1, sparse C=2, -Werror)
against each supported Debian kernel series.

Only the build is checked here: loading runs in a QEMU guest (tests/guest), and
the hardware path (a real NIC and a real Tenstorrent dma-buf) is never exercised
in CI.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from kdriver_helpers import KDRIVER, have, header_dirs, require, run_make

WARNING_LINE = re.compile(r"warning|error", re.IGNORECASE)


@pytest.mark.parametrize("series", ["6.1", "6.12"])
def test_module_builds_without_warnings(series: str) -> None:
    require(have("make") and have("gcc"), "make/gcc not installed")
    require(have("sparse"), "sparse not installed")
    dirs = header_dirs(series)
    require(bool(dirs), f"no /usr/src/linux-headers-{series}.*-amd64 header tree")
    kdir = dirs[-1]
    kver = kdir.removeprefix("/usr/src/linux-headers-")

    proc = run_make("check-kernels", f"CHECK_KDIRS={kdir}")
    assert proc.returncode == 0, proc.stdout

    log = (KDRIVER / "build" / kver / "build.log").read_text()
    warnings = [line for line in log.splitlines() if WARNING_LINE.search(line)]
    assert warnings == [], "\n".join(warnings)
    # sparse really ran on every C file (C=2), and both modules were linked.
    for src in ("tt_peermem_main.c", "peermem_core.c", "peermem_provider.c"):
        assert re.search(rf"^\s+CHECK\s+\S*{src}$", log, re.MULTILINE), f"sparse skipped {src}"
    for ko in ("tt_peermem/tt_peermem.ko", "peermem_provider/peermem_provider.ko"):
        assert (KDRIVER / "build" / kver / ko).is_file()
    assert f"ok: {kver}" in proc.stdout


def test_check_fails_on_a_warning(tmp_path) -> None:
    """The warning gate is real: a sparse-only warning makes check-kernels fail.
    Runs on a copy of kernel_driver/ so the source tree is never touched."""
    require(have("sparse") and have("make"), "sparse/make not installed")
    dirs = header_dirs("6.12") or header_dirs("6.1")
    require(bool(dirs), "no 6.1/6.12 header tree")
    copy = tmp_path / "kernel_driver"
    shutil.copytree(KDRIVER, copy, ignore=shutil.ignore_patterns("build", "*.o", "*.ko", ".*.cmd"))
    (copy / "peermem_provider" / "zz_warning_bait.c").write_text(
        'void *zz_bait(void);\nvoid *zz_bait(void) { return 0; }\n#include <linux/module.h>\nMODULE_LICENSE("GPL");\n'
    )
    with open(copy / "peermem_provider" / "Kbuild", "a") as f:
        f.write("obj-m += zz_warning_bait.o\n")
    proc = subprocess.run(
        ["make", "--no-print-directory", "-C", str(copy), "check-kernels", f"CHECK_KDIRS={dirs[-1]}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "Using plain integer as NULL pointer" in proc.stdout
