"""The other transfer paths end to end: ``mode=staged`` (prefill ring buffer, decode
receive buffer) over the ``host-staged`` transport (GG-Host), and lease expiry: a
prefill whose decode never comes frees the blocks after ``lease_s``."""

from __future__ import annotations

import time

import pytest
from e2e_helpers import BLOCK, GG_MAX_TOKENS, GG_TIE_MARGIN, complete, gg_prompts, greedy_divergence
from vllm_fixtures import http_post_json, running

pytestmark = pytest.mark.vllm

LEASE_S = 8.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    from vllm_hawk.bench.local_cluster import LocalCluster
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    c = LocalCluster(
        build_tiny_llama(dtype="float32"),
        tmp_path_factory.mktemp("pd-staged"),
        block_size=BLOCK,
        extra_config={"transport": "host-staged", "mode": "staged", "ring_nbytes": 8 << 20, "pull_timeout_s": 10.0},
        prefill_config={"lease_s": LEASE_S},
    )
    with running(c):
        yield c


def test_staged_host_outputs_match_single_engine(cluster):
    from vllm_hawk.bench.local_cluster import scrape_metrics

    prompts = gg_prompts()[::3]
    disagg = [complete(cluster.proxy_url, p, max_tokens=GG_MAX_TOKENS) for p in prompts]
    ref = [complete(cluster.decode_url, p, max_tokens=GG_MAX_TOKENS, logprobs=2) for p in prompts]
    for p, d, r in zip(prompts, disagg, ref, strict=False):
        div = greedy_divergence(d["token_ids"], r)
        if div is not None:
            assert div[1] < GG_TIE_MARGIN, f"prompt of {len(p)} tokens differs at {div[0]}"
    m = scrape_metrics(cluster.decode_url)
    # staged: each layer's stream is one contiguous ring range -> one READ per layer at most
    assert m["vllm:hawk_transfer_operations_sum"] <= 4 * m["vllm:hawk_transfer_operations_count"]


def test_lease_expiry_frees_prefill_blocks(cluster):
    from vllm_hawk.bench.local_cluster import scrape_metrics

    before = scrape_metrics(cluster.prefill_url).get("vllm:hawk_expired_leases_total", 0.0)
    status, out = http_post_json(
        cluster.prefill_url + "/v1/completions",
        {
            "model": "tiny",
            "prompt": [0] + list(range(20, 150)),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    assert status == 200 and out["kv_transfer_params"]["remote_block_ids"]
    assert scrape_metrics(cluster.prefill_url)["vllm:kv_cache_usage_perc"] > 0  # held
    deadline = time.monotonic() + LEASE_S + 15
    while time.monotonic() < deadline:
        m = scrape_metrics(cluster.prefill_url)
        if m["vllm:kv_cache_usage_perc"] == 0.0 and m.get("vllm:hawk_expired_leases_total", 0.0) >= before + 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"blocks still held after the lease: {m.get('vllm:kv_cache_usage_perc')}")
    # a decode that comes after the lease gets a clear refusal (expired) -> HTTP 500
    status, _ = http_post_json(
        cluster.decode_url + "/v1/completions",
        {
            "model": "tiny",
            "prompt": [0] + list(range(20, 150)),
            "max_tokens": 2,
            "kv_transfer_params": out["kv_transfer_params"],
        },
    )
    assert status == 500
    assert "blocks were expired" in cluster.servers["decode"].log_tail(200_000)
