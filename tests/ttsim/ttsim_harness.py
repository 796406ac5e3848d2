"""Helpers of tests/ttsim (its fixture is in conftest.py): tt-metal (ttnn 0.81.1) on
Tenstorrent's functional simulator vs the emulated device.

``scripts/ttsim_env.sh`` prepares the runtime (cached; the simulator folder comes from
HAWK_TTSIM_DIR or ../shared/ttsim). Each test module hands a job to
``tests/ttsim/ttsim_driver.py``, run once per simulated device in the Python 3.12 ttnn
environment, and compares its output in this (3.11) process. Without the simulator the
tests skip locally and FAIL under CI (env CI set), as the ttnn cross-check does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "ttsim" / "ttsim_driver.py"
# device profile -> simulator (manifest key)
DEVICES = {"p150a": "blackhole", "n150": "wormhole_b0"}


def fail_or_skip(msg: str):
    if os.environ.get("CI"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def run_driver(manifest: dict, device: str, job_dir: Path, tasks: list[dict]) -> list[dict]:
    """Run tasks on the simulated ``device`` (a profile name); returns the per-task results."""
    (job_dir / "job.json").write_text(json.dumps({"profile": device, "tasks": tasks}))
    env = dict(os.environ, **manifest["env"], TT_METAL_SIMULATOR=manifest["simulators"][DEVICES[device]])
    env["PYTHONPATH"] = str(REPO)
    t0 = time.monotonic()
    proc = subprocess.run(
        [manifest["python"], str(DRIVER), str(job_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=job_dir,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"tests/ttsim/ttsim_driver.py on {device} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
    res = json.loads((job_dir / "result.json").read_text())
    times = ", ".join(f"{t.get('kind', '?')} {r['seconds']}s" for t, r in zip(tasks, res[1:], strict=False))
    print(
        f"[ttsim] {device}: driver {time.monotonic() - t0:.1f}s (import {res[0]['import_s']}s; {times})",
        file=sys.stderr,
    )
    return res[1:]
