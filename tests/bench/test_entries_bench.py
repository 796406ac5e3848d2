"""``hawk bench entries`` end to end on a tiny workload: two real Mooncake TCP processes
per setting, the bytes checked, a row per setting with its ratio to the first, and the
JSON and plot written where ``--out`` says (a folder that does not exist yet)."""

import json

import pytest

from vllm_hawk.bench import entries_bench


def test_entries_bench_rows_ratios_and_outputs(tmp_path, capsys):
    pytest.importorskip("mooncake.engine")
    out = tmp_path / "new" / "entries.json"
    assert (
        entries_bench.main(
            [
                "--lanes",
                "1",
                "2",
                "--small-count",
                "40",
                "--large-count",
                "2",
                "--large-mib",
                "1",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert [r["lanes"] for r in res["rows"]] == [1, 2]
    base, two = res["rows"]
    assert base["small_ratio"] == 1.0 and base["large_ratio"] == 1.0
    assert two["small_us_per_entry"] > 0 and two["large_gbps"] > 0 and two["small_cpu_ms"] >= 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "us/entry" in capsys.readouterr().out


def test_entries_bench_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        entries_bench.main(["--small-count", "0"])
    assert "--small-count must be >= 1" in capsys.readouterr().err
