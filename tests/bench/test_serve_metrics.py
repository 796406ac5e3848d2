"""``hawk bench serve``'s pure parts: seeded workloads and the SLO arithmetic."""

import json
import math
from pathlib import Path

import pytest

from vllm_hawk.bench import serve_bench as sb
from vllm_hawk.bench import serve_workloads as wl


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from vllm_hawk.bench.tiny_model import build_tiny_llama

    return AutoTokenizer.from_pretrained(str(build_tiny_llama(dtype="bfloat16")))


@pytest.mark.parametrize("name", list(wl.WORKLOADS))
def test_workload_is_seeded_sharegpt_format_and_fits(tmp_path, tok, name):
    a = wl.make_workload(name, tok, 30, 7, tmp_path / "a.json", max_model_len=1024)
    b = wl.make_workload(name, tok, 30, 7, tmp_path / "b.json", max_model_len=1024)
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    rows = json.loads((tmp_path / "a.json").read_text())
    assert len(rows) == 30 and all(len(r["conversations"]) == 2 for r in rows)
    for r in rows:
        p, o = (len(tok.encode(c["value"])) for c in r["conversations"])
        assert p + o <= 1024 and p >= 4 and o >= 4
    # the prompts' token counts as the server counts them (BOS included), in file order
    assert a["served_prompt_tokens"] == [len(tok.encode(r["conversations"][0]["value"])) for r in rows]
    assert a["prompt_params"] == wl.WORKLOADS[name]["prompt"] and a["seed"] == 7 and b["prompt_tokens"]["max"] > 0


def test_workload_bad_input_names_the_field(tmp_path, tok):
    with pytest.raises(ValueError, match="workload 'nope' unknown"):
        wl.make_workload("nope", tok, 3, 0, tmp_path / "x.json")
    with pytest.raises(ValueError, match="num_prompts"):
        wl.make_workload("sharegpt", tok, 0, 0, tmp_path / "x.json")


