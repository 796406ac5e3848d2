"""``kv_load_failure_policy="recompute"``: a decode whose prefill is gone recomputes the
prompt locally and answers as a single engine would (in-process engine, subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = textwrap.dedent("""
    import json, os, socket, sys, time
    from vllm_hawk.vllm_launcher import ensure_vllm_dist
    ensure_vllm_dist()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm_hawk.bench.tiny_model import build_tiny_llama

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); dead_port = s.getsockname()[1]
    ktc = KVTransferConfig(kv_connector="HawkConnector", kv_connector_module_path="vllm_hawk.connector",
                           kv_role="kv_consumer", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"handshake_timeout_s": 1.0,
                                                      "shared_secret": "recompute-test-secret-0123",
                                                      "pull_timeout_s": 3.0})
    llm = LLM(model=str(build_tiny_llama(dtype="float32")), dtype="float32", enforce_eager=True,
              max_model_len=512, block_size=32, max_num_seqs=4, seed=0, kv_transfer_config=ktc,
              enable_prefix_caching=False)
    prompt = {"prompt_token_ids": [0] + list(range(40, 140))}
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
              "remote_request_id": "cmpl-gone", "remote_block_ids": [1, 2, 3, 4],
              "remote_num_tokens": 101, "remote_host": "127.0.0.1", "remote_port": dead_port}
    t0 = time.monotonic()
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                extra_args={"kv_transfer_params": params}))
    took = time.monotonic() - t0
    ref = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    print("RESULT " + json.dumps({"got": list(out[0].outputs[0].token_ids),
                                  "want": list(ref[0].outputs[0].token_ids),
                                  "finish": out[0].outputs[0].finish_reason, "took_s": took}))
    llm.llm_engine.engine_core.shutdown()
""")


def test_recompute_policy_recovers_from_a_dead_prefill(tmp_path):
    from vllm_hawk.vllm_launcher import ensure_vllm_dist

    if ensure_vllm_dist() is None:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("mooncake.engine")
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        PYTHONPATH=str(root),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("VLLM_TARGET_DEVICE", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[7:])
    assert res["got"] == res["want"] and res["finish"] == "length"
    assert res["took_s"] < 30
    assert "handshake with prefill gone" in out.stderr + out.stdout
