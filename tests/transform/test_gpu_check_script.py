"""``scripts/gpu_check.py`` (the prepared check for a lent CUDA machine) runs its whole
path here with ``--device cpu``: the torch transform's bytes against the CPU kernel's for
bf16 and bfloat8_b, then a prefill endpoint per source (tile transform into bf16 and
bfloat8_b, ring gather) serving real KVRequests over its side channel, its ring's bytes
against the host path's, the tables and the JSON. On a GPU the same script runs on CUDA
memory (the ring in GPU memory, registered as ``cuda:0``). ``--suite full`` runs its four
sections (matrix, speed, capture, replay) at small sizes here; no GPU has run it."""

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


def test_gpu_check_full_suite_on_the_cpu_writes_every_section(tmp_path):
    """``--suite full --device cpu``: the matrix (every source layout x source and
    destination block sizes x dtypes x whole / layer group / head share, the torch path
    against the CPU reference), the speed rows (CPU timer, no device counts), the
    connector's warm-up timed with the captures skipped, 20 KVRequests idle and under a
    KV-writing thread with equal bytes; one JSON per section and a summary."""
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--suite", "full", "--device", "cpu"]
        + ["--repeats", "2", "--out-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and set(summary["sections"]) == {"matrix", "speed", "checksum", "capture", "replay"}
    checks = json.loads((out / "checksum.json").read_text())["rows"]
    assert [x["impl"] for x in checks] == ["numba", "numba"] and all(x["equal_host"] for x in checks)
    matrix = json.loads((out / "matrix.json").read_text())
    torch_rows = [x for x in matrix["rows"] if x["impl"] == "torch"]
    assert len(torch_rows) == 6 * 3 * 2 * 3 * 3 and all(x["bytes_equal"] for x in torch_rows)
    assert {x["share"] for x in torch_rows} == {"whole", "layer-group", "head-share"}
    assert {x["ref"] for x in torch_rows} == {"numba", "numba-regrouped"}  # 16-token sources: regrouped first
    assert any(x["token_offset"] for x in torch_rows)  # a span starting inside a source block
    speed = json.loads((out / "speed.json").read_text())["rows"]
    assert {x["order"] for x in speed} == {"contiguous", "scattered"} and {x["impl"] for x in speed} == {
        "cpu_kernel",
        "torch",
    }
    for x in speed:
        assert x["timer"] == "cpu-perf-counter" and x["kernels"] is None and x["peak_mb"] is None
        assert x["bytes_equal_torch"] and x["transform_gbps"] > 0 and x["copy_gbps"] > 0
    cap = json.loads((out / "capture.json").read_text())
    assert cap["captures"] == [] and "no CUDA graphs on CPU" in cap["skipped"] and cap["make_prefill_ms"] > 0
    rep = json.loads((out / "replay.json").read_text())
    assert rep["requests"] == 20 and rep["registered"] == ["cpu"]
    assert rep["idle"]["bytes_equal"] and rep["load"]["bytes_equal"] and rep["load"]["kind"] == "cpu-thread-kv-writes"
    assert rep["load"]["load_runs"] > 0 and rep["idle"]["kvready_ms_p95"] >= rep["idle"]["kvready_ms_p50"] > 0
    assert "KVReady ms" in r.stdout and "no CUDA graphs on CPU" in r.stdout
