"""``hawk bench transfer`` runs end to end on a small size and writes its JSON and plot."""
from __future__ import annotations

import json

import pytest

from vllm_hawk.bench import transfer_bench

try:
    import mooncake.engine  # noqa: F401
except Exception:  # noqa: BLE001
    pytest.skip("mooncake not installed", allow_module_level=True)


def test_transfer_bench_smoke(tmp_path, capsys):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = transfer_bench.main(["--model", "llama-3.1-8b", "--tp", "8", "--sizes-mb", "2", "--repeats", "1",
                              "--per-tile-cap-s", "0.05", "--out", str(out), "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 0
    res = json.loads(out.read_text())
    rows = {(r["row"], r["dtype"]) for r in res["rows"]}
    assert rows == ({(r, "bfloat16") for r in transfer_bench.ROWS}
                    | {(r, "bfloat8_b") for r in transfer_bench.HAWK_BFP8_ROWS})
    by = {(r["row"], r["dtype"]): r for r in res["rows"]}
    assert by[("GN-HAWK staged", "bfloat16")]["bytes_moved"] == by[("GG-Direct", "bfloat16")]["bytes_moved"]
    assert by[("GN-HAWK staged", "bfloat8_b")]["bytes_moved"] * 2048 == \
        by[("GN-HAWK staged", "bfloat16")]["bytes_moved"] * 1088  # bfp8 moves 1088/2048 of the bytes
    assert by[("GG-Host", "bfloat16")]["norm_gg_host"] == 1.0
    assert by[("GG-Direct", "bfloat16")]["norm_gg_direct"] == 1.0
    assert all(r["cpu_ms"] > 0 for r in res["rows"])
    assert {t["target"].split(" ")[0] for t in res["targets"]} == {"best", "per-tile", "GN-Host"}
    snap = res["prefill_snapshot"]
    assert all(s["requests"] == 0 and s["served"] == s["released"] for s in snap.values())
    assert "targets (ratios within this run)" in capsys.readouterr().out


def test_outputs_follow_out_and_folders_are_created(tmp_path):
    """A fresh clone has no results/: the JSON and the plot go where --out says."""
    out = tmp_path / "new" / "x.json"
    rc = transfer_bench.main(["--model", "llama-3.1-8b", "--tp", "8", "--sizes-mb", "1", "--repeats", "1",
                              "--rows", "GG-Direct", "GN-HAWK pipelined", "--out", str(out)])
    assert rc == 0 and out.exists() and (tmp_path / "new" / "x.png").exists()
