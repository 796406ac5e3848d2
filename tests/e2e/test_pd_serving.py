"""Disaggregated serving end to end: prefill vLLM + decode vLLM (HawkConnector, GG-Direct
over Mooncake TCP) + ``hawk proxy``, one module-scoped trio shared by the tests.

The prefill's blocks hold 32 tokens, the decode's 64 (vLLM's CPU attention takes
multiples of 32 only): the decode READs two prefill blocks into each of its own and
regroups them (``vllm_hawk.kvflow.regroup``), so every test here runs that path. GG
pairs with equal block sizes run in ``test_fronts``, ``test_tp``, ``test_pd_staged_host``
and ``test_overload``.

The model is the offline tiny Llama in float32 (docs/vllm-cpu.md: bf16 random models have
exact top-2 ties). The single-engine reference is the decode server itself, asked
without ``kv_transfer_params``. Where outputs differ, the reference's top-2 logprob
gap at the first differing position must be below ``GG_TIE_MARGIN`` (a tie), and ties
are reported. The decode's KV after each pull equals the prefill's K/V of the blocks
it sent, token for token (both sides dump them, ``HAWK_DEBUG_DIR``).

Decode-first serving runs on the same trio through more proxies over its engines
(``LocalCluster.add_proxy``): a short prompt and a prompt the decode holds most of reach
the decode only (the prefill sees nothing), a long one still goes P/D, and a ``/tokenize``
that fails (times out) sends the request P/D; ``/metrics`` counts each.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import time
import urllib.parse

import pytest
from e2e_helpers import (
    BLOCK,
    GG_MAX_TOKENS,
    GG_TIE_MARGIN,
    check_regrouped_kv,
    complete,
    gg_prompts,
    greedy_divergence,
    stream_events,
)
from vllm_fixtures import http_post_json, running

pytestmark = pytest.mark.vllm

DECODE_BLOCK = 2 * BLOCK  # the decode regroups two prefill blocks into each of its own


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("mooncake.engine")
    from vllm_hawk.bench.local_cluster import LocalCluster
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    model = build_tiny_llama(dtype="float32")
    work = tmp_path_factory.mktemp("pd")
    c = LocalCluster(
        model,
        work,
        block_size=BLOCK,
        decode_block_size=DECODE_BLOCK,
        extra_config={"pull_timeout_s": 10.0, "handshake_timeout_s": 3.0},
        prefill_config={"lease_s": 30.0},
        extra_env={"HAWK_DEBUG_DIR": str(work / "hawk-debug")},
    )
    c.hawk_dump, c.hawk_checked = work / "hawk-debug", set()
    with running(c):
        yield c


def test_greedy_outputs_match_single_engine(cluster, record_property):
    prompts = gg_prompts()
    assert len(prompts) >= 20
    with cf.ThreadPoolExecutor(4) as pool:  # several pulls in flight at once
        disagg = list(pool.map(lambda p: complete(cluster.proxy_url, p, max_tokens=GG_MAX_TOKENS), prompts))
    ref = [complete(cluster.decode_url, p, max_tokens=GG_MAX_TOKENS, logprobs=2) for p in prompts]
    # Again through the proxy: the decode now has these prompts' prefixes cached, so the
    # pulls start after the local hit (first_block > 0).
    again = [complete(cluster.proxy_url, p, max_tokens=GG_MAX_TOKENS) for p in prompts[-4:]]
    ties, mismatches = [], []
    for p, d, r in zip(prompts + prompts[-4:], disagg + again, ref + ref[-4:], strict=False):
        assert len(d["token_ids"]) == GG_MAX_TOKENS
        div = greedy_divergence(d["token_ids"], r)
        if div is not None:
            (ties if div[1] < GG_TIE_MARGIN else mismatches).append((len(p), *div))
    record_property("ties", ties)
    if ties:
        print(f"top-2 ties (prompt_len, position, gap): {ties}")
    assert not mismatches, f"outputs differ beyond ties (prompt_len, position, gap): {mismatches}"
    figs = [f for f in ((d["kv_transfer_params"] or {}).get("hawk_transfer") for d in disagg + again) if f]
    assert len(figs) >= len(prompts) // 2 and all(f["ok"] and f["src_block_size"] == BLOCK for f in figs), figs
    pulls = check_regrouped_kv(cluster.hawk_dump, cluster.hawk_checked)  # the KV, token for token
    print(f"regrouped pulls (prefill blocks -> decode blocks from first_block): {pulls}")
    assert len(pulls) == len(figs)
    assert any(p["first_block"] > 0 for p in pulls), "no pull started after a local prefix hit"


def test_streaming_and_chat_through_proxy(cluster):
    prompt = "The decode engine reads the cache blocks of the prefill engine"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, events = stream_events(cluster.proxy_url + "/v1/completions", body)
    # one event may carry every token: vLLM merges the deltas its API server has not sent yet
    assert status == 200 and events and events[-1]["choices"][0]["finish_reason"] == "length", events[-1:]
    streamed = "".join(e["choices"][0]["text"] for e in events)
    status, whole = http_post_json(cluster.proxy_url + "/v1/completions", body)
    assert status == 200 and streamed == whole["choices"][0]["text"]

    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, out = http_post_json(cluster.proxy_url + "/v1/chat/completions", chat)
    assert status == 200, out
    status, events = stream_events(cluster.proxy_url + "/v1/chat/completions", chat)
    assert status == 200
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == out["choices"][0]["message"]["content"]


def _usage(url: str) -> float:
    from vllm_hawk.bench.local_cluster import scrape_metrics

    return scrape_metrics(url).get("vllm:kv_cache_usage_perc", -1.0)


def _wait_idle(cluster, timeout_s: float = 45.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        p, d = _usage(cluster.prefill_url), _usage(cluster.decode_url)
        if (p, d) == (0.0, 0.0) or time.monotonic() > deadline:
            return p, d
        time.sleep(0.5)


def test_client_disconnect_frees_blocks_on_both_sides(cluster):
    assert _wait_idle(cluster) == (0.0, 0.0)
    u = urllib.parse.urlsplit(cluster.proxy_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {
        "model": "tiny",
        "prompt": [0] + list(range(5, 300)),
        "max_tokens": 600,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    for _ in range(3):  # decoding has started: KV was pulled, blocks are in use
        r.readline()
    assert _usage(cluster.decode_url) > 0.0
    conn.sock.close()  # client goes away mid-stream
    conn.close()
    assert _wait_idle(cluster) == (0.0, 0.0)


def test_dead_prefill_fails_the_request_and_decode_keeps_serving(cluster):
    from vllm_hawk.bench.local_cluster import free_port, scrape_metrics

    failed0 = scrape_metrics(cluster.decode_url).get("vllm:hawk_failed_transfers_total", 0.0)
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "gone",
        "remote_request_id": "cmpl-gone-0",
        "remote_block_ids": [1, 2],
        "remote_num_tokens": 40,
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
    }
    t0 = time.monotonic()
    status, out = http_post_json(
        cluster.decode_url + "/v1/completions",
        {"model": "tiny", "prompt": [0] + list(range(10, 49)), "max_tokens": 4, "kv_transfer_params": params},
    )
    assert status == 500, out
    assert time.monotonic() - t0 < 15  # within handshake_timeout_s (3 s) + slack
    log = cluster.servers["decode"].log_tail(200_000)
    assert "handshake with prefill gone" in log
    assert scrape_metrics(cluster.decode_url)["vllm:hawk_failed_transfers_total"] >= failed0 + 1
    # a request the prefill does not know fails fast too (unknown_request)
    params.update(
        remote_port=json.loads(cluster.servers["prefill"].argv[-1])["kv_connector_extra_config"]["side_channel_port"]
    )
    status, _ = http_post_json(
        cluster.decode_url + "/v1/completions",
        {"model": "tiny", "prompt": [0] + list(range(10, 49)), "max_tokens": 4, "kv_transfer_params": params},
    )
    assert status == 500
    # ... and the decode keeps serving
    assert complete(cluster.proxy_url, [0] + list(range(7, 90)), max_tokens=GG_MAX_TOKENS)["token_ids"]
    assert _wait_idle(cluster) == (0.0, 0.0)


def test_metrics_in_prometheus(cluster):
    from vllm_hawk.bench.local_cluster import scrape_metrics

    complete(cluster.proxy_url, [0] + list(range(3, 70)), max_tokens=GG_MAX_TOKENS)
    d = scrape_metrics(cluster.decode_url)
    assert d["vllm:hawk_transfer_time_seconds_count"] >= 1
    assert d["vllm:hawk_transfer_bytes_sum"] > 0
    assert d["vllm:hawk_transfer_operations_count"] >= 1
    assert d["vllm:hawk_transfer_segments_sum"] >= 1
    p = scrape_metrics(cluster.prefill_url)
    assert p["vllm:hawk_released_total"] >= 1


def test_proxy_propagates_upstream_errors_and_health(cluster):
    from vllm_hawk.bench.local_cluster import http_get

    status, out = http_post_json(
        cluster.proxy_url + "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}
    )
    assert status == 404 and "nope" in json.dumps(out)
    assert http_get(cluster.proxy_url + "/health?deep=1")[0] == 200


def test_vllm_bench_serve_targets_the_proxy(cluster):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from vllm_hawk.bench.tiny_model import build_tiny_llama

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_hawk.vllm_launcher",
            "bench",
            "serve",
            "--backend",
            "openai",
            "--base-url",
            cluster.proxy_url,
            "--endpoint",
            "/v1/completions",
            "--model",
            "tiny",
            "--tokenizer",
            str(build_tiny_llama(dtype="float32")),
            "--dataset-name",
            "random",
            "--random-input-len",
            "80",
            "--random-output-len",
            "4",
            "--num-prompts",
            "8",
            "--max-concurrency",
            "4",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(root)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Successful requests:                     8" in out.stdout
    assert "Failed requests:                         0" in out.stdout


# ---------------------------------------------------------------- decode-first serving
DF_MAX_TOKENS = 64  # the decode-first proxy's --local-prefill-max-tokens here


def _prefills(proxy_url: str) -> dict[str, float]:
    from vllm_hawk.bench.decode_first import scrape_prefills

    return scrape_prefills(proxy_url)


def _post_with_headers(url: str, body: dict) -> tuple[int, dict, dict]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    finally:
        conn.close()


def _greedy(url: str, prompt, n: int = GG_MAX_TOKENS) -> tuple[dict, dict]:
    """(response headers, first choice) of a greedy completion through ``url``."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    status, headers, out = _post_with_headers(url + "/v1/completions", {**body, "return_token_ids": True})
    assert status == 200, out
    return headers, {**out["choices"][0], "kv_transfer_params": out.get("kv_transfer_params")}


