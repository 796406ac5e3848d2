"""Plain ``vllm serve`` of the TEST model with vllm-tt-plugin on a simulated p150a: the plugin's
own worker (no ``--worker-cls``, no KV connector), the model from ``EXTRA_MODELS_DIR``. Its
greedy tokens equal the tiny Llama's reference (transformers, float32) except at top-2 ties;
bfloat8_b KV (tt_transformers' default precision)."""

from __future__ import annotations

import sys
import time

import pytest
from e2e.e2e_helpers import GN_TIE_MARGIN, greedy_divergence
from tt_decode_helpers import decode_env, hf_greedy
from vllm_fixtures import complete, token_prompts

from vllm_hawk.bench.local_cluster import Server, free_port, http_get

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def plain(manifest, tmp_path_factory):
    import os

    from vllm_hawk.bench.tiny_model import build_tiny_llama

    model = build_tiny_llama(dtype="bfloat16")
    work = tmp_path_factory.mktemp("plain")
    port = free_port()
    argv = [
        sys.executable,
        *("-m", "vllm.entrypoints.cli.main", "serve", str(model)),
        *("--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--dtype", "bfloat16"),
        *("--max-model-len", "1024", "--block-size", "32", "--max-num-seqs", "4", "--shutdown-timeout", "10"),
    ]
    env = dict(os.environ, **decode_env(manifest, "p150a"), HF_HUB_OFFLINE="1")
    s = Server("plain", argv, env, work / "plain.log", f"http://127.0.0.1:{port}", graceful=True)
    s.start()
    t0 = time.monotonic()
    try:
        while True:
            assert s.proc.poll() is None, s.log_tail()
            try:
                if http_get(s.url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() - t0 < 900, s.log_tail()
            time.sleep(1)
        print(f"\n[plain] vllm-tt-plugin server up in {time.monotonic() - t0:.1f} s")
        s.model = model
        yield s
    finally:
        s.stop()


def test_plain_serve_equals_the_reference(plain):
    ties, mismatches = [], []
    for p in token_prompts(29, (5, 40, 100)):
        got = complete(plain.url, p, max_tokens=MAX_TOKENS)
        div = greedy_divergence(got["token_ids"], hf_greedy(plain.model, p, MAX_TOKENS))
        if div is not None:
            (ties if div[1] < GN_TIE_MARGIN else mismatches).append((len(p), *div))
    print(f"[plain] top-2 ties (prompt_len, position, gap): {ties}")
    assert not mismatches, f"outputs differ beyond ties: {mismatches}"
    assert "HAWK Tenstorrent decode" not in (plain.log_path.read_text())  # the plugin's worker, not ours
