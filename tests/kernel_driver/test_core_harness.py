"""The pure logic of tt_peermem (range registry, page rounding, sg splitting at the
32-bit length limit, the map/unmap/invalidate state machine) passes its userspace
harness under AddressSanitizer + UndefinedBehaviorSanitizer."""

from __future__ import annotations

import re

from kdriver_helpers import have, require, run_make


def test_core_harness_under_sanitizers() -> None:
    require(have("make") and have("gcc"), "make/gcc not installed")
    proc = run_make("-B", "harness", timeout=180)  # -B: show the compile line
    out = proc.stdout
    assert proc.returncode == 0, out
    assert "-fsanitize=address,undefined" in out and "-fno-sanitize-recover" in out
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"(\d+) passed, (\d+) failed", last)
    assert m, f"unexpected final line: {last!r}"
    assert int(m.group(2)) == 0
    assert int(m.group(1)) >= 30
    assert "FAIL" not in out
    assert not re.search(r"runtime error|AddressSanitizer", out)
