"""The ``hawk`` command line: subcommands run as a user runs them (a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def hawk(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "vllm_hawk.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def test_help_lists_commands():
    r = hawk("--help")
    assert r.returncode == 0 and "layout" in r.stdout and "doctor" in r.stdout


def test_layout_default_is_the_70b_p150a_case():
    r = hawk("layout", "--tokens", "1024")
    assert r.returncode == 0, r.stderr
    assert "prefill TP=4 (2 KV heads/rank) -> decode TP=4: 4 x p150a (8 DRAM banks) with 2 KV" in r.stdout
    assert "llama-3.1-70b" in r.stdout and "bfloat8_b" in r.stdout
    r = hawk("layout", "--tokens", "1024", "--json")
    rep = json.loads(r.stdout)
    assert rep["num_banks"] == 8 and rep["blocks"] == 16
    # 16 blocks x 16 tiles x 160 tensors x 1088 B, spread evenly over the 8 banks
    assert rep["target_bytes"] == 16 * 16 * 160 * 1088
    assert {b["bytes"] for b in rep["banks"]} == {16 * 16 * 160 * 1088 // 8}
    staged = [p for p in rep["plans"] if p["mode"] == "staged"]
    assert all(p["rdma_ops"] == 8 for p in staged)
    assert [c["prefill_ranks"] for c in rep["chips"]] == [[0], [1], [2], [3]]
    assert rep["totals"]["target_bytes"] == 4 * rep["target_bytes"] and rep["totals"]["segments"] == 32


def test_layout_bad_input_names_the_problem():
    r = hawk("layout", "--device", "p999")
    assert r.returncode == 2 and "unknown device profile 'p999'" in r.stderr
    r = hawk("layout", "--tokens", "0")
    assert r.returncode != 0 and "--tokens" in r.stderr


def test_bench_transform_smoke(tmp_path):
    out = tmp_path / "t.json"
    r = hawk(
        "bench",
        "transform",
        "--sizes-mb",
        "1",
        "--repeats",
        "1",
        "--sources",
        "flash",
        "amx",
        "--out",
        str(out),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {row["dtype"] for row in rows} == {"bfloat16", "bfloat8_b"}
    assert {row["source"] for row in rows} == {"flash", "amx"}
    assert all(row["kernel_ratio"] > 0 and row["e2e_ratio"] > 0 and row["cpu_ratio"] > 0 for row in rows)


def test_proxy_refuses_the_removed_renew_option_naming_handover_s():
    """The proxy no longer renews leases (the prefill holds a request through its hand-over
    by itself): the old option stops start-up with what to set instead."""
    from vllm_hawk.proxy import parse_args, releaser_of

    args = parse_args(["--prefill", "http://p", "--decode", "http://d", "--renew-interval-s", "1"])
    with pytest.raises(SystemExit, match=r"--renew-interval-s.*handover_s"):
        releaser_of(args)
    rel = releaser_of(parse_args(["--prefill", "http://p", "--decode", "http://d", "--side-channel-auth", "none"]))
    assert rel is not None and not hasattr(rel, "keeper")  # releases only
    rel.close()
