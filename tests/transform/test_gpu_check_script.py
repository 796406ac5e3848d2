"""``scripts/gpu_check.py`` (the prepared check for a lent CUDA machine) runs its whole
path here with ``--device cpu``: the torch transform's bytes against the CPU kernel's for
bf16 and bfloat8_b, then a prefill endpoint per source (tile transform into bf16 and
bfloat8_b, ring gather) serving real KVRequests over its side channel, its ring's bytes
against the host path's, the tables and the JSON. On a GPU the same script runs on CUDA
memory (the ring in GPU memory, registered as ``cuda:0``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_on_the_cpu_and_finds_equal_bytes(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            "--device",
            "cpu",
            "--size-mb",
            "4",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    rows = report["transform"]
    assert [x["dtype"] for x in rows] == ["bfloat16", "bfloat8_b"]
    assert all(x["bytes_equal_cpu_kernel"] for x in rows)
    assert report["skipped"] == []  # msgspec and pyzmq are installed here
    pre = report["prefill"]
    assert [(x["source"], x["dtype"]) for x in pre] == [
        ("tile-transform", "bfloat16"),
        ("tile-transform", "bfloat8_b"),
        ("ring-gather", "vllm blocks"),
    ]
    for x in pre:
        assert x["bytes_equal_host"] and x["ring"] == "cpu" and x["registered"] == ["cpu"]
        assert x["kvready_ms"] > 0 and x["produce_gbps"] > 0 and x["copy_gbps"] > 0
    assert "equal" in r.stdout and "ratio" in r.stdout and "KVReady ms" in r.stdout
