"""``hawk bench serve --quick --decode-first`` end to end, once (the CI smoke test of the serving
benchmark: real clusters, vLLM's load generator, decode-first on and off on each cluster;
the numbers are the benchmark's, not asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from e2e_helpers import tt_transfer_blocks

REPO = Path(__file__).resolve().parents[2]


def test_quick_sweep_runs_and_reports(tmp_path):
    out = tmp_path / "serve.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_hawk.cli",
            "bench",
            "serve",
            "--quick",
            "--decode-first",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    configs = {row["config"] for row in res["rows"]}
    assert configs == {"GG-Direct", "GN-HAWK", "collocated", "GG-Direct decode-first", "GN-HAWK decode-first"}
    assert all(row["failed"] == 0 and row["completed"] == 12 for row in res["rows"]), res["rows"]
    pd = [row for row in res["rows"] if row["config"] in ("GG-Direct", "GN-HAWK")]
    served = {w["rate"]: w["served_prompt_tokens"] for w in res["workloads"]}
    assert all(len(v) == 12 for v in served.values()), served
    for row in pd:  # every P/D request's stages were measured by the proxy and the connector
        b = row["breakdown"]
        # a vLLM decode pulls every prompt; a Tenstorrent one (32-token blocks) only those
        # longer than a block (it recomputes the rest itself)
        lens = served[row["rate"]]
        pulls = len(lens) if row["config"] == "GG-Direct" else sum(tt_transfer_blocks(n, 32) > 0 for n in lens)
        assert b["requests"] == 12 and b["pulls"] == pulls and b["dominant"] in res["breakdown_stages"], (b, lens)
        assert b["prefill"] > 0 and b["kv_ready"] > 0 and b["pull"] > 0 and b["first_step"] > 0, b
    assert {w["name"] for w in res["workloads"]} == {"sharegpt"} and res["workloads"][0]["prompt_params"]
    assert "GG-Direct" in res["summary"]["sharegpt"]["configs"]
    assert res["summary"]["sharegpt"]["gn_hawk_over_gg_direct"]
    assert "TTFT dominated by" in r.stdout and (tmp_path / "serve.png").exists()
    # decode-first: the same workload through a proxy with hawk proxy's defaults, on/off ratios
    on_off = {(e["config"], e["rate"]): e for e in res["decode_first"]}
    assert set(on_off) == {(c, rate) for c in ("GG-Direct", "GN-HAWK") for rate in (2.0, 6.0)}, on_off
    for e in on_off.values():
        assert 0 < e["local_share"] <= 1 and e["setting"] == "decode-first", e
        assert all(e[f"{m}_ratio"] > 0 for m in ("p50_ttft_ms", "p90_ttft_ms", "mean_ttft_ms", "output_throughput"))
    assert "decode-first on / off" in r.stdout
