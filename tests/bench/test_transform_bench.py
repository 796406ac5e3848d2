"""``hawk bench transform`` end to end on a small request: every source layout against the
copy in one run, the JSON where ``--out`` says (a folder not made yet), and the target
lines judged only for the rows the target is stated for (>= 40 MB, FlashAttention and
CPU vec, bf16 and bfloat8_b)."""

import json

from vllm_hawk.bench import transform_bench


def test_transform_bench_rows_and_outputs(tmp_path, capsys):
    out = tmp_path / "new" / "transform.json"
    assert (
        transform_bench.main(
            ["--model", "llama-3.1-8b", "--tp", "1", "--sizes-mb", "2", "--repeats", "1", "--out", str(out)]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert {(r["source"], r["dtype"]) for r in res["rows"]} == {
        (s, d) for s in transform_bench.SOURCES for d in ("bfloat16", "bfloat8_b")
    }
    assert all(r["e2e_ratio"] > 0 and r["kernel_ratio"] > 0 and r["e2e_cpu_ms"] > 0 for r in res["rows"])
    assert res["targets"] == []  # 2 MB: below the targets' 40 MB
    assert "e2e/copy" in capsys.readouterr().out


def test_targets_cover_flash_and_cpu_vec_at_40_mb_and_up():
    rows = [
        {"source": s, "dtype": d, "size_mb": mb, "e2e_ratio": r}
        for s, r in (("flash", 0.6), ("cpu", 0.4), ("amx", 0.3))
        for d in ("bfloat16", "bfloat8_b")
        for mb in (10.5, 38.0, 167.8)
    ]
    got = {(t["target"].split()[0], t["size_mb"], t["met"]) for t in transform_bench.targets(rows)}
    assert got == {(s, mb, s == "flash") for s in ("flash", "cpu") for mb in (38.0, 167.8)}
