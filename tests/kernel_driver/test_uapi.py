"""The /dev/tt_peermem user-space header compiles as plain C and its ABI is stable
(sizes and ioctl numbers are what user-space bindings hard-code)."""

from __future__ import annotations

import subprocess

from kdriver_helpers import KDRIVER, have, require

# What a Python binding (fcntl.ioctl) would use.
REGISTER_IOCTL = 0xC028F701  # _IOWR(0xF7, 1, 40-byte struct)
UNREGISTER_IOCTL = 0x4008F702  # _IOW(0xF7, 2, 8-byte struct)

PROBE = f"""
#include <stddef.h>
#include "tt_peermem_uapi.h"
_Static_assert(sizeof(struct tt_peermem_register) == 40, "register size");
_Static_assert(offsetof(struct tt_peermem_register, va_start) == 16, "va_start");
_Static_assert(offsetof(struct tt_peermem_register, dmabuf_offset) == 32, "off");
_Static_assert(sizeof(struct tt_peermem_unregister) == 8, "unregister size");
_Static_assert(TT_PEERMEM_IOCTL_REGISTER == {REGISTER_IOCTL:#x}u, "REGISTER nr");
_Static_assert(TT_PEERMEM_IOCTL_UNREGISTER == {UNREGISTER_IOCTL:#x}u, "UNREGISTER nr");
int main(void) {{ return 0; }}
"""


def test_uapi_header_layout(tmp_path) -> None:
    require(have("gcc"), "gcc not installed")
    src = tmp_path / "probe.c"
    src.write_text(PROBE)
    proc = subprocess.run(
        ["gcc", "-std=c11", "-Wall", "-Werror", "-I", str(KDRIVER / "tt_peermem"), "-fsyntax-only", str(src)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
