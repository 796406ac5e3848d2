"""End-to-end integrity with real engines: corrupted KV never reaches an answer.

Each cluster is a prefill vLLM, a decode vLLM and ``hawk proxy``; the fault is a FAKE
loaded into one server's processes (``tests/integrity/faults/sitecustomize.py``):

* **GG-Direct, a bit flipped in flight, ``kv_load_failure_policy: recompute``**: the
  decode's transport flips one bit in every READ batch it lands. Every pull fails its
  check and is counted (``vllm:hawk_integrity_failures_total``); the decode recomputes
  each prompt, so every answer equals the single engine's (the decode asked directly).
* **GN-HAWK (emulated Tenstorrent decode), a block reused before the READ,
  ``kv_load_failure_policy: fail``**: the prefill overwrites 64 bytes of every KVReady's
  first segment after taking its checksums. Every request that pulls fails (no answer
  text), one that pulls nothing (a prompt of one block) is answered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import BLOCK, GG_MAX_TOKENS, GG_TIE_MARGIN, complete, greedy_divergence, token_prompts
from vllm_fixtures import http_post_json, running

from vllm_hawk.bench.local_cluster import scrape_metrics

pytestmark = pytest.mark.vllm

FAULTS = str(Path(__file__).resolve().parents[1] / "integrity" / "faults")


def _cluster(tmp_path_factory, name: str, model_dtype: str, policy: str, role: str, fault: str):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("mooncake.engine")
    from vllm_hawk.bench.local_cluster import LocalCluster
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    env = {"HAWK_TEST_FAULT": fault, "PYTHONPATH": FAULTS}
    return LocalCluster.configured(
        name,
        build_tiny_llama(dtype=model_dtype),
        tmp_path_factory.mktemp(f"integrity-{name}"),
        dtype=model_dtype,
        block_size=BLOCK,
        decode_policy=policy,
        extra_config={"pull_timeout_s": 10.0, "handshake_timeout_s": 3.0},
        **{f"{role}_env": env},
    )


def _counter(url: str, name: str) -> float:
    return sum(v for k, v in scrape_metrics(url).items() if k.startswith(name))


@pytest.fixture(scope="module")
def flipping(tmp_path_factory):
    c = _cluster(tmp_path_factory, "GG-Direct", "float32", "recompute", "decode", "flip")
    with running(c, "integrity flip"):
        yield c


@pytest.fixture(scope="module")
def reusing(tmp_path_factory):
    c = _cluster(tmp_path_factory, "GN-HAWK", "bfloat16", "fail", "prefill", "reuse")
    with running(c, "integrity reuse"):
        yield c


def test_a_bit_flipped_in_flight_is_recomputed_never_served(flipping):
    prompts = token_prompts(13, (40, 70, 100, 129))
    got = [complete(flipping.proxy_url, p, max_tokens=GG_MAX_TOKENS) for p in prompts]
    ref = [complete(flipping.decode_url, p, max_tokens=GG_MAX_TOKENS, logprobs=2) for p in prompts]
    for p, g, r in zip(prompts, got, ref, strict=True):
        fig = (g["kv_transfer_params"] or {}).get("hawk_transfer") or {}
        assert fig.get("ok") is False and "failed the integrity check" in fig.get("error", ""), fig
        div = greedy_divergence(g["token_ids"], r)
        assert div is None or div[1] < GG_TIE_MARGIN, (len(p), div)
    assert _counter(flipping.decode_url, "vllm:hawk_integrity_failures_total") == len(prompts)
    assert _counter(flipping.decode_url, "vllm:hawk_failed_transfers_total") == len(prompts)
    log = flipping.servers["decode"].log_tail(200000)
    assert "failed the integrity check" in log and "bank" in log and "segment" in log


def test_a_block_reused_before_the_read_fails_the_request_never_answers(reusing):
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for n in (40, 100):
        status, out = http_post_json(
            reusing.proxy_url + "/v1/completions", {**body, "prompt": token_prompts(17, (n,))[0]}
        )
        text = out if isinstance(out, str) else (out.get("choices") or [{}])[0].get("text")
        assert status != 200 or not text, (n, status, out)
    short = token_prompts(19, (BLOCK,))[0]  # one block: a Tenstorrent decode pulls nothing
    status, out = http_post_json(reusing.proxy_url + "/v1/completions", {**body, "prompt": short})
    assert status == 200 and out["choices"][0]["text"], out
    assert _counter(reusing.decode_url, "vllm:hawk_integrity_failures_total") == 2
