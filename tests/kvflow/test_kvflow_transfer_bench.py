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
    out, png = tmp_path / "t.json", tmp_path / "plots" / "t.png"  # --plot in a folder not made yet
    rc = transfer_bench.main(
        [
            "--model",
            "llama-3.1-8b",
            "--prefill-tp",
            "1",
            "--sizes-mb",
            "2",
            "--repeats",
            "1",
            "--per-tile-cap-s",
            "0.05",
            "--out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0 and png.stat().st_size > 0
    res = json.loads(out.read_text())
    rows = {(r["row"], r["dtype"]) for r in res["rows"]}
    assert rows == (
        {(r, "bfloat16") for r in transfer_bench.ROWS} | {(r, "bfloat8_b") for r in transfer_bench.HAWK_BFP8_ROWS}
    )
    by = {(r["row"], r["dtype"]): r for r in res["rows"]}
    assert by[("GN-HAWK staged", "bfloat16")]["bytes_moved"] == by[("GG-Direct", "bfloat16")]["bytes_moved"]
    assert (
        by[("GN-HAWK staged", "bfloat8_b")]["bytes_moved"] * 2048
        == by[("GN-HAWK staged", "bfloat16")]["bytes_moved"] * 1088
    )  # bfp8 moves 1088/2048 of the bytes
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
    rc = transfer_bench.main(
        [
            "--model",
            "llama-3.1-8b",
            "--prefill-tp",
            "1",
            "--sizes-mb",
            "1",
            "--repeats",
            "1",
            "--rows",
            "GG-Direct",
            "GN-HAWK pipelined",
            "--out",
            str(out),
        ]
    )
    assert rc == 0 and out.exists() and (tmp_path / "new" / "x.png").exists()


def test_two_chips_pull_one_shard_each(tmp_path, capsys):
    """Prefill TP=2 -> 2 chips: two prefill processes, each chip pulls its rank's shard
    (concurrently); per-chip bytes, bytes per bank, segments and READs are the layout
    model's (``hawk layout``) and add up to the totals."""
    from vllm_hawk.layout_report import layout_report

    out = tmp_path / "t.json"
    rc = transfer_bench.main(
        [
            "--model",
            "llama-3.1-8b",
            "--prefill-tp",
            "2",
            "--chips",
            "2",
            "--sizes-mb",
            "1",
            "--repeats",
            "1",
            "--rows",
            "GG-Direct",
            "GN-HAWK staged",
            "--out",
            str(out),
            "--plot",
            "",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert [(p["chip"], p["prefill_ranks"], p["heads"]) for p in res["config"]["pulls"]] == [
        (0, [0], [0, 4]),
        (1, [1], [4, 8]),
    ]
    by = {(r["row"], r["dtype"]): r for r in res["rows"]}
    for dtype in ("bfloat16", "bfloat8_b"):
        r = by[("GN-HAWK staged", dtype)]
        lay = layout_report("llama-3.1-8b", 2, 2, "p150a", dtype, 64, r["blocks"] * 64)
        assert len(r["chips"]) == 2
        for c, want in zip(r["chips"], lay["chips"], strict=False):
            assert c["bytes_moved"] == want["target_bytes"] and c["bytes_per_bank"] == want["max_bytes_per_bank"]
            assert c["segments"] == want["segments"] == 8 and c["entries"] == want["reads_staged"]
        assert r["bytes_moved"] == lay["totals"]["target_bytes"] and r["entries"] == lay["totals"]["reads_staged"]
    gd = by[("GG-Direct", "bfloat16")]
    assert gd["bytes_moved"] == by[("GN-HAWK staged", "bfloat16")]["bytes_moved"] == 2 * gd["bytes_per_chip"]
    assert all(s["requests"] == 0 and s["served"] == s["released"] for s in res["prefill_snapshot"].values())
    assert {k.split("@")[1] for k in res["prefill_snapshot"]} == {"rank0", "rank1"}
    assert "run concurrently, one thread per chip" in capsys.readouterr().out


def _request_bytes(model: str, blocks: int) -> int:
    from vllm_hawk.layout.model_shapes import load_model_shape

    return int(blocks * 64 * load_model_shape(model).kv_bytes_per_token(1, 2))


def test_one_prefill_rank_serves_two_chips(tmp_path, capsys):
    """Prefill TP=1 -> 2 chips: each chip pulls its half of the rank's heads as a share (the
    rank frees the request after both); the chips' bytes add up to the whole request, and a
    staged share lands as one segment per DRAM bank."""
    from vllm_hawk.layout_report import layout_report

    out = tmp_path / "t.json"
    rc = transfer_bench.main(
        [
            "--model",
            "llama-3.1-8b",
            "--prefill-tp",
            "1",
            "--chips",
            "2",
            "--sizes-mb",
            "1",
            "--repeats",
            "1",
            "--rows",
            "GG-Direct",
            "GG-Staged",
            "GN-Host",
            "GN-HAWK staged",
            "--out",
            str(out),
            "--plot",
            "",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["failed"] == []
    assert [(p["chip"], p["prefill_ranks"], p["heads"]) for p in res["config"]["pulls"]] == [
        (0, [0], [0, 4]),
        (1, [0], [4, 8]),
    ]
    assert [p["shares"][0]["src_heads"] for p in res["config"]["pulls"]] == [[0, 4], [4, 8]]
    by = {(r["row"], r["dtype"]): r for r in res["rows"]}
    whole = _request_bytes("llama-3.1-8b", by[("GG-Direct", "bfloat16")]["blocks"])
    for key in (
        ("GG-Direct", "bfloat16"),
        ("GG-Staged", "bfloat16"),
        ("GN-Host", "bfloat16"),
        ("GN-HAWK staged", "bfloat16"),
    ):
        assert [c["prefill_ranks"] for c in by[key]["chips"]] == [[0], [0]]
        assert sum(c["bytes_moved"] for c in by[key]["chips"]) == by[key]["bytes_moved"] == whole, key
    assert [c["segments"] for c in by[("GG-Staged", "bfloat16")]["chips"]] == [32, 32]  # a layer each (ring)
    for dtype in ("bfloat16", "bfloat8_b"):
        r = by[("GN-HAWK staged", dtype)]
        lay = layout_report("llama-3.1-8b", 1, 2, "p150a", dtype, 64, r["blocks"] * 64)
        for c, want in zip(r["chips"], lay["chips"], strict=False):
            assert c["segments"] == lay["num_banks"] == 8 and c["entries"] == want["reads_staged"]
            assert c["bytes_moved"] == want["target_bytes"] and c["bytes_per_bank"] == want["max_bytes_per_bank"]
    assert all(s["requests"] == 0 for s in res["prefill_snapshot"].values())
    assert {k.split("@")[1] for k in res["prefill_snapshot"]} == {"rank0"}
    assert "rank 0 -> chip 0, rank 0 -> chip 1" in capsys.readouterr().out


def test_two_prefill_ranks_fill_one_decode_gg_rows(tmp_path, capsys):
    """Prefill TP=2 -> 1 decode, GG rows: the decode pulls a share from each rank into its
    vLLM-layout cache restricted to those heads; the shares add up to the whole request."""
    out = tmp_path / "t.json"
    rc = transfer_bench.main(
        [
            "--model",
            "llama-3.1-8b",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "1",
            "--sizes-mb",
            "1",
            "--repeats",
            "1",
            "--rows",
            "GG-Host",
            "GG-Direct",
            "GG-Staged",
            "--out",
            str(out),
            "--plot",
            "",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["failed"] == []
    (pull,) = res["config"]["pulls"]
    assert pull["prefill_ranks"] == [0, 1] and [s["dst_heads"] for s in pull["shares"]] == [[0, 4], [4, 8]]
    assert {r["row"] for r in res["rows"]} == {"GG-Host", "GG-Direct", "GG-Staged"}
    for r in res["rows"]:
        (c,) = r["chips"]
        assert c["prefill_ranks"] == [0, 1] and c["segments"] > 0
        assert c["bytes_moved"] == r["bytes_moved"] == _request_bytes("llama-3.1-8b", r["blocks"]), r["row"]
    assert all(s["requests"] == 0 for s in res["prefill_snapshot"].values())
    assert {k.split("@")[1] for k in res["prefill_snapshot"]} == {"rank0", "rank1"}
    assert "ranks 0+1 -> chip 0" in capsys.readouterr().out


def test_integrity_both_reports_the_cost_of_the_check_as_ratios(tmp_path, capsys):
    """``--integrity both``: checked and unchecked pulls alternate in one run; every row
    gives its latency and CPU time over the unchecked ones, and the decode's check time."""
    out = tmp_path / "i.json"
    argv = ["--model", "llama-3.1-8b", "--prefill-tp", "1", "--sizes-mb", "2", "--repeats", "2"]
    argv += ["--rows", "GG-Direct", "GN-HAWK staged", "GN-HAWK direct", "--integrity", "both"]
    rc = transfer_bench.main([*argv, "--out", str(out), "--plot", ""])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["integrity"] == "both"
    for r in res["rows"]:
        assert r["integrity"] == "both" and r["check_ratio"] > 0 and r["latency_unchecked_ms"] > 0, r
        assert r["check_ms"] > 0, r  # the decode checked the pulls it timed
    assert "/unchecked" in capsys.readouterr().out