def _same_as_single_engine(cluster, prompt, got: dict) -> None:
    """``got`` equals the prefill engine's own greedy answer (asked without
    ``kv_transfer_params``: one engine alone), up to top-2 ties."""
    ref = complete(cluster.prefill_url, prompt, max_tokens=GG_MAX_TOKENS, logprobs=2)
    div = greedy_divergence(got["token_ids"], ref)
    assert div is None or div[1] < GG_TIE_MARGIN, f"output differs at {div} (position, top-2 gap)"


@pytest.fixture(scope="module")
def decode_first(cluster):
    """A proxy with decode-first serving on (both rules) over the trio's engines."""
    return cluster.add_proxy(
        "decode-first",
        ["--local-prefill-max-tokens", str(DF_MAX_TOKENS), "--local-prefill-min-cached", "0.5"]
        + ["--decode-block-size", str(DECODE_BLOCK)],
    )


def test_decode_first_short_prompt_reaches_the_decode_only(cluster, decode_first):
    from vllm_hawk.bench.local_cluster import scrape_metrics

    prefill0 = scrape_metrics(cluster.prefill_url).get("vllm:prompt_tokens_total", 0.0)
    ids = [0] + list(range(11, 11 + DF_MAX_TOKENS - 2))  # one token under the threshold
    text = "The decode engine reads the cache"  # the byte bound shows it short: no /tokenize
    got = {}
    for prompt in (ids, text):
        headers, got[str(prompt)] = _greedy(decode_first, prompt)
        assert headers["x-hawk-prefill"] == "local" and headers["x-hawk-prefill-reason"] == "short_prompt"
        assert headers["x-hawk-decode"] == cluster.decode_url and "x-hawk-prefill-ms" not in headers
        assert not (got[str(prompt)]["kv_transfer_params"] or {}).get("hawk_transfer")  # nothing pulled
    assert scrape_metrics(cluster.prefill_url).get("vllm:prompt_tokens_total", 0.0) == prefill0  # never asked
    c = _prefills(decode_first)
    assert c.get("local/short_prompt") == 2 and c.get("tokenize_count", 0) == 0, c  # the bound decided both
    for prompt in (ids, text):
        _same_as_single_engine(cluster, prompt, got[str(prompt)])
    # a client's own kv_transfer_params never reach the decode (it would pull from where they say)
    bogus = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "cmpl-x-0"}
    bogus.update(remote_block_ids=[1], remote_num_tokens=40, remote_host="127.0.0.1", remote_port=9)
    status, headers, out = _post_with_headers(
        decode_first + "/v1/completions",
        {"model": "tiny", "prompt": ids, "max_tokens": 2, "kv_transfer_params": bogus},
    )
    assert status == 200 and headers["x-hawk-prefill"] == "local", out


