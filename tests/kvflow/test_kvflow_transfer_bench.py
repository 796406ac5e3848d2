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
    rc = transfer_bench.main(["--model", "llama-3.1-8b", "--prefill-tp", "1", "--sizes-mb", "2", "--repeats", "1",
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
    rc = transfer_bench.main(["--model", "llama-3.1-8b", "--prefill-tp", "1", "--sizes-mb", "1", "--repeats", "1",
                              "--rows", "GG-Direct", "GN-HAWK pipelined", "--out", str(out)])
    assert rc == 0 and out.exists() and (tmp_path / "new" / "x.png").exists()


def test_two_chips_pull_one_shard_each(tmp_path, capsys):
    """Prefill TP=2 -> 2 chips: two prefill processes, each chip pulls its rank's shard
    (concurrently); per-chip bytes, bytes per bank, segments and READs are the layout
    model's (``hawk layout``) and add up to the totals."""
    from vllm_hawk.layout_report import layout_report

    out = tmp_path / "t.json"
    rc = transfer_bench.main(["--model", "llama-3.1-8b", "--prefill-tp", "2", "--chips", "2", "--sizes-mb", "1",
                              "--repeats", "1", "--rows", "GG-Direct", "GN-HAWK staged", "--out", str(out),
                              "--plot", ""])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["pulls"] == [{"chip": 0, "prefill_rank": 0, "heads": [0, 4]},
                                      {"chip": 1, "prefill_rank": 1, "heads": [4, 8]}]
    by = {(r["row"], r["dtype"]): r for r in res["rows"]}
    for dtype in ("bfloat16", "bfloat8_b"):
        r = by[("GN-HAWK staged", dtype)]
        lay = layout_report("llama-3.1-8b", 2, 2, "p150a", dtype, 64, r["blocks"] * 64)
        assert len(r["chips"]) == 2
        for c, want in zip(r["chips"], lay["chips"]):
            assert c["bytes_moved"] == want["target_bytes"] and c["bytes_per_bank"] == want["max_bytes_per_bank"]
            assert c["segments"] == want["segments"] == 8 and c["entries"] == want["reads_staged"]
        assert r["bytes_moved"] == lay["totals"]["target_bytes"] and r["entries"] == lay["totals"]["reads_staged"]
    gd = by[("GG-Direct", "bfloat16")]
    assert gd["bytes_moved"] == by[("GN-HAWK staged", "bfloat16")]["bytes_moved"] == 2 * gd["bytes_per_chip"]
    assert all(s["requests"] == 0 and s["served"] == s["released"] for s in res["prefill_snapshot"].values())
    assert {k.split("@")[1] for k in res["prefill_snapshot"]} == {"rank0", "rank1"}
    assert "run concurrently, one thread per chip" in capsys.readouterr().out