@pytest.mark.parametrize("block_size", [32, 64])
def test_block_edge_workloads_differ_by_the_one_token_a_vllm_decode_recomputes(tmp_path, tok, block_size):
    served = {}
    for name in ("block-edge", "block-edge+1"):
        d = wl.make_workload(name, tok, 20, 3, tmp_path / f"{name}.json", block_size=block_size)
        rows = json.loads((tmp_path / f"{name}.json").read_text())
        served[name] = [len(tok.encode(r["conversations"][0]["value"])) for r in rows]  # BOS included
        assert d["block_size"] == block_size and d["served_mod_block"] == [d["snap"]]
        assert all(n // block_size >= 2 for n in served[name])
    assert [a + 1 for a in served["block-edge"]] == served["block-edge+1"]  # the same draws, snapped


def test_snapped_prompt_len_nearest_blocks_at_least_two_and_fits():
    assert wl.snapped_prompt_len(100, 0, 32, 1000) == 96 and wl.snapped_prompt_len(100, 1, 32, 1000) == 97
    assert wl.snapped_prompt_len(8, 0, 32, 1000) == 64 and wl.snapped_prompt_len(8, 1, 64, 1000) == 129
    assert wl.snapped_prompt_len(5000, 1, 32, 200) == 193  # 6 blocks + 1 fit in 200 tokens
    with pytest.raises(ValueError, match="max-model-len"):
        wl.snapped_prompt_len(8, 1, 32, 64)
    with pytest.raises(ValueError, match="snap 0 or 1"):
        wl.snapped_prompt_len(8, 2, 32, 1000)


def _result(ttfts, lats, outs, errs):
    return {"ttfts": ttfts, "latencies": lats, "output_lens": outs, "errors": errs}


def test_attainment_counts_failed_requests_as_missed():
    reqs = wl.per_request(_result([0.1, 0.5, 0.0], [1.1, 0.9, 0.0], [11, 5, 0], ["", "", "boom"]))
    assert reqs[0]["tpot_ms"] == pytest.approx(100.0) and reqs[1]["tpot_ms"] == pytest.approx(100.0)
    assert not reqs[2]["ok"] and math.isinf(reqs[2]["ttft_ms"])
    assert wl.attainment(reqs, 200, 150) == (pytest.approx(1 / 3), 1)
    assert wl.attainment(reqs, 1000, 150) == (pytest.approx(2 / 3), 2)
    st = wl.latency_stats(reqs)
    assert st["p50_ttft_ms"] == pytest.approx(300.0) and st["p90_tpot_ms"] == pytest.approx(100.0)


def test_knee_is_the_first_rate_below_and_throughput_at_the_last_above():
    pts = [
        {"rate": 1, "a": 1.0, "output_throughput": 10},
        {"rate": 2, "a": 0.95, "output_throughput": 20},
        {"rate": 4, "a": 0.5, "output_throughput": 25},
        {"rate": 8, "a": 0.92, "output_throughput": 30},
    ]
    assert wl.knee(pts, "a") == {"rate_below": 4, "throughput_at": 20, "rate_at": 2}
    assert wl.knee(pts[:2], "a")["rate_below"] is None
    assert wl.knee([{"rate": 1, "a": 0.1, "output_throughput": 1}], "a")["throughput_at"] is None


def test_breakdown_stages_from_histogram_deltas():
    z = {}
    proxy = {
        "hawk_proxy_prefill_seconds_sum": 1.0,
        "hawk_proxy_prefill_seconds_count": 10,
        "hawk_proxy_ttft_seconds_sum": 3.0,
        "hawk_proxy_ttft_seconds_count": 10,
    }
    dec = {
        "vllm:request_queue_time_seconds_sum": 1.2,
        "vllm:request_queue_time_seconds_count": 10,
        "vllm:hawk_transfer_time_seconds_sum": 0.5,
        "vllm:hawk_transfer_time_seconds_count": 10,
        "vllm:hawk_kv_ready_seconds_sum": 0.3,
        "vllm:hawk_kv_ready_seconds_count": 10,
        "vllm:hawk_kv_read_seconds_sum": 0.2,
        "vllm:hawk_kv_read_seconds_count": 10,
        "vllm:request_prefill_time_seconds_sum": 0.4,
        "vllm:request_prefill_time_seconds_count": 10,
        "vllm:request_prompt_tokens_sum": 650.0,
        "vllm:request_prompt_tokens_count": 10,
        "vllm:hawk_transfer_bytes_sum": 10 * 131072.0,
        "vllm:hawk_transfer_bytes_count": 10,
    }
    b = sb.breakdown((z, proxy), (z, dec))
    assert b["prefill"] == pytest.approx(100) and b["decode_queue"] == pytest.approx(70)
    assert b["kv_ready"] == pytest.approx(30) and b["pull"] == pytest.approx(20)
    assert b["first_step"] == pytest.approx(40) and b["proxy_http"] == pytest.approx(300 - 100 - 120 - 40)
    assert b["dominant"] == "prefill" and b["requests"] == 10
    assert b["decode_prompt_tokens"] == pytest.approx(65) and b["pull_kib"] == pytest.approx(128)


def test_cli_rejects_unknown_configuration(capsys):
    with pytest.raises(SystemExit):
        sb.main(["--configs", "GX-Nope"])
    assert "GX-Nope" in capsys.readouterr().err


def test_multiturn_sessions_share_their_prefixes(tmp_path, tok):
    d = wl.make_workload("multiturn", tok, 12, 5, tmp_path / "m.json", max_model_len=1024)
    rows = json.loads((tmp_path / "m.json").read_text())
    prompts = [r["conversations"][0]["value"] for r in rows]
    turns = wl.WORKLOADS["multiturn"]["turns"]
    for i, p in enumerate(prompts):
        if i % turns:  # a later turn extends the one before it (unless its session was full)
            assert p.startswith(prompts[i - 1]) or len(tok.encode(prompts[i - 1])) > 600, i
        assert len(tok.encode(p)) + len(tok.encode(rows[i]["conversations"][1]["value"])) <= 1024
    assert d["served_prompt_tokens"] == [len(tok.encode(p)) for p in prompts]


def _point(config, rate, ttfts, out, dur, **extra):
    reqs = [{"ok": True, "ttft_ms": t, "tpot_ms": 1.0, "e2e_ms": t + 10, "out": 4} for t in ttfts]
    p = {"config": config, "workload": "w", "rate": rate, "duration_s": dur, "wall_s": dur, "completed": len(reqs)}
    return {**p, "failed": 0, "output_tokens": out, "requests": reqs, "errors": [], **extra}


def test_rounds_pool_requests_and_add_durations():
    a = _point("C x", 1.0, [10, 20], 8, 2.0, baseline="C", setting="x", prefills={"local/short_prompt": 2.0})
    b = _point("C x", 1.0, [30], 4, 1.0, baseline="C", setting="x", prefills={"local/short_prompt": 1.0})
    b["prefills"]["remote/long_prompt"] = 1.0  # a reason of the second round only
    m = sb.merge_rounds([a, b])
    assert [r["ttft_ms"] for r in m["requests"]] == [10, 20, 30] and m["rounds"] == 2
    assert m["duration_s"] == 3.0 and m["output_tokens"] == 12 and m["completed"] == 3
    assert m["prefills"] == {"local/short_prompt": 3.0, "remote/long_prompt": 1.0} and sb.merge_rounds([a]) == a


def test_decode_first_ratios_are_on_over_off_of_the_same_workload_and_rate():
    from vllm_hawk.bench import decode_first as df

    off = _point("C", 2.0, [100, 200, 300], 30, 3.0)
    on = _point("C x", 2.0, [50, 100, 150], 33, 3.0, baseline="C", setting="x")
    on["prefills"] = {"local/short_prompt": 2.0, "remote/long_prompt": 1.0, "tokenize_sum": 0.02, "tokenize_count": 2}
    rows = sb.analyse([off, on, _point("C", 4.0, [1], 1, 1.0)], [])
    (e,) = df.ratios(rows)
    assert (e["config"], e["setting"], e["rate"]) == ("C", "x", 2.0)
    assert e["p50_ttft_ms_ratio"] == 0.5 and e["mean_ttft_ms_ratio"] == 0.5 and e["output_throughput_ratio"] == 1.1
    assert e["local_share"] == 2 / 3 and e["tokenize_mean_ms"] == 10.0


def test_each_round_serves_new_prompts_and_every_target_of_a_round_the_same(tmp_path, tok):
    plan = sb._plan(sb._parser(), sb._parser().parse_args(["--workloads", "sharegpt", "--rates", "1", "2"]))
    plan.work, plan.num, plan.rounds = tmp_path, 3, 2
    datasets, described, _ = sb._make_datasets(plan, tok, 0, 1024)
    files = datasets["sharegpt"]
    assert [len(f) for f in files] == [2, 2] and len({p for f in files for p in f}) == 4
    texts = [[Path(p).read_text() for p in f] for f in files]
    assert texts[0][0] != texts[0][1] and texts[0][0] != texts[1][0]
    assert [(d["rate"], d["round"]) for d in described] == [(1.0, 0), (1.0, 1), (2.0, 0), (2.0, 1)]


def test_decode_first_settings_name_each_rule_alone():
    from vllm_hawk.bench import decode_first as df

    s = df.settings_of(True, [64], [0.5], 32)
    assert [x.name for x in s] == ["decode-first", "local<64", "cached>=0.5"]
    assert s[1].args == (
        "--local-prefill-max-tokens",
        "64",
        "--local-prefill-min-cached",
        "0",
        "--decode-block-size",
        "32",
    )
    with pytest.raises(ValueError, match="repeat"):
        df.settings_of(False, [64, 64], [], 32)
    with pytest.raises(SystemExit):
        sb._plan(sb._parser(), sb._parser().parse_args(["--local-prefill-min-cached", "1.5"]))