def test_decode_first_long_prompt_still_goes_pd_then_its_extension_stays_local(cluster, decode_first):
    """A prompt of DF_MAX_TOKENS or more goes P/D (and is recorded as the decode's); the same
    prompt with a short question added is covered by what the decode holds (> half of it)
    and reaches the decode only, which takes the prefix from its own cache."""
    from vllm_hawk.bench.local_cluster import scrape_metrics

    c0 = _prefills(decode_first)
    long = "Tokens of a long document about banks and rings. " * 12  # a text: counted by /tokenize
    headers, got = _greedy(decode_first, long)
    assert headers["x-hawk-prefill"] == cluster.prefill_url and headers["x-hawk-prefill-reason"] == "long_prompt"
    assert float(headers["x-hawk-prefill-ms"]) > 0 and got["kv_transfer_params"]["hawk_transfer"]["ok"]
    _same_as_single_engine(cluster, long, got)

    prefill0 = scrape_metrics(cluster.prefill_url).get("vllm:prompt_tokens_total", 0.0)
    hits0 = scrape_metrics(cluster.decode_url).get("vllm:prefix_cache_hits_total", 0.0)
    follow = long + "What does the decode read?"
    headers, got = _greedy(decode_first, follow)
    assert headers["x-hawk-prefill"] == "local" and headers["x-hawk-prefill-reason"] == "cached_prefix"
    assert scrape_metrics(cluster.prefill_url).get("vllm:prompt_tokens_total", 0.0) == prefill0
    assert scrape_metrics(cluster.decode_url).get("vllm:prefix_cache_hits_total", 0.0) >= hits0 + DECODE_BLOCK
    _same_as_single_engine(cluster, follow, got)
    c = _prefills(decode_first)
    assert c.get("remote/long_prompt", 0) - c0.get("remote/long_prompt", 0) == 1, c
    assert c.get("local/cached_prefix", 0) - c0.get("local/cached_prefix", 0) == 1, c
    assert c["tokenize_count"] - c0.get("tokenize_count", 0) == 2 and "tokenize_fallbacks/timeout" not in c


def test_decode_first_tokenize_that_times_out_falls_back_to_pd(cluster):
    """A /tokenize round trip that takes longer than --tokenize-timeout-s (here 0.1 ms, less
    than any real round trip) is counted, and the request goes P/D and succeeds."""
    url = cluster.add_proxy(
        "tokenize-timeout",
        ["--local-prefill-max-tokens", str(DF_MAX_TOKENS), "--tokenize-timeout-s", "0.0001"]
        + ["--decode-block-size", str(DECODE_BLOCK)],
    )
    prompt = "A prompt long enough that the byte bound cannot show it short, so the proxy asks"
    headers, got = _greedy(url, prompt)
    assert headers["x-hawk-prefill"] == cluster.prefill_url and headers["x-hawk-prefill-reason"] == "tokenize_failed"
    assert got["kv_transfer_params"]["hawk_transfer"]["ok"]
    _same_as_single_engine(cluster, prompt, got)
    c = _prefills(url)
    assert c.get("tokenize_fallbacks/timeout") == 1 and c.get("remote/tokenize_failed") == 1, c
    assert "proxy: /tokenize at" in cluster.servers["proxy-tokenize-timeout"].log_tail()
