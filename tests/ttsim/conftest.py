"""tests/ttsim fixtures; see ttsim_harness.py for what the group checks and how."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ttsim_harness import REPO, fail_or_skip


@pytest.fixture(scope="session")
def ttsim_manifest() -> dict:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "ttsim_env.sh")], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        fail_or_skip(
            f"scripts/ttsim_env.sh failed (rc={proc.returncode}): no ttnn-on-ttsim runtime; "
            f"set HAWK_TTSIM_DIR to ttsim's libraries\n{proc.stderr[-3000:]}"
        )
    manifest = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    print(f"[ttsim] runtime ready in {time.monotonic() - t0:.1f}s, SFPI: {manifest['sfpi']}", file=sys.stderr)
    return manifest
